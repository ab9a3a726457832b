"""Every primitive the standard train steps emit has a sharding rule, and the rules for the
ones that lacked it (`split`, grouped convolutions, scatters) run correctly when emitted.

(a) The zoo's toy models with each of their optimizers, and a Flax model built from the
    standard layers (Dense, Conv and depthwise Conv, MultiHeadDotProductAttention, LayerNorm,
    BatchNorm, Embed, Dropout, a fused qkv cut by `jnp.split`, `x.at[i].set`) under AdamW,
    Adafactor and SGD-Nesterov, traced as `autopar.parallelize` traces a step and flattened
    as its graph is (calls, custom_jvp/vjp and remat inlined; control flow stays one
    equation with its own rule, its body runs whole): no equation lacks a rule.
(b) Every strategy of the new rules, compiled alone on a 4-device mesh, equals the
    unsharded result and runs the collectives it is priced with (none where it is priced
    with none); ShardParallel steps of a depthwise-conv model and of a fused-qkv model on
    meshes (4,) and (2, 2) equal jax.jit's (SGD-momentum, three steps, rtol 2e-4 /
    atol 2e-5 as tests/test_equivalence.py) and use the new strategies.
(c) The fused-qkv model at a data-parallel batch: the split stays batch-split and the
    compiled step gathers no activation.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding

import autopar
from autopar import inline, markers
from autopar import models as zoo
from autopar.constraints import to_pspec
from autopar.cost_model import ClusterSpec, hlo_audit
from autopar.graph import Graph
from autopar.passes import primitives
from autopar.passes import strategies as st
from autopar.passes.sharding_spec import MeshContext, enumerate_specs

from helpers import assert_same_run, cheap_comm_cluster
from models import Case, _simple_case

CLUSTER = ClusterSpec.preset("8xA100-80GB")
MESHES = [(4,), (2, 2)]
SGD_TOL = dict(rtol=2e-4, atol=2e-5)


# ---- (a) coverage ---------------------------------------------------------------------------


def _uncovered(step, *args) -> set[str]:
    """Primitives of the flattened step (as `autopar.api` traces it) with no strategy rule
    that are not sources either."""
    with markers.recording():
        closed = jax.make_jaxpr(step)(*args)
    graph = Graph.from_jaxpr(inline.run(closed))
    return {e.name for e in graph.eqns
            if e.name not in st.strategy_rules and not primitives.info(e.name).source}


@pytest.mark.parametrize("optimizer", sorted(zoo.OPTIMIZERS))
@pytest.mark.parametrize("name", ["gpt-toy", "moe-toy", "wrn-toy"])
def test_zoo_train_steps_have_a_rule_for_every_primitive(name, optimizer):
    step, args = zoo.train_step_and_args(name, 8, overrides={"optimizer": optimizer})
    missing = _uncovered(step, *args)
    assert not missing, f"{name} with {optimizer}: no rule for {sorted(missing)}"


class StandardLayers(nn.Module):
    """Flax's standard layers, each at least once."""

    @nn.compact
    def __call__(self, tokens, images, train: bool = True):
        h = nn.LayerNorm()(nn.Embed(64, 16)(tokens))
        q, k, v = jnp.split(nn.Dense(48)(h), 3, axis=-1)
        h = h + jax.nn.softmax(q @ k.transpose(0, 2, 1) / 4.0, axis=-1) @ v
        h = h + nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1,
                                                deterministic=not train)(h, h)
        h = nn.Dropout(0.1, deterministic=not train)(nn.gelu(nn.Dense(32)(h)))
        h = h.at[:, 0].set(0.0)
        c = nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3))(images))
        c = nn.relu(nn.Conv(8, (3, 3), feature_group_count=8)(c))
        c = nn.max_pool(nn.avg_pool(c, (2, 2), (2, 2)), (2, 2))
        return h.mean() + c.mean()


@pytest.mark.parametrize("tx", [optax.adamw(1e-3), optax.adafactor(1e-2),
                                optax.sgd(0.1, momentum=0.9, nesterov=True)],
                         ids=["adamw", "adafactor", "sgd-nesterov"])
def test_flax_standard_layers_have_a_rule_for_every_primitive(tx):
    model = StandardLayers()
    tokens = jnp.zeros((8, 6), jnp.int32)
    images = jnp.zeros((8, 8, 8, 4))
    variables = jax.eval_shape(
        lambda: model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                           tokens, images))

    def step(params, batch_stats, opt_state, tokens, images, key):
        def loss(p):
            return model.apply({"params": p, "batch_stats": batch_stats}, tokens, images,
                               mutable=["batch_stats"], rngs={"dropout": key})

        (value, mutated), grads = autopar.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), mutated, opt_state, value

    opt_state = jax.eval_shape(tx.init, variables["params"])
    missing = _uncovered(step, variables["params"], variables["batch_stats"], opt_state,
                         tokens, images, jax.random.key(2))
    assert not missing, f"no rule for {sorted(missing)}"


