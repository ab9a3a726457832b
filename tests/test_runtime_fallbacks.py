"""The pipeline runtime's fallbacks are reported (`autopar.FallbackWarning`, an error in
this suite, and `Traced.fallbacks`), only where the program is not the plan that was
priced, and the program stays correct:

* an update value with no planned layout, replicated between the update programs, when it
  is as large as the split block it is computed from (a flattened momentum, a call that
  reads another stage's parameters) — not an optimizer's scalars or factored moments;
* an order `autopar.ordering.after` drops because a layout does not split evenly.

Run time 15-30 s on two loaded cores (four pipelines of a 2-layer 128-wide MLP)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import autopar
from autopar import ordering, outer
from autopar.passes import fallbacks, primitives

from helpers import cheap_comm_cluster

WIDTH = 128
PIPELINE = dict(num_micro_batches=2, num_stages=2, time_limit_s=10.0)


def _params() -> dict:
    r = np.random.default_rng(0)
    return {f"l{i}": {"w": jnp.asarray(r.standard_normal((WIDTH, WIDTH)) * 0.1, jnp.float32),
                      "b": jnp.zeros((WIDTH,), jnp.float32)} for i in range(2)}


def _batch(i: int) -> dict:
    r = np.random.default_rng(i + 1)
    return {"x": jnp.asarray(r.standard_normal((16, WIDTH)), jnp.float32),
            "y": jnp.asarray(r.standard_normal((16, WIDTH)), jnp.float32)}


def _loss(params: dict, batch: dict) -> jax.Array:
    h = batch["x"]
    for i in range(len(params)):
        h = jnp.tanh(h @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"])
    return jnp.mean((h - batch["y"]) ** 2)


def _flat_momentum_step(state: dict, batch: dict) -> tuple[dict, dict]:
    """SGD with momentum kept flat: the momentum is a reshape (not elementwise) of each
    gradient, as large as its parameter, and is new state (it leaves its update program)."""
    loss, grads = autopar.value_and_grad(_loss)(state["params"], batch)
    flat = jax.tree.map(lambda m, g: 0.9 * m + g.reshape(-1), state["flat"], grads)
    params = jax.tree.map(lambda p, m: p - 0.05 * m.reshape(p.shape), state["params"], flat)
    return {"params": params, "flat": flat}, {"loss": loss}


def _one_call_step(state: dict, batch: dict) -> tuple[dict, dict]:
    """SGD whose update is one `lax.cond` over every parameter (as optax's NovoGrad does
    on its first step): one equation reading both stages' parameters, run on one stage."""
    loss, grads = autopar.value_and_grad(_loss)(state["params"], batch)
    scaled = jax.lax.cond(state["first"], lambda g: jax.tree.map(lambda x: 2.0 * x, g),
                          lambda g: g, grads)
    params = jax.tree.map(lambda p, g: p - 0.05 * g, state["params"], scaled)
    return {"params": params, "first": jnp.zeros((), bool)}, {"loss": loss}


