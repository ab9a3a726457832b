"""The zoo train steps' optimizers by name (`autopar.models.optimizers`, issue 41): Alpa's
benchmark trains MoE with Adafactor and Wide-ResNet with SGD + Nesterov momentum, and the
suites must price those workloads.  Each optimizer's state is what the suites assume, a
bad name is a clear error, and parallel steps with each equal the jax.jit step."""

import math

import jax
import numpy as np
import pytest

import autopar
from autopar import cli
from autopar import models as zoo

from helpers import cheap_comm_cluster


def _state_per_param_byte(name: str, overrides: dict) -> float:
    _, (state, _) = zoo.train_step_and_args(name, 8, overrides=overrides)
    nbytes = lambda tree: sum(math.prod(x.shape) * x.dtype.itemsize
                              for x in jax.tree.leaves(tree))
    return nbytes(state["opt_state"]) / nbytes(state["params"])


def test_each_optimizer_holds_the_state_the_suites_price():
    # AdamW: two moments; SGD + Nesterov: one momentum buffer; Adafactor: a row and a column
    # vector per matrix with two dims >= 128 (the 128-wide GPT's MLP and embedding), the
    # whole second moment otherwise (attention kernels [128, 4, 32], biases, norms).
    assert _state_per_param_byte("gpt-toy", {}) == pytest.approx(2.0, abs=1e-3)
    assert _state_per_param_byte("wrn-toy", {"optimizer": "sgd-nesterov"}) == \
        pytest.approx(1.0, abs=1e-3)
    wide = {"hidden": 128, "vocab": 256, "optimizer": "adafactor"}
    factored = _state_per_param_byte("gpt-toy", wide)
    assert factored < 0.5
    # float16 parameters keep a float32 master copy (2 bytes per parameter byte) beside the
    # optimizer's float32 state (twice as many bytes per float16 parameter byte).
    assert _state_per_param_byte("gpt-toy", {**wide, "param_dtype": "float16"}) == \
        pytest.approx(2.0 + 2 * factored, rel=1e-6)


def test_unknown_optimizer_names_the_known_ones():
    with pytest.raises(ValueError, match="optimizer='adam' is not one of adamw, adafactor, "
                                         "sgd-nesterov"):
        zoo.config("moe-toy", {"optimizer": "adam"})
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        zoo.optimizer("lion")


def test_the_command_line_sets_the_optimizer():
    model = cli.load_model("wrn-toy", 8, ["optimizer=sgd-nesterov"])
    assert "optimizer=sgd-nesterov" in model.name
    opt_state = model.args[0]["opt_state"]
    # optax.sgd with momentum: one trace (momentum buffer) per parameter.
    assert len(jax.tree.leaves(opt_state)) == len(jax.tree.leaves(model.args[0]["params"]))


@pytest.mark.parametrize("name,overrides,method,rtol,atol", [
    ("gpt-toy", {"hidden": 128, "vocab": 256, "optimizer": "adafactor"},
     autopar.ShardParallel(time_limit_s=20.0), 1e-4, 5e-5),
    ("wrn-toy", {"optimizer": "sgd-nesterov"}, autopar.Zero2Parallel(min_split_elements=0),
     2e-3, 5e-4),
])
def test_parallel_steps_with_each_optimizer_equal_jit(name, overrides, method, rtol, atol):
    """Two steps under autopar (a searched plan on a cluster whose communication is nearly
    free, so values are split; ZeRO-2 for the optimizer state of SGD) against two jax.jit
    steps.  Tolerances: losses rtol 1e-5; state leaves:
    * Adafactor rtol 1e-4 (reduction order differs by ~1e-7 relative), atol 5e-5: its
      update is normalized by the gradient's RMS, so a zero-initialized leaf (biases,
      LayerNorm offsets) whose gradient is at rounding level still moves by up to
      lr x 1e-3 (its parameter-scale floor) = 1e-5 per step, in a direction set by rounding;
    * SGD rtol 2e-3, atol 5e-4: lr 0.1 with BatchNorm, whose gradients cancel heavily
      (toy.py's docstring), turns 1e-7 relative rounding into visible differences in two
      steps: on jax 0.10.2 DataParallel's state is 3.4e-4 (max abs) from the single-device
      step's, and ZeRO-2's the same 3.4e-4 (the batch's reduction order, not the state
      split; ShardParallel's searched plan 1.6e-5); the state moves by ~1e-1."""
    state = zoo.init_state(name, overrides=overrides)
    batch = zoo.example_batch(name, 16, overrides=overrides)
    step, _ = zoo.train_step_and_args(name, 16, overrides=overrides)
    want_state, want = state, []
    for _ in range(2):
        want_state, metrics = jax.jit(step)(want_state, batch)
        want.append(float(metrics["loss"]))
    par = autopar.parallelize(step, method=method, cluster=cheap_comm_cluster(),
                              donate_argnums=())
    got_state, got = state, []
    for _ in range(2):
        got_state, metrics = par(got_state, batch)
        got.append(float(metrics["loss"]))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    moved = 0.0
    for a, b, a0 in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state),
                        jax.tree.leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)
        moved = max(moved, float(np.max(np.abs(np.asarray(b) - np.asarray(a0)))))
    assert moved > 1e-3  # the steps did move the state: the comparison can fail