# ---- (b) each new strategy, compiled alone --------------------------------------------------


def _last_equation(fun, *args) -> tuple[st.EqnInfo, list, Callable]:
    """The last equation of `fun`'s flattened program on `args`: its facts, its operands'
    values, and a function running it alone (returning a tuple)."""
    graph = Graph.from_jaxpr(jax.make_jaxpr(fun)(*args))
    *before, eqn = graph.eqns
    env = graph.run_eqns(range(len(before)), dict(zip(graph.invars, args)))
    assert all(isinstance(op, int) for op in eqn.inputs)
    ins = [graph.values[o] for o in eqn.inputs]
    outs = [graph.values[o] for o in eqn.outputs]
    info = st.EqnInfo(eqn, tuple(v.shape for v in ins), tuple(v.shape for v in outs),
                      tuple(float(v.nbytes) for v in ins), tuple(float(v.nbytes) for v in outs),
                      (False,) * len(ins), (False,) * len(ins), None,
                      eqn_out_dtype=outs[0].dtype)

    def run(*operands):
        out = eqn.primitive.bind(*operands, **eqn.params)
        return tuple(out) if eqn.primitive.multiple_results else (out,)

    return info, [graph.read(op, env) for op in eqn.inputs], run


def _compiled_kinds(fun, args, in_specs, out_specs, mesh_shape) -> tuple[list, set[str]]:
    """`fun` jitted with operands laid out as `in_specs` and results as `out_specs` on the
    first devices: (its results, the kinds of the collectives XLA put in it)."""
    axes = ("x", "y")[:len(mesh_shape)]
    devices = np.array(jax.devices()[:int(np.prod(mesh_shape))]).reshape(mesh_shape)
    mesh = Mesh(devices, axes)
    sharding = lambda spec: NamedSharding(mesh, to_pspec(spec))
    jitted = jax.jit(fun, in_shardings=tuple(sharding(s) for s in in_specs),
                     out_shardings=tuple(sharding(s) for s in out_specs))
    placed = [jax.device_put(a, sharding(s)) for a, s in zip(args, in_specs)]
    compiled = jitted.lower(*placed).compile()
    found = hlo_audit.audit(compiled, mesh_shape, axes).collectives
    return jitted(*placed), {c.kind for c in found}


DN = ("NHWC", "HWIO", "NHWC")


def _conv(groups: int):
    return lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                     dimension_numbers=DN,
                                                     feature_group_count=groups)


def _conv_input_grad(groups: int, w_shape):
    def grad(w, ct):
        x = jnp.zeros((8, 6, 6, w_shape[2] * groups))
        return jax.vjp(lambda x: _conv(groups)(x, w), x)[1](ct)[0]
    return grad


def _conv_weight_grad(groups: int, w_shape):
    def grad(x, ct):
        return jax.vjp(lambda w: _conv(groups)(x, w), jnp.zeros(w_shape))[1](ct)[0]
    return grad


def _normal(key: int, shape) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape)


# (name, function whose last equation is the grouped convolution, its arguments' shapes)
GROUPED_CONVS = [
    ("depthwise", _conv(8), [(8, 6, 6, 8), (3, 3, 1, 8)]),
    ("depthwise-x2", _conv(8), [(8, 6, 6, 8), (3, 3, 1, 16)]),
    ("depthwise-input-grad", _conv_input_grad(8, (3, 3, 1, 8)), [(3, 3, 1, 8), (8, 6, 6, 8)]),
    ("depthwise-weight-grad", _conv_weight_grad(8, (3, 3, 1, 8)), [(8, 6, 6, 8)] * 2),
    ("grouped-weight-grad", _conv_weight_grad(4, (3, 3, 2, 16)),
     [(8, 6, 6, 8), (8, 6, 6, 16)]),
    ("grouped-2-weight-grad", _conv_weight_grad(2, (3, 3, 4, 8)), [(8, 6, 6, 8)] * 2),
    ("grouped", _conv(4), [(8, 6, 6, 8), (3, 3, 2, 16)]),
]


