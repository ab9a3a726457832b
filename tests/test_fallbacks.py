"""Fallbacks are reported, never silent: a `FallbackWarning` (an error in this suite,
pyproject's filterwarnings), `plan.solver["fallbacks"]`, `plan.summary()` and
`Traced.fallbacks`; the program stays correct."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.passes import fallbacks
from autopar.passes import strategies as st

from models import gpt_case, mlp_case


def _tanh_step(params, x):
    def loss(p):
        return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def test_a_primitive_without_a_rule_is_reported_and_still_correct(monkeypatch):
    monkeypatch.delitem(st.strategy_rules, "tanh")
    params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((16, 8)), jnp.float32)}
    x = jnp.asarray(np.random.default_rng(1).standard_normal((32, 16)), jnp.float32)
    step = autopar.parallelize(_tanh_step, method=autopar.ShardParallel(mesh_shape=(4,)),
                               devices=jax.devices()[:4], donate_argnums=())
    with pytest.warns(autopar.FallbackWarning, match="no sharding rule for primitive 'tanh'"):
        traced = step.trace(params, x)
    found = traced.plan.solver["fallbacks"]
    assert found and all(f["stage"] == "intra-op" for f in found), found
    assert any("test_fallbacks.py" in f["where"] for f in found), found
    assert "fallbacks" in traced.plan.summary() and "'tanh'" in traced.plan.summary()
    assert traced.fallbacks and isinstance(traced.fallbacks[0], autopar.Fallback)
    new, value = step(params, x)
    ref_new, ref_value = jax.jit(_tanh_step)(params, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new["w"], ref_new["w"], rtol=1e-5, atol=1e-6)


def test_collections_nest_and_keep_each_fallback_once():
    with fallbacks.collecting() as outer:
        with pytest.warns(autopar.FallbackWarning):
            fallbacks.report("intra-op", "x replicated", "a.py:1")
        with fallbacks.collecting() as inner:
            with pytest.warns(autopar.FallbackWarning):
                fallbacks.report("intra-op", "x replicated", "a.py:1")
                fallbacks.report("gradient reduction", "summed", "")
    assert outer == [fallbacks.Fallback("intra-op", "x replicated", "a.py:1"),
                     fallbacks.Fallback("gradient reduction", "summed")]
    assert inner == outer
    assert str(outer[0]) == "intra-op: x replicated (at a.py:1)"


@pytest.mark.parametrize("make", [lambda: mlp_case(batch=32),
                                  lambda: gpt_case(batch=8, seq=8)], ids=["mlp", "gpt"])
def test_standard_models_plan_and_run_without_fallbacks(make):
    case = make()
    state, batch = case.init()
    for method in (autopar.ShardParallel(time_limit_s=10.0),
                   autopar.PipeshardParallel(num_micro_batches=2, num_stages=2)):
        traced = autopar.parallelize(case.step, method=method, donate_argnums=()).trace(
            state, batch)
        traced.lower()
        assert traced.fallbacks == (), [str(f) for f in traced.fallbacks]



def test_stage_costs_priced_side_by_side_report_their_fallbacks():
    """The stage search prices sub-meshes side by side on threads
    (`pipeline_search.reuse._price_side_by_side`): a fallback a layer build reports there reaches
    the caller's collection (each thread runs in a copy of the caller's context)."""
    from autopar.pipeline_search.reuse import _price_side_by_side

    def range_cost(i, j, submesh):
        fallbacks.report("intra-op", f"layers {i}-{j} on {submesh} replicated")

    with fallbacks.collecting() as found, pytest.warns(autopar.FallbackWarning):
        _price_side_by_side(range_cost, [(1, 1), (1, 2)], [(0, 0, 0), (0, 1, 1), (1, 1, 0)])
    assert sorted(f.what for f in found) == [
        "layers 0-0 on (1, 1) replicated", "layers 0-1 on (1, 2) replicated",
        "layers 1-1 on (1, 1) replicated"]