def _run(step, state: dict, steps: int = 2) -> tuple[dict, list[float]]:
    losses = []
    for i in range(steps):
        state, metrics = step(state, _batch(i))
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.parametrize("make_step,state_of,reason", [
    (_flat_momentum_step,
     lambda p: {"params": p, "flat": jax.tree.map(lambda x: jnp.zeros((x.size,)), p)},
     "not elementwise"),
    (_one_call_step, lambda p: {"params": p, "first": jnp.ones((), bool)},
     "laid out on stage 1"),
], ids=["flattened-momentum", "one-call-over-both-stages"])
def test_a_replicated_parameter_sized_update_value_is_reported(make_step, state_of, reason):
    step = autopar.parallelize(make_step, method=autopar.PipeshardParallel(**PIPELINE),
                               cluster=cheap_comm_cluster(), donate_argnums=())
    state = state_of(_params())
    with pytest.warns(autopar.FallbackWarning, match="apply-grad"):
        traced = step.trace(state, _batch(0))
        assert traced.executable is not None   # built: the runtime reports here
    found = [f for f in traced.fallbacks if f.stage == "apply-grad"]
    assert found and all(reason in f.what for f in found), [str(f) for f in traced.fallbacks]
    assert any("test_runtime_fallbacks.py" in f.where for f in found), found
    # The largest value named has its shape and bytes: a [128, 128] float32 parameter's.
    assert any("float32[16384]" in f.what or "float32[128,128]" in f.what for f in found)
    assert any(f"{WIDTH * WIDTH * 4:,} B" in f.what for f in found), found
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.FallbackWarning)
        got, got_losses = _run(step, state)
    want, want_losses = _run(jax.jit(make_step), state_of(_params()))
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("tx", [
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3, eps=1e-4)),
    optax.adafactor(1e-2),
], ids=["clip-adam", "adafactor"])
def test_ordinary_optimizers_report_nothing(tx):
    """Scalars (a step count, a global norm) and Adafactor's factored moments (128 floats
    beside a 64 KiB matrix) are what the planner assumes; Adafactor's `jnp.where` on each
    parameter (a `jit` call) takes its parameter's layout and stage.  FallbackWarning is an
    error here, so a report while tracing, building or running fails the test."""
    def adam_step(state, batch):
        loss, grads = autopar.value_and_grad(_loss)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return ({"params": optax.apply_updates(state["params"], updates),
                 "opt_state": opt_state}, {"loss": loss})

    step = autopar.parallelize(adam_step, method=autopar.PipeshardParallel(**PIPELINE),
                               cluster=cheap_comm_cluster(), donate_argnums=())
    params = _params()
    state = {"params": params, "opt_state": tx.init(params)}
    traced = step.trace(state, _batch(0))
    assert traced.executable is not None
    assert traced.fallbacks == (), [str(f) for f in traced.fallbacks]
    got, got_losses = _run(step, state)
    want, want_losses = _run(jax.jit(adam_step), {"params": params, "opt_state": tx.init(params)})
    # Adafactor normalizes by the update's RMS: a zero-initialized bias whose gradient is at
    # rounding level moves by up to lr x 1e-3 in a direction set by rounding (as
    # tests/test_zoo_optimizers.py); Adam runs with eps 1e-4 (JAX-NOTES).
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=5e-5)


def test_a_where_call_takes_its_operands_layout():
    """`jnp.where` is a `jit` call of one `select_n`: its result joins its operands' layout
    class (so an update picked per parameter stays on the parameter's stage, split)."""
    def update(p, g):
        return jnp.where(jnp.sum(p) > 0, p - g, jnp.zeros_like(p))

    closed = jax.make_jaxpr(update)(jnp.ones((8, 4)), jnp.ones((8, 4)))
    jaxpr = closed.jaxpr
    assert any(primitives.info(e.primitive.name).connects_body for e in jaxpr.eqns)
    layout = (1, NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), PartitionSpec("x")))
    got = outer.state_layouts(jaxpr, range(len(jaxpr.eqns)), {jaxpr.invars[0]: layout}, [])
    assert got.get(jaxpr.outvars[0]) == layout
    # Two calls of one traced body name its inner values apart: the second call's result
    # does not take the first's layout.
    closed = jax.make_jaxpr(lambda a, b: (update(a, a), update(b, b)))(
        jnp.ones((8, 4)), jnp.ones((8, 4)))
    jaxpr = closed.jaxpr
    got = outer.state_layouts(jaxpr, range(len(jaxpr.eqns)), {jaxpr.invars[0]: layout}, [])
    assert got.get(jaxpr.outvars[0]) == layout and jaxpr.outvars[1] not in got


def test_an_order_dropped_for_an_uneven_layout_is_reported():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",), axis_types=(AxisType.Auto,))
    even, odd = jnp.arange(8.0).reshape(4, 2), jnp.arange(6.0).reshape(3, 2)
    split = (("x",), ())

    def tie(targets, sources):
        return jax.jit(lambda ts, ss: ordering.after(
            [(t, spec) for t, (_, spec) in zip(ts, targets)],
            [(s, spec) for s, (_, spec) in zip(ss, sources)], mesh))(
            [t for t, _ in targets], [s for s, _ in sources])

    # Ordinary steps' left-outs stay silent: a boolean target, unknown layouts.
    with fallbacks.collecting() as found:
        out = tie([(even, split), (even > 2, split), (odd, None)], [(even, split), (odd, None)])
    assert found == []
    with fallbacks.collecting() as found, pytest.warns(autopar.FallbackWarning,
                                                      match="does not split them evenly"):
        out = tie([(even, split), (odd, split)], [(even, split)])
    assert [f.stage for f in found] == ["ordering"] and "(3, 2)" in found[0].what
    np.testing.assert_array_equal(out[0], even)
    np.testing.assert_array_equal(out[1], odd)
    with fallbacks.collecting() as found, pytest.warns(autopar.FallbackWarning,
                                                      match="no value waits for"):
        tie([(even, split)], [(odd, split)])
    assert [f.stage for f in found] == ["ordering"]
