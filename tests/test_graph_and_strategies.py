"""Unit tests of the graph view, the spec algebra and the strategy rules (no devices)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.cost_model import ClusterSpec
from autopar.cost_model.compute import compute_time_s
from autopar.graph import Graph
from autopar.passes import strategies as st
from autopar.passes.fallbacks import FallbackWarning
from autopar.passes.intra_op import run as intra_op_run
from autopar.passes.sharding_spec import (
    MeshContext,
    enumerate_specs,
    is_slice,
    reorders,
    replicated,
    reshard_s,
    state_split,
)

CLUSTER = ClusterSpec.preset("8xA100-80GB")
MESH_2D = MeshContext.build((2, 4), CLUSTER)
MESH_1D = MeshContext.build((8,), CLUSTER)


def _graph(fun, *args) -> Graph:
    return Graph.from_jaxpr(jax.make_jaxpr(fun)(*args))


def test_graph_inlines_calls_and_keeps_values():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), x), lambda r, g: (g * jnp.cos(r),))

    def g(x):
        y = jax.checkpoint(lambda z: jnp.tanh(z) * 2)(x)
        return jax.jit(lambda v: f(v) + jax.nn.relu(v))(y).sum()

    x = jnp.linspace(-1, 1, 16)
    graph = _graph(jax.grad(g), x)
    names = {e.name for e in graph.eqns}
    assert not names & {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "remat2"}
    out = jax.jit(lambda x: graph.evaluate([x]))(x)[0]
    np.testing.assert_allclose(out, jax.grad(g)(x), rtol=1e-6)


def test_graph_keeps_control_flow_opaque_and_counts_flops():
    def body(c, w):
        return jnp.tanh(c @ w), None

    def f(c, ws):
        return jax.lax.scan(body, c, ws)[0]

    graph = _graph(f, jnp.ones((4, 8)), jnp.ones((3, 8, 8)))
    (scan,) = [e for e in graph.eqns if e.name == "scan"]
    assert scan.flops == pytest.approx(3 * (2 * 4 * 8 * 8 + 4 * 8))


def test_dot_flops_and_liveness():
    graph = _graph(lambda a, b: (a @ b).sum(), jnp.ones((4, 6)), jnp.ones((6, 5)))
    dot = graph.eqns[0]
    assert dot.name == "dot_general" and dot.flops == 2 * 4 * 6 * 5
    live = graph.liveness()
    a, b = graph.invars
    assert tuple(live[a]) == (0, 1) and tuple(live[b]) == (0, 1)
    out = graph.outvars[0]
    assert live[out][1] == graph.num_steps + 1


def test_enumerate_specs_only_even_splits():
    specs = list(enumerate_specs((8, 6), MESH_2D))
    assert specs[0] == replicated(2)
    assert (("x",), ()) in specs and ((), ("x",)) in specs
    assert ((), ("y",)) not in specs           # 6 is not divisible by 4
    assert (("x", "y"), ()) in specs
    assert len(specs) == len(set(specs))


@pytest.mark.parametrize("spec, shape, want", [
    # Replicated on (2, 4): each axis, in mesh order, joins the dim it leaves largest.
    (((), ()), (512, 1024), (("y",), ("x",))),
    (((), ()), (8, 6), (("x", "y"), ())),          # 6 is not divisible by 4
    # Tensor-parallel over y: x cuts the largest dim further, after y.
    (((), ("y",)), (64, 512), ((), ("y", "x"))),
    ((("x", "y"),), (16,), (("x", "y"),)),         # nothing left to split over
    (((),), (3,), ((),)),                          # no dim divides: stays whole
])
def test_state_split_cuts_over_the_unused_axes(spec, shape, want):
    got = state_split(spec, shape, MESH_2D)
    assert got == want
    assert is_slice(spec, got)                    # reached from the parameter by slicing


def test_reshard_costs():
    nbytes = 1 << 20
    s = (("x",), ())
    assert reshard_s(s, s, nbytes, MESH_2D) == 0
    assert reshard_s(replicated(2), s, nbytes, MESH_2D) == 0          # slicing is local
    gather = reshard_s(s, replicated(2), nbytes, MESH_2D)
    move = reshard_s((("x",),) + ((),), ((), ("x",)), nbytes, MESH_1D)
    assert gather > 0 and move > 0
    assert reshard_s((("x",), ()), ((), ()), nbytes, MESH_1D) > move  # a2a < all-gather


# (src, dst) on the 2x4 mesh: whether the devices' blocks move (XLA: a collective-permute).
REORDER_CASES = [
    ((("y",), ()), (("x", "y"), ()), True),    # x goes ahead of y: block 4x+y, not held
    ((("y",), ()), (("y", "x"), ()), False),   # x after y: a local slice
    ((("x",), ()), (("x", "y"), ()), False),
    ((("x", "y"), ()), (("y",), ()), True),    # the major axis leaves, the minor stays
    ((("x", "y"), ()), (("x",), ()), False),   # the minor axis leaves: an all-gather
    ((("x",), ("y",)), (("x",), ()), False),
]


@pytest.mark.parametrize("src,dst,moves", REORDER_CASES)
def test_reorders_matches_the_collective_permutes_xla_emits(src, dst, moves):
    from jax.sharding import AxisType, Mesh, NamedSharding

    from autopar.constraints import to_pspec
    from autopar.cost_model import hlo_audit

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"),
                axis_types=(AxisType.Auto,) * 2)
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32,
                             sharding=NamedSharding(mesh, to_pspec(src)))
    compiled = jax.jit(lambda a: jax.lax.with_sharding_constraint(
        a, NamedSharding(mesh, to_pspec(dst))) * 2).lower(x).compile()
    kinds = {c.kind for c in hlo_audit.audit(compiled, (2, 4), ("x", "y")).collectives}
    assert reorders(src, dst) == moves == ("collective-permute" in kinds), kinds
    assert is_slice(src, dst) == (not moves and not kinds)
    nbytes = 64 * 128 * 4
    # Priced: the permute of the finer shard on top of any gather.
    permute = CLUSTER.intra_host.alpha_s + nbytes / 8 * CLUSTER.intra_host.beta_s_per_byte
    cost = reshard_s(src, dst, nbytes, MESH_2D)
    if moves:
        assert cost >= permute
    elif not kinds:
        assert cost == 0


def _info(fun, *args, eqn_index=0) -> st.EqnInfo:
    graph = _graph(fun, *args)
    eqn = graph.eqns[eqn_index]
    vals = graph.values
    ins = [vals[o] for o in eqn.inputs if isinstance(o, int)]
    outs = [vals[o] for o in eqn.outputs]
    return st.EqnInfo(eqn, tuple(v.shape for v in ins), tuple(v.shape for v in outs),
                      tuple(float(v.nbytes) for v in ins), tuple(float(v.nbytes) for v in outs),
                      (False,) * len(ins), (False,) * len(ins), None,
                      eqn_out_dtype=outs[0].dtype)


def test_dot_strategies_cover_alpa_cases():
    info = _info(lambda a, b: a @ b, jnp.ones((64, 32)), jnp.ones((32, 16)))
    strategies = st.enumerate_dot(info, MESH_2D)
    by_specs = {(s.in_specs, s.out_specs[0]): s for s in strategies}
    # m on x, n on y: no communication.
    s = by_specs[(((("x",), ()), ((), ("y",))), (("x",), ("y",)))]
    assert s.comm_s == 0
    # k split over y: partial sums, all-reduce.
    s = by_specs[(((("x",), ("y",)), (("y",), ())), (("x",), ()))]
    assert s.comm_s > 0
    # ... or reduce-scatter onto a free output dim, cheaper than the all-reduce.
    rs = [t for t in strategies if "reducescatter" in t.name
          and t.in_specs == ((("x",), ("y",)), (("y",), ()))]
    assert rs and rs[0].comm_s < s.comm_s
    # Splitting divides the compute: each operand is read at its own layout (a is cut 2
    # ways, b 4 ways, the output 8 ways), so the split costs less than a replicated dot.
    rep = by_specs[((((), ()), ((), ())), ((), ()))]
    assert rep.compute_s > 2 * by_specs[(((("x",), ()), ((), ("y",))), (("x",), ("y",)))].compute_s


def test_dot_prices_each_operand_at_its_layout():
    """A data-parallel matmul reads its whole weight on every device; a tensor-parallel
    one reads 1/8 of it. Same FLOPs per device, so on a memory-bound dot (a few rows
    against a large weight) the data-parallel strategy is the dearer one."""
    info = _info(lambda a, b: a @ b, jnp.ones((64, 1024)), jnp.ones((1024, 1024)))
    by_specs = {(s.in_specs, s.out_specs[0]): s for s in st.enumerate_dot(info, MESH_1D)}
    dp = by_specs[(((("x",), ()), ((), ())), (("x",), ()))]          # rows split
    tp = by_specs[((((), ()), ((), ("x",))), ((), ("x",)))]          # weight columns split
    assert dp.comm_s == tp.comm_s == 0
    nbytes = 4 * (64 * 1024 / 8 + 1024 * 1024 + 64 * 1024 / 8)     # dp's bytes per device
    flops = 2 * 64 * 1024 * 1024 / 8
    assert dp.compute_s == pytest.approx(compute_time_s(flops, nbytes, jnp.float32,
                                                        MESH_1D.cluster))
    assert dp.compute_s > 2 * tp.compute_s


def test_follow_rules():
    x = jnp.ones((8, 4, 6))
    info = _info(lambda x: x.reshape(32, 6), x)
    res = st.follow_reshape(info, 0, (("x",), (), ()), MESH_1D)
    assert res.out_specs == ((("x",), ()),) and res.comm_s == 0
    res = st.follow_reshape(info, 0, ((), ("x",), ()), MESH_1D)   # minor dim of a merge
    assert res.out_specs == (((), ()),) and res.comm_s > 0
    info = _info(lambda x: x.sum(axis=1), x)
    res = st.follow_reduce(info, 0, ((), ("x",), ()), MESH_1D)
    assert res.out_specs == (((), ()),) and res.comm_s > 0
    info = _info(lambda x: jnp.transpose(x, (2, 0, 1)), x)
    res = st.follow_transpose(info, 0, (("x",), (), ()), MESH_1D)
    assert res.out_specs == (((), ("x",), ()),)


def test_elementwise_follows_through_size_one_broadcasts():
    """lax broadcasts size-1 dims itself (softmax's `x - max(x, keepdims)` is `sub` of
    (8, 6) and (8, 1)): a row-split `x` needs the (8, 1) operand split the same way, not
    replicated (which was priced as an all-gather XLA never emits)."""
    info = _info(lambda a, b: jax.lax.sub(a, b), jnp.ones((8, 6)), jnp.ones((8, 1)))
    res = st.follow_elementwise(info, 0, (("x",), ()), MESH_1D)
    assert res.in_specs == ((("x",), ()), (("x",), ())) and res.comm_s == 0
    assert res.out_specs == ((("x",), ()),)
    # A split along the broadcast dim leaves the size-1 side whole; scalars stay replicated.
    res = st.follow_elementwise(info, 0, ((), ("x",)), MESH_1D)
    assert res.in_specs == (((), ("x",)), ((), ()))
    info = _info(lambda a: a * 2.0, jnp.ones((8, 6)))
    assert st.follow_elementwise(info, 0, (("x",), ()), MESH_1D).out_specs == ((("x",), ()),)


def test_split_keeps_its_operand_layout():
    """jnp.split of a fused (64, 96) projection in three: a row split carries over for
    free; a split of the cut axis stays when every piece divides (the pieces' blocks move:
    an all-to-all, cheaper than gathering) and is gathered when one does not."""
    info = _info(lambda x: jnp.split(x, 3, axis=1), jnp.ones((64, 96)))
    assert info.eqn.name == "split"
    rows = st.follow_split(info, 0, (("x",), ()), MESH_1D)
    assert rows.out_specs == ((("x",), ()),) * 3 and rows.comm_s == 0
    cols = st.follow_split(info, 0, ((), ("x",)), MESH_1D)
    assert cols.out_specs == (((), ("x",)),) * 3
    gather = MESH_1D.all_gather_s(64 * 96 * 4, ("x",))
    assert 0 < cols.comm_s < gather
    info = _info(lambda x: jnp.split(x, [2, 60], axis=1), jnp.ones((64, 96)))
    uneven = st.follow_split(info, 0, (("x",), ("y",)), MESH_2D)   # a piece of 2, 4 ways
    assert uneven.out_specs == ((("x",), ()),) * 3 and uneven.in_specs == ((("x",), ()),)
    assert uneven.comm_s == pytest.approx(MESH_2D.all_gather_s(64 * 96 * 4 / 2, ("y",)))


def test_top_k_keeps_its_axis_whole():
    info = _info(lambda x: jax.lax.top_k(x, 2, axis=0), jnp.ones((16, 8)))
    res = st.follow_top_k(info, 0, (("x",), ("y",)), MESH_2D)
    assert res.out_specs == (((), ("y",)),) * 2 and res.comm_s > 0


def _conv_info(x_shape, w_shape, groups: int, weight_grad: bool = False) -> st.EqnInfo:
    conv = lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=groups)
    if not weight_grad:
        return _info(conv, jnp.ones(x_shape), jnp.ones(w_shape))
    out_shape = x_shape[:3] + (w_shape[3],)
    wgrad = lambda x, ct: jax.vjp(lambda w: conv(x, w), jnp.zeros(w_shape))[1](ct)[0]
    return _info(wgrad, jnp.ones(x_shape), jnp.ones(out_shape), eqn_index=-1)


def _strategy_names(info: st.EqnInfo, mesh: MeshContext) -> set[str]:
    return {s.name for s in st.enumerate_conv(info, mesh)}


def test_grouped_conv_strategies():
    """Depthwise convolutions split the batch or whole groups; their weight gradients
    (batch-grouped) split whole groups or the batch (partial sums, only with every mesh
    axis split: XLA sums them over the whole mesh); other grouped convolutions replicate
    (XLA gathers them whole).  tests/test_strategy_coverage.py runs each on devices."""
    depthwise = _conv_info((16, 6, 6, 8), (3, 3, 1, 8), groups=8)
    names = _strategy_names(depthwise, MESH_2D)
    assert {"conv batch@x group@y", "conv group@x group@y", "conv group@x batch@y"} <= names
    assert not any("cin" in n for n in names)
    assert all(s.comm_s == 0 for s in st.enumerate_conv(depthwise, MESH_2D))
    assert _strategy_names(_conv_info((16, 6, 6, 8), (3, 3, 2, 16), groups=4),
                           MESH_2D) == {"replicated"}
    wgrad = _conv_info((16, 6, 6, 8), (3, 3, 1, 8), groups=8, weight_grad=True)
    assert wgrad.params["batch_group_count"] == 8
    names = _strategy_names(wgrad, MESH_2D)
    assert {"conv group@x group@y", "conv cin@x group@y allreduce",
            "conv cin@x cin@y allreduce"} <= names
    assert "conv cin@x allreduce" not in names and "conv cin@x allreduce" in _strategy_names(
        wgrad, MESH_1D)
    # Two groups cannot be cut four ways.
    two = _conv_info((16, 6, 6, 8), (3, 3, 4, 8), groups=2, weight_grad=True)
    assert not any("group@y" in n for n in _strategy_names(two, MESH_2D))


def test_scatter_set_has_no_partial_sums():
    rows = jnp.array([1, 5])
    info = _info(lambda h, u: h.at[rows].set(u), jnp.ones((8, 16)), jnp.ones((2, 16)),
                 eqn_index=-1)
    assert info.eqn.name == "scatter"
    strategies = st.enumerate_scatter(info, MESH_1D)
    assert not any(s.partial_axes for s in strategies)
    assert (((), ("x",)),) in {s.out_specs for s in strategies}   # the window dim


def _remat_fb(x):
    f = lambda x: jnp.sin(jnp.exp(x @ x)).sum()
    y, vjp = jax.vjp(jax.checkpoint(f), x)
    return y, vjp(jnp.ones_like(y))


def test_inlined_remat_keeps_its_barrier_so_xla_recomputes():
    """JAX lowers a differentiated `remat2` with an optimization barrier on its operands;
    inlining the call must keep it, or XLA merges the recomputation with the forward (CSE)
    and the step holds the forward's values after all: one `exp` instead of jax.jit's two."""
    x = jnp.full((64, 64), 0.01)
    graph = Graph.from_jaxpr(jax.make_jaxpr(_remat_fb)(x))
    assert len(graph.barriers) == 1
    ours = jax.jit(lambda x: graph.evaluate([x])).lower(x).compile().as_text()
    ref = jax.jit(_remat_fb).lower(x).compile().as_text()
    assert ours.count("exponential(") == ref.count("exponential(") == 2
    np.testing.assert_allclose(jax.jit(lambda x: graph.evaluate([x]))(x)[1],
                               _remat_fb(x)[1][0], rtol=1e-6)


def test_shard_parallel_step_recomputes_a_rematerialized_block():
    def loss(w, x):
        block = jax.checkpoint(lambda w, x: jnp.tanh(jnp.exp(x @ w) @ w))
        return block(w, x).sum()

    def step(w, x):
        value, grad = jax.value_and_grad(loss)(w, x)
        return value, w - 0.1 * grad

    w, x = jnp.full((64, 64), 0.01), jnp.ones((64, 64))
    # One device: XLA:CPU's SPMD pipeline merges the recomputation under jax.jit too.
    par = autopar.parallelize(step, method=autopar.ShardParallel(mesh_shape=(1,)),
                              devices=jax.devices()[:1], cluster="cpu-local")
    ours = par.lower(w, x).compile().as_text()
    ref = jax.jit(step).lower(w, x).compile().as_text()
    assert ours.count("exponential(") == ref.count("exponential(") == 2
    for a, b in zip(par(w, x), step(w, x)):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def test_unknown_primitive_gets_replicated_rule():
    with pytest.warns(FallbackWarning, match="'some_new_primitive_xyz'"):
        assert st.rule_for("some_new_primitive_xyz", "model.py:3") is None


def test_intra_op_is_never_worse_than_forced_baselines():
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)

    graph = _graph(step, jax.ShapeDtypeStruct((256, 256), jnp.float32),
                   jax.ShapeDtypeStruct((65536, 256), jnp.float32))
    w, x = graph.invars
    ties = [(0, w)]
    auto = intra_op_run(graph, MESH_1D, ties=ties, time_limit_s=20)
    assert auto.solution.status == "optimal"
    data_parallel = intra_op_run(graph, MESH_1D, ties=ties, time_limit_s=20,
                                 forced={w: replicated(2), x: (("x",), ())})
    # The free search contains the data-parallel layout: it can only be cheaper.
    assert auto.cost_s <= data_parallel.cost_s + 1e-12
    assert data_parallel.value_specs[x] == (("x",), ())
    # Every matmul's work is divided 8 ways, whichever layout won: its output or an operand
    # is split (the weight gradient contracts the split batch, its output all-reduced).
    for e in graph.eqns:
        if e.name == "dot_general":
            values = [v for v in (*e.outputs, *e.inputs) if isinstance(v, int)]
            assert any(any(auto.value_specs[v]) for v in values if v in auto.value_specs), e


def test_an_unproven_short_solve_is_solved_again_with_more_time():
    """A short layer solve whose answer is not proved near the optimum (the heuristic's,
    as on a loaded machine) is solved once more with `retry_time_limit_s`; the better
    answer is kept.  A proved one is not solved again.  The retry is handed over as soon as
    the first answer arrives."""
    import dataclasses
    from concurrent.futures import Future

    from autopar.passes import intra_op
    from autopar.passes.solver import solve

    def mlp(x, w1, w2):
        return jnp.sum(jnp.tanh(x @ w1) @ w2)

    graph = _graph(mlp, jnp.ones((64, 32)), jnp.ones((32, 128)), jnp.ones((128, 32)))
    limits: list[float] = []

    def submit(problem, *, time_limit_s, backend, first_status="fallback"):
        limits.append(time_limit_s)
        sol = solve(problem, time_limit_s=time_limit_s, backend=backend)
        if len(limits) == 1:
            sol = dataclasses.replace(sol, status=first_status, lower_bound=None,
                                      stats={"first": True})
        fut: Future = Future()
        fut.set_result(sol)
        return fut

    run = intra_op.start(graph, MESH_1D, submit=submit, time_limit_s=1.0,
                         retry_time_limit_s=5.0)
    # the first answer is in: the retry is handed over at once, not when asked for
    assert limits == [1.0, 5.0]
    res = run.result()
    assert limits == [1.0, 5.0]   # and only once
    assert res.solution.stats["retried_after"] == "fallback"
    assert res.solution.status == "optimal"

    limits.clear()
    res = intra_op.start(graph, MESH_1D, submit=functools.partial(submit,
                                                                  first_status="optimal"),
                         time_limit_s=1.0, retry_time_limit_s=5.0).result()
    assert limits == [1.0] and res.solution.stats == {"first": True}


@pytest.mark.parametrize(("status", "cost", "bound", "want"), [
    ("optimal", 1.0, 1.0, False), ("fallback", 1.0, 1.0, True), ("feasible", 1.0, None, True),
    ("feasible", 1.0, 0.995, False), ("feasible", 1.0, 0.98, True)])
def test_unproven_answers(status, cost, bound, want):
    from autopar.passes.intra_op import unproven
    from autopar.passes.solver import Solution

    assert unproven(Solution((0,), cost, bound, status, 0.1)) is want


def test_build_cache_reuses_a_build_without_sharing_value_costs():
    """`intra_op.BuildCache`: a second `start` on the same graph and an equal mesh reuses
    the first build; each call's value costs (a lean solve's penalty, say) reach only its
    own problem, which equals the one an uncached `start` builds."""
    from autopar.passes import intra_op

    def mlp(x, w1, w2):
        return jnp.sum(jnp.tanh(x @ w1) @ w2)

    graph = _graph(mlp, jnp.ones((64, 32)), jnp.ones((32, 128)), jnp.ones((128, 32)))
    w1 = graph.invars[1]
    lean = {w1: lambda spec: 0.0 if any(spec) else 1.0}   # replicated w1 pays 1 s
    cache = intra_op.BuildCache()
    kw = dict(time_limit_s=5.0, traffic={w1: 3.0})
    for costs in ({}, lean, {}):
        mesh = MeshContext.build((8,), CLUSTER)            # equal, not the same object
        cached = intra_op.start(graph, mesh, value_costs=costs, builds=cache, **kw).problem
        plain = intra_op.start(graph, MESH_1D, value_costs=costs, **kw).problem
        assert len(cached.node_costs) == len(plain.node_costs)
        for a, b in zip(cached.node_costs, plain.node_costs):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(cached.edge_costs, plain.edge_costs):
            np.testing.assert_array_equal(a, b)
    assert cache.hits == 2
    # The lean call's penalty is in its problem only.
    with_lean = intra_op.start(graph, MESH_1D, value_costs=lean, builds=cache, **kw).problem
    without = intra_op.start(graph, MESH_1D, builds=cache, **kw).problem
    assert max(float(np.max(a - b)) for a, b in zip(with_lean.node_costs,
                                                     without.node_costs)) == 1.0
    # Another mesh is another build, on the same buffer analysis (it reads the graph only).
    other = intra_op.start(graph, MESH_2D, builds=cache, **kw)
    assert cache.hits == 4
    assert other.builder.buffers is intra_op.start(graph, MESH_1D, builds=cache,
                                                   **kw).builder.buffers


def test_build_memos_give_the_unmemoized_problem(monkeypatch):
    """A model's repeated blocks repeat their equations: a build reuses the strategies of
    equal matmuls (shared by the builds on one mesh through a `BuildCache`), followers and
    resharding tables (issue 47 item 4: a quarter to a half of GPT-39B's layer-ILP build
    time).  The problems equal those built with `MEMOIZE` off, and the memos were used."""
    from autopar.passes import intra_op, problem_builder

    def blocks(x, w1, w2, n=3):
        for _ in range(n):
            x = x + jnp.tanh(x @ w1) @ w2
        return jnp.sum(x)

    args = jnp.ones((64, 32)), jnp.ones((32, 128)), jnp.ones((128, 32))
    graphs = [_graph(blocks, *args), _graph(functools.partial(blocks, n=4), *args)]

    def problems():
        cache = intra_op.BuildCache()
        out = []
        for mesh in (MESH_1D, MESH_2D):
            for graph in graphs:
                pending = intra_op.start(graph, mesh, time_limit_s=5.0, builds=cache,
                                         comm_scale={0: 0.25})
                out.append((pending.problem, pending.builder.memo_hits))
        return out

    memoized = problems()
    monkeypatch.setattr(problem_builder, "MEMOIZE", False)
    plain = problems()
    for (a, hits), (b, none) in zip(memoized, plain):
        assert a.edges.tolist() == b.edges.tolist()
        for x, y in zip(a.node_costs + a.edge_costs + a.node_usages,
                        b.node_costs + b.edge_costs + b.node_usages):
            np.testing.assert_array_equal(x, y)
        assert hits["follow"] > 0 and hits["table"] > 0 and not any(none.values())
    # 3 blocks: 2 of 6 matmuls enumerated; 4 blocks on the same mesh: none of 8.
    assert [m[1]["dot"] for m in memoized[:2]] == [4, 8]


def test_every_scan_and_reduction_with_a_strategy_has_a_flop_rule():
    """The primitives the strategy table treats as reductions or cumulative scans are
    priced by their input elements (cummin and reduce_xor had a strategy and no FLOPs)."""
    from autopar.passes import primitives

    names = ("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor "
             "argmax argmin cumsum cumprod cummax cummin cumlogsumexp").split()
    assert [n for n in names if primitives.info(n).flops is None] == []
    x = jnp.arange(32, dtype=jnp.float32).reshape(4, 8)
    assert _graph(lambda x: jax.lax.cummin(x, axis=1), x).total_flops() == 32
