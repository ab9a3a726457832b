"""The primitive registry (`autopar.passes.primitives`, issue 42 item 1).

(a) It imports without JAX.
(b) Every primitive the zoo's toy train steps (each optimizer) and the test zoo's cases emit,
    at any depth of the traced jaxpr, has an entry of its own (not `DEFAULT`).
(c) Each alias reads its canonical entry, and the readers answer alike for both spellings.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.extend.core as jcore
import pytest

from autopar import inline, markers
from autopar import models as zoo
from autopar.graph import Graph
from autopar.passes import primitives
from autopar.passes import strategies as st

from models import CASE_NAMES, make_case


def test_registry_imports_without_jax():
    code = ("import sys; sys.modules['jax'] = None\n"
            "import autopar.passes.primitives as p\n"
            "assert p.info('dot_general').heavy\n"
            "assert not any(m == 'jax' or m.startswith('jax.') for m in sys.modules "
            "if sys.modules[m] is not None), 'jax imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _names(jaxpr, out: set[str]) -> set[str]:
    for e in jaxpr.eqns:
        out.add(e.primitive.name)
        for sub in jcore.jaxprs_in_params(e.params):
            _names(sub, out)
    return out


def _traced(step, *args) -> set[str]:
    """Primitive names of `step`'s jaxpr as traced (calls and control-flow bodies
    included), as inlined (`autopar.inline`) and as flattened into a `Graph`."""
    with markers.recording():
        closed = jax.make_jaxpr(step)(*args)
    flat = inline.run(closed)
    names = _names(flat.jaxpr, _names(closed.jaxpr, set()))
    return names | {e.name for e in Graph.from_jaxpr(flat).eqns}


@pytest.mark.parametrize("name", ["gpt-toy", "moe-toy", "wrn-toy"])
def test_every_primitive_of_the_zoo_has_an_entry(name):
    seen: set[str] = set()
    for optimizer in sorted(zoo.OPTIMIZERS):
        step, args = zoo.train_step_and_args(name, 8, overrides={"optimizer": optimizer})
        seen |= _traced(step, *args)
    assert {"dot_general", "add"} <= seen
    missing = sorted(n for n in seen if not primitives.known(n))
    assert not missing, f"{name}: no registry entry for {missing}"
    assert all(primitives.info(n) is not primitives.DEFAULT for n in seen)


def test_every_primitive_of_the_test_cases_has_an_entry():
    seen: set[str] = set()
    for case_name in CASE_NAMES:
        case = make_case(case_name)
        seen |= _traced(case.step, *jax.eval_shape(case.init))
    assert {"scan", "random_bits"} <= seen
    missing = sorted(n for n in seen if not primitives.known(n))
    assert not missing, f"no registry entry for {missing}"


def test_unknown_primitive_gets_the_default_entry():
    info = primitives.info("some_new_primitive_xyz")
    assert info is primitives.DEFAULT and not primitives.known("some_new_primitive_xyz")
    assert info.flops is None and info.strategy is None and not info.fusible
    assert primitives.canonical("some_new_primitive_xyz") == "some_new_primitive_xyz"


def test_aliases_resolve_to_their_canonical_entry():
    assert primitives.ALIASES["scatter_add"] == "scatter-add"
    for alias, name in primitives.ALIASES.items():
        assert name in primitives.REGISTRY and alias not in primitives.REGISTRY
        assert primitives.canonical(alias) == name
        assert primitives.info(alias) is primitives.info(name)
        assert primitives.info(alias).name == name
        assert primitives.known(alias)
        # Both spellings have a strategy rule (or neither), of the same kind.
        if primitives.info(name).strategy is not None:
            assert st.strategy_rules[alias].kind == st.strategy_rules[name].kind
        else:
            assert alias not in st.strategy_rules and name not in st.strategy_rules
    assert set(primitives.spellings(lambda p: p.indexed)) == {
        "gather", "scatter-add", "scatter_add", "scatter"}


def test_entries_are_named_and_the_kept_differences_hold():
    """Each entry's name is its key; the facts that differ on purpose (see the
    `PrimitiveInfo` docstring) still do."""
    for name, info in primitives.REGISTRY.items():
        assert info.name == name
        if info.elementwise:
            assert info.fusible and info.strategy == "elementwise", name
        if info.layout_only:
            assert info.linear, name
    info = primitives.info
    assert info("neg").linear and not info("neg").layout_only
    assert info("reduce_xor").strategy == "reduce" and not info("reduce_xor").fusion_reduce
    assert info("reduce_xor").flops is not None
    assert info("sort").critical and not info("sort").param_use
    assert info("slice").fusible and not info("slice").layout_only
    assert info("broadcast_in_dim").source and info("broadcast_in_dim").strategy is not None
    assert info("random_bits").random and not info("random_bits").source
    assert info("remat2").body_param == "jaxpr" and not info("remat2").connects_body
