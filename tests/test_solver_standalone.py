"""The sharding solver is a standalone package: importing it, solving with it and running
its worker processes import neither JAX nor Orbax, nor any part of autopar outside
`autopar`, `autopar.passes` and the solver itself."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

SOLVER_DIR = pathlib.Path(__file__).resolve().parents[1] / "passes" / "solver"

_PROBE = """
import json, sys
import numpy as np
import autopar.passes.solver
from autopar.passes.solver import ShardingProblem, solve
from autopar.passes.solver.futures import SolvePool

a = np.array
problem = ShardingProblem(
    node_costs=(a([1.0, 2.0]), a([3.0, 1.0])), node_usages=(a([1.0, 1.0]), a([1.0, 1.0])),
    intervals=a([[0, 1], [1, 2]]), edges=a([[0, 1]]),
    edge_costs=(a([[0.0, 5.0], [5.0, 0.0]]),), usage_limit=None, name="tiny")
inline = solve(problem, time_limit_s=5.0, backend="auto")
with SolvePool(workers=1) as pool:
    pooled = pool.submit(problem, time_limit_s=5.0, backend="auto").result(timeout=60)
print(json.dumps({"modules": sorted(sys.modules), "inline": list(inline.strategies),
                  "pooled": list(pooled.strategies), "worker": pooled.stats.get("worker"),
                  "cost": inline.cost}))
"""


def _allowed(name: str) -> bool:
    return name in ("autopar", "autopar.passes") or name.startswith("autopar.passes.solver")


def test_solver_imports_no_jax_and_no_autopar_beyond_itself():
    """In a fresh interpreter: import the solver, solve a two-node problem inline and in
    a worker process; the modules loaded then."""
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=120, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    modules = out["modules"]
    heavy = [m for m in modules if m.split(".")[0] in ("jax", "jaxlib", "orbax", "flax")]
    assert heavy == []
    outside = [m for m in modules if m.startswith("autopar") and not _allowed(m)]
    assert outside == []
    assert out["inline"] == out["pooled"] == [1, 1] and out["cost"] == 3.0
    assert out["worker"] is True


def test_solver_modules_import_only_the_solver_package():
    """Every module in passes/solver imports its siblings relatively and nothing else of
    autopar (a worker runs `python -m autopar.passes.solver.worker`)."""
    pattern = re.compile(r"^\s*(?:from|import)\s+autopar\b", re.M)
    offenders = [p.name for p in sorted(SOLVER_DIR.glob("*.py"))
                 if pattern.search(p.read_text())]
    assert offenders == []


_LAZY_PROBE = """
import json, sys, types
import autopar
loaded_at_import = "jax" in sys.modules
import autopar.plan
names = {n: type(getattr(autopar, n)).__name__ for n in autopar.__all__}
print(json.dumps({"loaded_at_import": loaded_at_import, "names": names,
                  "dir": dir(autopar), "plan_is_function": callable(autopar.plan)
                  and not isinstance(autopar.plan, types.ModuleType),
                  "graph": autopar.graph.__name__}))
"""


def test_autopar_loads_its_public_names_on_first_use():
    """`import autopar` imports no JAX; every name of `autopar.__all__` loads on first use
    and is listed by dir(); `autopar.plan` stays the function after the submodule
    autopar/plan.py is imported; a submodule loads as an attribute (`autopar.graph`)."""
    proc = subprocess.run([sys.executable, "-c", _LAZY_PROBE], capture_output=True,
                          text=True, timeout=300, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded_at_import"] is False
    assert out["plan_is_function"] and out["graph"] == "autopar.graph"
    assert out["names"]["distributed"] == "module" and out["names"]["plan"] == "function"
    assert out["names"]["ShardParallel"] == "type"
    assert set(out["names"]) <= set(out["dir"])
    assert {"api", "planner", "solve_pool", "passes", "cost_model"} <= set(out["dir"])