def _check_exact_and_priced(run, operands, in_specs, out_specs, mesh_shape, comm_s: float,
                            partial: bool, name: str) -> set[str]:
    """`run` compiled with its operands and results laid out as a strategy or follow rule
    says equals `run` unsharded, and runs no collective where none is priced (partial
    sums: reductions only).  Returns the collectives' kinds."""
    got, kinds = _compiled_kinds(run, operands, in_specs, out_specs, mesh_shape)
    for g, w in zip(got, run(*operands)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
    if partial:
        assert kinds <= {"all-reduce", "reduce-scatter"}, (name, kinds)
    else:
        assert (comm_s > 0) == bool(kinds), (name, comm_s, kinds)
    return kinds


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name, fun, shapes", GROUPED_CONVS,
                         ids=[c[0] for c in GROUPED_CONVS])
def test_grouped_conv_strategies_are_exact_and_priced(name, fun, shapes, mesh_shape):
    """Each strategy of a grouped convolution, compiled alone."""
    args = [_normal(i, shape) for i, shape in enumerate(shapes)]
    info, operands, run = _last_equation(fun, *args)
    p = info.params
    assert p["feature_group_count"] > 1 or p["batch_group_count"] > 1
    strategies = st.enumerate_conv(info, MeshContext.build(mesh_shape, CLUSTER))
    split = [s.name for s in strategies if any(any(spec) for spec in s.in_specs)]
    # XLA's partitioner gathers the lhs of a grouped (not depthwise) convolution.
    assert bool(split) == (name != "grouped"), split
    for s in strategies:
        _check_exact_and_priced(run, operands, s.in_specs, s.out_specs, mesh_shape,
                                s.comm_s, bool(s.partial_axes), s.name)


_ROWS = np.array([1, 5])
# (name, function whose last equation is the scatter, its arguments' shapes)
SCATTERS = [
    ("set-column", lambda h: h.at[:, 0].set(0.0), [(8, 6, 16)]),
    ("set-rows", lambda h, u: h.at[_ROWS].set(u), [(8, 8), (2, 8)]),
    ("max-rows", lambda h, u: h.at[_ROWS].max(u), [(8, 8), (2, 8)]),
    ("subtract-rows", lambda h, u: h.at[_ROWS].subtract(u), [(8, 8), (2, 8)]),
]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name, fun, shapes", SCATTERS, ids=[c[0] for c in SCATTERS])
def test_scatter_strategies_are_exact_and_priced(name, fun, shapes, mesh_shape):
    """Each strategy of an overwriting / max / subtracting scatter, compiled alone: no
    partial sums."""
    args = [_normal(i, shape) for i, shape in enumerate(shapes)]
    info, operands, run = _last_equation(fun, *args)
    strategies = st.enumerate_scatter(info, MeshContext.build(mesh_shape, CLUSTER))
    assert any(any(s.out_specs[0]) for s in strategies)
    for s in strategies:
        assert not s.partial_axes, s.name
        _check_exact_and_priced(run, operands, s.in_specs, s.out_specs, mesh_shape,
                                s.comm_s, False, s.name)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("sizes", [(8, 8, 8), (4, 12, 8), (2, 14, 8), (5, 19)], ids=str)
def test_split_follow_rule_is_exact_for_every_operand_layout(sizes, mesh_shape):
    """Every layout of the operand: the pieces' layouts the rule gives are exact, and
    collectives run only where the rule prices them (pieces that stay split along the cut
    axis move by collective-permutes, not gathers)."""
    x = _normal(0, (8, sum(sizes)))
    info, operands, run = _last_equation(lambda x: tuple(jax.lax.split(x, sizes, axis=1)), x)
    mesh = MeshContext.build(mesh_shape, CLUSTER)
    for spec in enumerate_specs(x.shape, mesh):
        res = st.follow_split(info, 0, spec, mesh)
        kinds = _check_exact_and_priced(run, operands, (spec,), res.out_specs, mesh_shape,
                                        res.comm_s, False, str(spec))
        if spec[1] and res.out_specs[0] == spec:
            assert kinds <= {"collective-permute", "all-to-all"}, (spec, kinds)


# ---- (b) ShardParallel steps ---------------------------------------------------------------


