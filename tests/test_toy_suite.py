"""The toy suite's comparison (benchmarks/toy.py, issue 41 item 4) catches a plan that drops
an update: two steps of the tests' GPT (`GPT_TINY`, the suite's optimizer and learning rate)
under `DataParallel` on 8 CPU devices pass `toy.compare`; the same plan wrapped to return its
input parameters, or to drop the update of one leaf, fails it; so does a reference that moves
a leaf too little for a dropped update to be seen."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.models import GPT_TINY, make_train_step
from benchmarks import toy

BATCH = 8


@pytest.fixture(scope="module")
def runs():
    """(step, initial state, batches, reference (state, losses), DataParallel plan)."""
    step, model, tx = make_train_step(GPT_TINY, None, toy.optimizer())
    params = model.init(jax.random.key(0), jnp.zeros((1, GPT_TINY.seq), jnp.int32))["params"]
    state = jax.device_get({"params": params, "opt_state": tx.init(params)})
    batches = []
    for s in range(1, toy.STEPS + 1):
        tokens = jax.random.randint(jax.random.key(s), (BATCH, GPT_TINY.seq), 0, GPT_TINY.vocab)
        batches.append({"tokens": tokens, "labels": jnp.roll(tokens, -1, axis=1)})
    ref = jax.device_get(toy.run_steps(jax.jit(step), state, batches))
    par = autopar.parallelize(step, method=autopar.DataParallel())
    return step, state, batches, ref, par


def _run(step, state, batches):
    new, losses = toy.run_steps(step, jax.tree.map(jnp.array, state), batches)
    return jax.device_get(new), losses


def _dropping(par, leaf: str | None = None):
    """`par` whose new state keeps the input parameters: all of them, or only `leaf` (its
    path under "params", as `toy.movement` names it)."""

    def step(state, batch):
        before = jax.device_get(state["params"])  # before the call: `par` donates its input
        new, metrics = par(state, batch)
        if leaf is None:
            kept = before
        else:
            kept = jax.tree_util.tree_map_with_path(
                lambda path, b, n: b if toy.leaf_name(path) == leaf else n, before, new["params"])
        return {**new, "params": kept}, metrics

    return step


def test_the_plan_matches_and_every_leaf_moves_100x_its_tolerance(runs):
    _, state, batches, (ref, ref_losses), par = runs
    got = toy.compare(state, ref, ref_losses, *_run(par, state, batches))
    assert got["equal"], got["reason"]
    assert got["err_over_tol"] <= 1 and got["min_move_over_tol"] >= toy.MIN_MOVE_OVER_TOL
    # The only leaves without a gradient are the attention key biases (softmax is invariant
    # to them): exempt from the movement check, named.
    assert got["exempt"] and all(n.endswith("key/bias") for n in got["exempt"])


def test_a_plan_that_returns_its_input_parameters_fails(runs):
    _, state, batches, (ref, ref_losses), par = runs
    got = toy.compare(state, ref, ref_losses, *_run(_dropping(par), state, batches))
    assert not got["equal"]
    assert "differs by" in got["reason"] and got["err_over_tol"] > toy.MIN_MOVE_OVER_TOL / 2


def test_a_plan_that_drops_one_leafs_update_fails(runs):
    """The leaf the reference moves least (relative to its tolerance): the hardest to see."""
    _, state, batches, (ref, ref_losses), par = runs
    leaf = toy.movement(state["params"], ref["params"])["min_move_leaf"]
    got = toy.compare(state, ref, ref_losses, *_run(_dropping(par, leaf), state, batches))
    assert not got["equal"] and got["worst_leaf"] == "params/" + leaf, got["reason"]
    assert got["err_over_tol"] >= toy.MIN_MOVE_OVER_TOL * 0.9


def test_a_reference_that_barely_moves_fails_the_movement_check():
    """A learning rate too small for a dropped update to show (the leaf moves ~10 x its
    tolerance) is reported, even though the plan's state equals the reference's."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 8)).astype(np.float32)
    init = {"params": {"w": w, "b": np.ones(8, np.float32)}}
    ref = {"params": {"w": w - 1e-5 * np.sign(w), "b": init["params"]["b"] - 1e-2}}
    got = toy.compare(init, ref, [1.0, 0.9], ref, [1.0, 0.9])
    assert got["err_over_tol"] == 0 and not got["equal"]
    assert got["min_move_leaf"] == "w" and got["min_move_over_tol"] < 10
    assert "moves parameter leaf w by only" in got["reason"]
