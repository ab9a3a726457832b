"""The test model zoo trains under plain jax.jit: finite, changing, deterministic losses."""

import math
import time

import jax
import numpy as np
import pytest

from autopar import models as zoo

import models  # tests/ is on sys.path (rootdir conftest, no __init__.py)

NUM_STEPS = 3


def _run(case, jitted, steps=NUM_STEPS):
    state, _ = case.init()
    treedef = jax.tree.structure(state)
    losses = []
    for i in range(steps):
        state, metrics = jitted(state, case.batch_for_step(i))
        assert jax.tree.structure(state) == treedef, f"{case.name}: state treedef changed"
        losses.append(float(metrics["loss"]))
    return losses, state


@pytest.mark.parametrize("optimizer", models.OPTIMIZERS)
@pytest.mark.parametrize("name", models.CASE_NAMES)
def test_case_trains_under_jit(name, optimizer):
    case = models.make_case(name, optimizer)
    assert case.name == name
    jitted = jax.jit(case.step)

    t0 = time.perf_counter()
    losses, state = _run(case, jitted)
    elapsed = time.perf_counter() - t0
    print(f"{name}/{optimizer}: compile+{NUM_STEPS} steps {elapsed:.2f}s losses {losses}")

    assert all(math.isfinite(x) for x in losses), losses
    assert len(set(losses)) > 1, f"loss did not change: {losses}"
    for leaf in jax.tree.leaves(case.batch_for_step(0)):
        assert leaf.shape[0] % 8 == 0, leaf.shape
    for leaf in jax.tree.leaves(state):
        assert isinstance(leaf, jax.Array), type(leaf)
        if np.issubdtype(leaf.dtype, np.floating):
            assert np.all(np.isfinite(np.asarray(leaf)))

    again, state2 = _run(case, jitted)
    assert again == losses, "step is not deterministic"
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_batches_are_deterministic_and_differ_per_step():
    case = models.make_case("gpt")
    b0, b0_again, b1 = case.batch_for_step(0), case.batch_for_step(0), case.batch_for_step(1)
    for k in b0:
        np.testing.assert_array_equal(b0[k], b0_again[k])
    assert any(not np.array_equal(b0[k], b1[k]) for k in b0)


def test_remat_dropout_key_advances():
    case = models.make_case("remat_dropout")
    state, batch = case.init()
    new_state, _ = jax.jit(case.step)(state, batch)
    assert not np.array_equal(np.asarray(state["rng"]), np.asarray(new_state["rng"]))


def test_mlp_case_sizes():
    case = models.mlp_case(batch=8, hidden=64, layers=3, optimizer="adamw")
    state, batch = case.init()
    assert batch["x"].shape == (8, 64)
    kernels = [p["kernel"].shape for p in state["params"].values()]
    assert kernels == [(64, 64)] * 3 + [(64, 8)]
    _, metrics = jax.jit(case.step)(state, batch)
    assert math.isfinite(float(metrics["loss"]))


def test_unknown_names_rejected():
    with pytest.raises(ValueError):
        models.make_case("nope")
    with pytest.raises(ValueError):
        models.make_optimizer("lion")


def test_zoo_names_order_and_default_batches():
    names = zoo.names()
    assert sorted(names) == sorted(zoo.CONFIGS)
    assert names[:3] == ["gpt-toy", "gpt-125m", "gpt-350m"] and names[-1] == "wrn-6.8b"
    assert names.index("moe-toy") == names.index("gpt-39b") + 1
    assert [zoo.default_batch(n) for n in ("gpt-1.3b", "moe-70b", "wrn-250m", "wrn-toy")] == \
        [1024, 1024, 1536, 64]
    with pytest.raises(ValueError, match="unknown model 'gpt-1t'; known: "):
        zoo.default_batch("gpt-1t")


