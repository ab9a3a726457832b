"""The library's import graph (issue 42: no module import cycle, layers one way).

The graph is read from the source, not from a running interpreter: every `import` and
`from ... import` statement of each module of `autopar`, `autopar.passes` and
`autopar.cost_model` is an edge, the ones inside functions included (a function-level
import that closes a cycle only hides it).  Blocks under `if TYPE_CHECKING:` never run
and are not edges.  A module's edge to a package that contains it is not an edge either:
Python initializes every parent package before the module, whoever imports it.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Source folder of each package (pyproject's package-dir: passes/ and cost_model/ are
# installed as autopar.passes and autopar.cost_model).
PACKAGES = {"autopar": ROOT / "autopar", "autopar.passes": ROOT / "passes",
            "autopar.cost_model": ROOT / "cost_model"}
# What planning (passes/, cost_model/) may import from autopar/ outside them: nothing (the
# graph data types are `autopar.passes.ir`; `autopar.graph` builds and runs them).
PLANNING = ("autopar.passes", "autopar.cost_model")
PLANNING_MAY_IMPORT: set[str] = set()


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if package == "autopar" and parts and f"autopar.{parts[0]}" in PACKAGES:
                continue
            out[name] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(body: list[ast.stmt]):
    """Import statements at any depth of `body`, skipping `if TYPE_CHECKING:` blocks."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node):
            yield from _statements(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, ()) or ():
                    yield from _statements([child] if isinstance(child, ast.stmt)
                                           else getattr(child, "body", []))


def _targets(module: str, is_package: bool, node: ast.stmt, known: set[str]) -> set[str]:
    """The library modules an import statement runs (the deepest known prefix of each)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")[: len(module.split(".")) - (0 if is_package else 1)]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        subs = [f"{source}.{alias.name}" for alias in node.names]
        names = [s for s in subs if s in known] or [source]
    out = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module and not module.startswith(name + "."):
            out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[name] = set().union(*(_targets(name, is_package, node, known)
                                    for node in _statements(tree.body)))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_walker_reads_every_module_and_finds_a_cycle(graph):
    assert {"autopar.api", "autopar.passes.intra_op", "autopar.cost_model.cluster",
            "autopar.passes.solver.pool"} <= set(graph)
    assert "autopar.passes.ir" in graph["autopar.passes.intra_op"]
    assert "autopar.passes.ir" in graph["autopar.graph"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_import_cycle(graph):
    found = cycles(graph)
    assert not found, "import cycles (every import counted, function-level ones too): " + \
        "; ".join(" <-> ".join(c) for c in found)


def test_planning_imports_nothing_from_the_runtime(graph):
    wrong = {m: sorted(d for d in deps if not d.startswith(PLANNING)
                       and d.startswith("autopar") and d not in PLANNING_MAY_IMPORT)
             for m, deps in graph.items() if m.startswith(PLANNING)}
    assert not {m: d for m, d in wrong.items() if d}


def test_solver_and_graph_types_import_without_jax():
    """The sharding solver (every module of `autopar.passes.solver`) and the graph data
    types (`autopar.passes.ir`) import with JAX blocked, and pull in no module of autopar
    outside them but the (lazy) package `__init__`s."""
    code = (
        "import importlib, pkgutil, sys\n"
        "sys.modules['jax'] = None\n"
        "import autopar.passes.ir, autopar.passes.solver as s\n"
        "for m in pkgutil.walk_packages(s.__path__, 'autopar.passes.solver.'):\n"
        "    importlib.import_module(m.name)\n"
        "loaded = [m for m, v in sys.modules.items() if v is not None]\n"
        "jax = [m for m in loaded if m == 'jax' or m.startswith('jax.')]\n"
        "assert not jax, jax\n"
        "other = [m for m in loaded if m.startswith('autopar') and m not in "
        "('autopar', 'autopar.passes', 'autopar.passes.ir') "
        "and not m.startswith('autopar.passes.solver')]\n"
        "assert not other, other\n"
        "assert len([m for m in loaded if m.startswith('autopar.passes.solver.')]) > 15\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