class DepthwiseNet(nn.Module):
    """Conv, depthwise conv, depthwise conv with channel multiplier 2, classifier."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(16, (3, 3), feature_group_count=16)(x))
        x = nn.relu(nn.Conv(32, (3, 3), feature_group_count=16)(x))
        return nn.Dense(8)(x.mean(axis=(1, 2)))


class FusedQKV(nn.Module):
    """Embedding, one attention block whose q, k, v come from one fused projection cut by
    jnp.split, classifier over the mean token."""

    hidden: int = 32
    heads: int = 4

    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(64, self.hidden)(tokens)
        q, k, v = jnp.split(nn.Dense(3 * self.hidden)(h), 3, axis=-1)
        heads = lambda t: t.reshape(*t.shape[:2], self.heads, -1)
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / 3.0)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", att, heads(v)).reshape(h.shape)
        h = nn.LayerNorm()(h + nn.Dense(self.hidden)(mixed))
        return nn.Dense(8)(h.mean(axis=1))


def _case(name: str, model: nn.Module, make_x) -> Case:
    """A classification case: batch i is (make_x(rng), labels), SGD-momentum."""

    def batch_for_step(i: int) -> dict:
        r = np.random.default_rng([7, i])
        x = make_x(r)
        return {"x": jnp.asarray(x), "y": jnp.asarray(r.integers(0, 8, x.shape[0]), jnp.int32)}

    return _simple_case(name, model, batch_for_step, "sgd")


def depthwise_case(batch: int = 16) -> Case:
    return _case("depthwise", DepthwiseNet(),
                 lambda r: r.standard_normal((batch, 8, 8, 3)).astype(np.float32))


def qkv_case(batch: int = 16, seq: int = 8) -> Case:
    return _case("qkv", FusedQKV(), lambda r: r.integers(0, 64, (batch, seq)).astype(np.int32))


def _parallel(case: Case, mesh_shape, cluster) -> autopar.ParallelizedFunction:
    return autopar.parallelize(case.step, method=autopar.ShardParallel(mesh_shape=mesh_shape),
                               devices=jax.devices()[:4], cluster=cluster)


def _operand_specs(traced, eqn) -> list:
    """The layouts the plan reads `eqn`'s array operands in."""
    plan = traced.plan
    values = dict(plan.value_specs)
    pinned = {(e, k): spec for e, k, spec in plan.operand_specs}
    return [pinned.get((eqn.index, k), values.get(op)) for k, op in enumerate(eqn.inputs)
            if isinstance(op, int)]


def _is_split(specs) -> bool:
    return any(spec and any(spec) for spec in specs)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_shard_parallel_depthwise_conv_equals_jit(mesh_shape):
    case = depthwise_case()
    step = _parallel(case, mesh_shape, cheap_comm_cluster())
    assert_same_run(case, step, **SGD_TOL)
    traced = step.trace(*case.init())
    grouped = [e for e in traced.graph.eqns if e.name == "conv_general_dilated"
               and (e.params["feature_group_count"] > 1 or e.params["batch_group_count"] > 1)]
    kinds = {("feature" if e.params["feature_group_count"] > 1 else "batch")
             for e in grouped if _is_split(_operand_specs(traced, e))}
    assert kinds == {"feature", "batch"}, traced.plan.summary()


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_shard_parallel_fused_qkv_split_equals_jit(mesh_shape):
    case = qkv_case()
    step = _parallel(case, mesh_shape, cheap_comm_cluster())
    assert_same_run(case, step, **SGD_TOL)
    traced = step.trace(*case.init())
    (split,) = [e for e in traced.graph.eqns if e.name == "split"]
    values = dict(traced.plan.value_specs)
    assert _is_split([values[o] for o in split.outputs]), traced.plan.summary()


# ---- (c) no gathered activation --------------------------------------------------------------


def test_data_parallel_fused_qkv_gathers_no_activation():
    """Batch 256 of 8 tokens, hidden 32, on 4 devices of an A100 cluster: the plan keeps the
    batch split through the fused projection and its split.  Without a rule the split ran
    replicated, and the step all-gathered an activation to feed it."""
    batch, seq, hidden = 256, 8, 32
    case = qkv_case(batch=batch, seq=seq)
    step = _parallel(case, (4,), "8xA100-80GB")
    state, data = case.init()
    traced = step.trace(state, data)
    (split,) = [e for e in traced.graph.eqns if e.name == "split"]
    values = dict(traced.plan.value_specs)
    for spec in _operand_specs(traced, split) + [values[o] for o in split.outputs]:
        assert spec[0], traced.plan.summary()
    compiled = step.lower(state, data).compile()
    plan = traced.plan
    found = hlo_audit.audit(compiled, plan.mesh_shape, plan.mesh_axes, plan.device_ids)
    activation_share = batch * seq * hidden * 4 / 4     # one device's share of (B, S, H)
    gathered = [(c.kind, c.nbytes) for c in found.collectives
                if c.kind in ("all-gather", "all-to-all", "collective-permute")
                and c.nbytes >= activation_share]
    assert not gathered, gathered