def test_tiny_gpt_and_moe_are_the_zoos():
    """The test GPT is the zoo's GPT at GPT_TINY; the test MoE wraps the zoo's MoEFFN."""
    state, batch = jax.eval_shape(models.make_case("gpt").init)
    expected = jax.eval_shape(lambda: zoo.GPT(zoo.GPT_TINY).init(
        jax.random.key(0), batch["tokens"])["params"])
    assert jax.tree.structure(state["params"]) == jax.tree.structure(expected)
    untied = jax.eval_shape(models.gpt_case(tied=False).init)[0]["params"]
    assert untied["Dense_0"]["kernel"].shape == (32, 64)
    moe = jax.eval_shape(models.make_case("moe").init)[0]["params"]
    assert moe["MoEFFN_0"]["wi"].shape == (4, 32, 64) and "gate" in moe["MoEFFN_0"]


def test_low_precision_parameters_train_through_a_float32_master_copy():
    """`param_dtype=float16` (Alpa's GPT benchmark): parameters in float16, AdamW on a
    float32 master copy in the optimizer state, parameters = the master rounded.  The
    master moves exactly as a float32 AdamW step from the float32 parameters would; under
    autopar the step matches jax.jit's."""
    import optax

    import autopar

    over = {"param_dtype": "float16"}
    state = zoo.init_state("gpt-toy", overrides=over)
    batch = zoo.example_batch("gpt-toy", 16)
    step, _ = zoo.train_step_and_args("gpt-toy", 16, overrides=over)
    leaves = jax.tree.leaves(state["params"])
    assert leaves and all(x.dtype == np.float16 for x in leaves)
    master = state["opt_state"].master
    assert all(m.dtype == np.float32 for m in jax.tree.leaves(master))
    new, metrics = jax.jit(step)(state, batch)
    assert math.isfinite(float(metrics["loss"]))
    for p, m in zip(jax.tree.leaves(new["params"]), jax.tree.leaves(new["opt_state"].master),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(np.float16)))

    # The master's step is AdamW's on float32 parameters with the float32 gradients.
    model = zoo.GPT(zoo.config("gpt-toy", over))

    def loss_fn(params):
        logits = model.apply({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    grads = jax.grad(loss_fn)(state["params"])
    tx = optax.adamw(1e-4)
    f32 = jax.tree.map(lambda x: x.astype(np.float32), state["params"])
    g32 = jax.tree.map(lambda x: x.astype(np.float32), grads)
    upd, _ = tx.update(g32, tx.init(f32), f32)
    want = optax.apply_updates(f32, upd)
    # AdamW's first step moves an element by lr·g/(|g| + eps) (+ the decay, the same in
    # both): where |g| is within a few orders of eps, the rounding of the gradient (XLA fuses
    # the step's backward differently from `jax.grad` alone, and differently per CPU) moves
    # that by up to lr.  Elsewhere the two agree to float32 rounding.
    for a, b, g in zip(jax.tree.leaves(new["opt_state"].master), jax.tree.leaves(want),
                       jax.tree.leaves(g32), strict=True):
        a, b, g = np.asarray(a), np.asarray(b), np.asarray(g)
        steady = np.abs(g) > 1e-6
        np.testing.assert_allclose(a[steady], b[steady], rtol=1e-6, atol=1e-6)
        assert np.all(np.abs(a - b) <= 2 * 1e-4 + 1e-6), np.max(np.abs(a - b))

    par = autopar.parallelize(step, method=autopar.DataParallel(), donate_argnums=())
    got, got_metrics = par(state, batch)
    np.testing.assert_allclose(float(got_metrics["loss"]), float(metrics["loss"]), rtol=1e-3)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(new), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-3, atol=2e-3)


def test_config_overrides_are_checked():
    assert zoo.config("gpt-2.6b", {"tied": False, "param_dtype": "float16"}).tied is False
    assert zoo.param_count("gpt-toy", {"tied": False}) > zoo.param_count("gpt-toy")
    with pytest.raises(ValueError, match="no config field 'widht'; its fields: hidden"):
        zoo.config("gpt-toy", {"widht": 3})
    with pytest.raises(ValueError, match="field 'tied' takes a bool"):
        zoo.config("gpt-toy", {"tied": "no"})
    with pytest.raises(ValueError, match="param_dtype='float17' is not a dtype"):
        zoo.config("gpt-toy", {"param_dtype": "float17"})
