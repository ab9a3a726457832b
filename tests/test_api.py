"""The public API: decorator forms, caching, static and non-array arguments, plan files,
fingerprints, bad input."""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar

from helpers import cheap_comm_cluster
from models import mlp_case


def _loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def _sgd_step(w, x, lr=0.1):
    loss, g = autopar.value_and_grad(_loss)(w, x)
    return w - lr * g, loss


def _args(batch=16, d=8):
    k1, k2 = jax.random.split(jax.random.key(0))
    return jax.random.normal(k1, (d, d)), jax.random.normal(k2, (batch, d))


def test_grad_and_value_and_grad_match_jax_outside_parallelize():
    w, x = _args()
    np.testing.assert_array_equal(autopar.grad(_loss)(w, x), jax.grad(_loss)(w, x))
    v1, g1 = autopar.value_and_grad(_loss, argnums=1)(w, x)
    v2, g2 = jax.value_and_grad(_loss, argnums=1)(w, x)
    np.testing.assert_array_equal(v1, v2)
    np.testing.assert_array_equal(g1, g2)


def test_decorator_with_and_without_arguments():
    w, x = _args()
    plain = autopar.parallelize(_sgd_step)
    configured = autopar.parallelize(method=autopar.DataParallel())(_sgd_step)
    ref_w, ref_loss = jax.jit(_sgd_step)(w, x)
    for step in (plain, configured):
        new_w, loss = step(w, x)
        np.testing.assert_allclose(new_w, ref_w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert configured.__name__ == "_sgd_step"


def test_cache_per_avals_and_replan_on_new_shapes():
    step = autopar.parallelize(_sgd_step)
    w, x = _args(batch=16)
    p1 = step.get_plan(w, x)
    assert step.get_plan(w, x) is p1
    step(w, x)
    assert len(step._cache) == 1
    w2, x2 = _args(batch=32)
    p2 = step.get_plan(w2, x2)
    assert p2.fingerprint != p1.fingerprint
    new_w, _ = step(w2, x2)
    np.testing.assert_allclose(new_w, jax.jit(_sgd_step)(w2, x2)[0], rtol=1e-5, atol=1e-6)


def test_static_and_python_scalar_arguments():
    def step(w, x, lr, mode):
        loss, g = jax.value_and_grad(_loss)(w, x)
        w = w - lr * g if mode == "sgd" else w
        return w, loss

    par = autopar.parallelize(step, static_argnums=(3,))
    w, x = _args()
    for mode in ("sgd", "none"):
        got, _ = par(w, x, 0.5, mode)
        want, _ = jax.jit(step, static_argnums=(3,))(w, x, 0.5, mode)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(par._cache) == 2


def test_abstract_arguments_plan_without_running():
    step = autopar.parallelize(_sgd_step)
    w, x = _args()
    plan = step.get_plan(jax.ShapeDtypeStruct(w.shape, w.dtype),
                         jax.ShapeDtypeStruct(x.shape, x.dtype))
    assert plan.fingerprint == step.get_plan(w, x).fingerprint


def test_plan_round_trip_and_replay(tmp_path):
    case = mlp_case(optimizer="sgd")
    state, batch = case.init()
    cluster = cheap_comm_cluster()
    step = autopar.parallelize(case.step, method=autopar.ShardParallel(mesh_shape=(2, 4)),
                               cluster=cluster)
    plan = step.get_plan(state, batch)
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded == plan
    replay = autopar.parallelize(case.step, plan=str(path), cluster=cluster)
    s1, m1 = step(state, batch)
    s2, m2 = replay(state, batch)
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_plan_for_another_program_is_rejected(tmp_path):
    w, x = _args()
    plan = autopar.parallelize(_sgd_step).get_plan(w, x)
    path = tmp_path / "plan.json"
    plan.save(path)
    other = autopar.parallelize(lambda w, x: _sgd_step(w, x, lr=0.5), plan=path)
    with pytest.raises(autopar.FingerprintError, match=plan.fingerprint):
        other(w, x)


@pytest.mark.parametrize("field,value,message", [
    ("in_specs", [[["z"], []], [[], []]], "unknown mesh axis 'z'"),
    ("in_specs", [[["x"], []], [["x"], []]], "cannot be split"),
    ("device_ids", [0, 0, 1, 2, 3, 4, 5, 6], "duplicates"),
])
def test_hand_edited_invalid_plan_names_the_field(tmp_path, field, value, message):
    w, x = jnp.ones((8, 8)), jnp.ones((12, 8))   # batch 12 is not divisible by 8
    step = autopar.parallelize(_sgd_step, method=autopar.ShardParallel(mesh_shape=(8,)))
    data = step.get_plan(w, x).to_json()
    data[field] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(autopar.PlanError, match=message):
        autopar.parallelize(_sgd_step, plan=path)(w, x)


def test_malformed_plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(autopar.PlanError, match="not a JSON plan"):
        autopar.Plan.load(path)
    path.write_text(json.dumps({"format_version": 1}))
    with pytest.raises(autopar.PlanError, match="missing field 'fingerprint'"):
        autopar.Plan.load(path)
    # format 1 numbered a pipeline layer's values with its inputs in id order: its layer
    # solutions would name other values now, so such a plan is refused, not misread
    path.write_text(json.dumps({"format_version": 1, "layer_solutions": [{}]}))
    with pytest.raises(autopar.PlanError, match="format_version 1 is not supported.*again"):
        autopar.Plan.load(path)


def test_indivisible_dims_are_simply_not_split():
    # Batch 12 and width 6 do not divide by 8 (or 4): those dims must stay whole.
    w, x = jnp.ones((6, 6)), jnp.arange(72.0).reshape(12, 6) / 72
    step = autopar.parallelize(_sgd_step, method=autopar.ShardParallel(mesh_shape=(8,)),
                               cluster=cheap_comm_cluster())
    got, loss = step(w, x)
    want, want_loss = jax.jit(_sgd_step)(w, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    plan = step.get_plan(w, x)
    for spec, shape in zip(plan.in_specs, [(6, 6), (12, 6)]):
        for n, axes in zip(shape, spec):
            assert not axes or n % 8 == 0


def test_impossible_memory_budget_names_budget_and_need():
    case = mlp_case(batch=16, hidden=64)
    state, batch = case.init()
    step = autopar.parallelize(case.step, method=autopar.ShardParallel(
        mesh_shape=(8,), memory_budget_bytes=1024))
    with pytest.raises(autopar.MemoryBudgetError, match=r"no plan fits 1.00 KiB per device.*"
                                                        r"smallest found needs"):
        step.get_plan(state, batch)


def test_bad_options_are_rejected_with_valid_values():
    with pytest.raises(ValueError, match="valid solvers"):
        autopar.ShardParallel(solver="gurobi")
    with pytest.raises(ValueError, match="mesh_shape"):
        autopar.ShardParallel(mesh_shape=(2, 2, 2))
    w, x = _args()
    with pytest.raises(ValueError, match="needs 6 devices"):
        autopar.parallelize(_sgd_step, method=autopar.ShardParallel(mesh_shape=(2, 3)))(w, x)


def test_unknown_primitive_is_replicated_with_a_fallback_warning(monkeypatch):
    # A primitive the rule table does not know: results stay right, a FallbackWarning
    # names it (tests/test_fallbacks.py: where it is recorded).
    from autopar.passes import strategies

    monkeypatch.delitem(strategies.strategy_rules, "tanh")
    w, x = _args()
    with pytest.warns(autopar.FallbackWarning, match="'tanh'"):
        got, _ = autopar.parallelize(_sgd_step, cluster=cheap_comm_cluster())(w, x)
    np.testing.assert_allclose(got, jax.jit(_sgd_step)(w, x)[0], rtol=1e-5, atol=1e-6)


def test_the_second_call_reuses_the_first_calls_program(caplog):
    """The arrays of the non-batch arguments (the state) are laid out on the mesh on the
    first call, as they arrive on later calls (this step's outputs, committed): the second
    call runs the program the first compiled.  With the state taken uncommitted on the first
    call, the second retraced and compiled the whole step again (a committed array's type
    names its mesh).  A host value (numpy) passed anew each call stays as it is."""
    step = autopar.parallelize(_sgd_step, method=autopar.DataParallel())
    w, x = _args()
    fresh = [jax.random.normal(jax.random.key(k), x.shape) for k in range(2)]
    w, _ = step(w, x, np.float32(0.1))
    assert w.committed
    with jax.log_compiles(), caplog.at_level(logging.DEBUG):
        for batch in fresh:
            w, _ = step(w, batch, np.float32(0.1))
    compiled = [r.getMessage() for r in caplog.records
                if "Finished XLA compilation" in r.getMessage()]
    assert compiled == []
