"""The pipeline runtime runs the plan it priced, read off the compiled programs of one step.

Every program a pipelined step runs (per stage: forward and backward per micro-batch, the
accumulator reset and the gradient reduction per step, or all of them as one program for a
single 1F1B stage; the apply-grad segments) is compiled and audited
(`cost_model.hlo_audit`); collective bytes are summed over the calls of one step.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import autopar
from autopar.cost_model import hlo_audit
from autopar.passes.sharding_spec import is_slice
from autopar.transfer import with_tiling

from helpers import assert_same_micro_batched_run, cheap_comm_cluster
from models import convbn_case, make_case, mlp_case, moe_case

TOL = dict(rtol=2e-4, atol=2e-5)
FAST = dict(time_limit_s=5.0)


def _step_audit(step, args) -> dict[str, dict[str, float]]:
    """Collective bytes per program kind, summed over one step's calls, and each program."""
    plan = step.get_plan(*args)
    compiled = step.lower(*args).compile()
    per_kind: dict[str, dict[str, float]] = {}
    for name, stage, prog, calls in compiled.programs():
        st = plan.stages[stage]
        audit = hlo_audit.audit(prog, st.mesh_shape, st.mesh_axes)
        slot = per_kind.setdefault(name, {})
        for kind, nbytes in audit.bytes_by_kind().items():
            slot[kind] = slot.get(kind, 0.0) + nbytes * calls
    return per_kind


def _param_bytes(state) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["params"]))


@pytest.mark.parametrize("shard_state", [True, False])
def test_data_parallel_stages_reduce_gradients_once_per_step(shard_state):
    # Two stages, each a 4-way data-parallel mesh: the backward of every micro-batch keeps
    # its gradients unreduced (no collective at all), and the step reduces each gradient
    # exactly once — the bytes of the parameters, not 4x that: one reduce-scatter onto
    # the optimizer state's split (ZeRO-2), whose update's all-gather brings the new
    # parameters back; or, with the state laid out like the parameters, one all-reduce.
    # Batch 64: 4 rows per device per micro-batch. (With 1 row, the rows weigh less than
    # the weights each device reads whole, and the stages' layer solutions replicate the
    # activations instead.)
    case = mlp_case(batch=64)
    state, batch = case.init()
    step = autopar.parallelize(case.step, method=autopar.Manual3DParallel(
        dp=4, tp=1, pp=2, num_micro_batches=4, shard_optimizer_state=shard_state, **FAST),
        donate_argnums=())
    audit = _step_audit(step, (state, batch))
    params = _param_bytes(state)
    # The forward reduces the loss (a float32 scalar per micro-batch) and gathers the one
    # activation stage 0 sends: stage 1's plan takes it whole (its layer solution's input
    # layout), and the transfer's re-layout runs in the sender's program, once per
    # micro-batch (the copy between the stages is then shard by shard).  Its cotangent
    # goes back split, as the activation was made: the backward has no collective.
    activation = (64 // 4) * 32 * 4
    assert audit["forward"] == {"all-reduce": 4 * 4, "all-gather": 4 * activation}, audit
    assert not audit["backward"], audit
    # (The apply's all-reduces, if any, are the clip's partial squared norms: scalars.)
    assert audit["apply"].get("all-reduce", 0.0) < 1024, audit
    if shard_state:
        assert audit["finalize"] == {"reduce-scatter": params}, audit
        assert audit["apply"]["all-gather"] == params, audit
    else:
        assert audit["finalize"] == {"all-reduce": params}, audit
        assert "all-gather" not in audit["apply"], audit
    assert_same_micro_batched_run(case, step, 4, **TOL)


def _data_parallel_stages(case):
    """`case` on two 4-way data-parallel stages, 4 micro-batches, the optimizer state laid
    out like the parameters: (the step, the state, the step's audit)."""
    state, batch = case.init()
    step = autopar.parallelize(
        case.step, method=autopar.Manual3DParallel(dp=4, tp=1, pp=2, num_micro_batches=4,
                                                   shard_optimizer_state=False, **FAST),
        donate_argnums=())
    return step, state, _step_audit(step, (state, batch))


def test_convolution_gradients_are_reduced_once_per_step():
    # Two 4-way data-parallel stages of a conv+BatchNorm net, 4 micro-batches: each
    # kernel's gradient (a convolution summing over the split batch) stays unreduced in
    # every backward and is all-reduced once, in the step's finalize.  What the backward
    # still reduces per micro-batch is BatchNorm's per-channel sums, which the input's
    # gradient needs there (2 x 8 and 2 x 16 float32 per micro-batch; XLA shares them with
    # the scale and bias gradients).
    case = convbn_case(batch=64)
    step, state, audit = _data_parallel_stages(case)
    kernels = sum(x.size * 4 for path, x in jax.tree_util.tree_leaves_with_path(state["params"])
                  if "kernel" in jax.tree_util.keystr(path))
    assert audit["backward"].get("all-reduce", 0.0) <= 4 * 4 * (2 * 8 + 2 * 16), audit
    assert set(audit["backward"]) <= {"all-reduce"}, audit
    assert set(audit["finalize"]) == {"all-reduce"}, audit
    assert kernels <= audit["finalize"]["all-reduce"] <= _param_bytes(state), audit
    assert_same_micro_batched_run(case, step, 4, **TOL)


def test_moe_stages_reduce_gradients_once_per_step():
    # The MoE classifier on two 4-way data-parallel stages, 4 micro-batches: the backward
    # moves tokens to and from their experts (all-to-alls) and reduces no gradient; the
    # finalize reduces them once per step, at most every parameter's bytes once.
    case = moe_case(batch=64)
    step, state, audit = _data_parallel_stages(case)
    assert "all-reduce" not in audit["backward"], audit
    assert set(audit["finalize"]) == {"all-reduce"}, audit
    assert audit["finalize"]["all-reduce"] <= _param_bytes(state), audit
    assert_same_micro_batched_run(case, step, 4, **TOL)


def test_stage_programs_take_the_planned_layouts():
    # Each stage's forward returns its activations in the layouts its layer solutions
    # chose (the plan is emitted, not left to XLA), on a plan that splits almost
    # everything (cheap communication); an activation a later stage reads leaves in that
    # stage's planned input layout, tiled on the sender's devices (the transfer is then a
    # copy shard by shard).
    case = make_case("gpt", "sgd")
    args = case.init()
    step = autopar.parallelize(case.step, method=autopar.PipeshardParallel(
        num_micro_batches=4, num_stages=2, **FAST), cluster=cheap_comm_cluster())
    traced = step.trace(*args)
    runtime = traced.executable
    compiled = step.lower(*args).compile()
    checked = sent = 0
    for st, runner, comp in zip(traced.plan.stages, runtime.stages, compiled.stages):
        assert st.layer_plans, "searched plans record every layer's solution"
        last = runner.layers[-1].program
        specs = dict(st.layer_plans[-1].value_specs)
        outs = dict(zip(last.fn.float_outs, last.fb.outvars))
        for vid, sharding in zip(runner.float_outs, comp.forward.output_shardings[0]):
            if vid in outs and outs[vid] in specs:
                want = jax.sharding.NamedSharding(runner.mesh,
                                                  autopar.constraints.to_pspec(specs[outs[vid]]))
                reader = next((r for r in runtime.stages[runtime.stages.index(runner) + 1:]
                               if vid in r.input_shardings), None)
                if reader is not None and reader.mesh.size == runner.mesh.size:
                    want = with_tiling(reader.input_shardings[vid],
                                       list(runner.mesh.devices.flat))
                    sent += 1
                ndim = runner.graph.values[vid].ndim
                assert sharding.is_equivalent_to(want, ndim), (vid, sharding, want)
                checked += 1
    assert checked and sent
    assert_same_micro_batched_run(case, step, 4, **TOL)


def test_stages_recompute_the_optimizers_scalars():
    """Adam's bias corrections are scalars made from the step count: each stage's apply
    computes them itself rather than receiving them from the stage that holds the count
    (a transfer and a program boundary per stage per step).  Only values made from the
    stages' own data (the clip's partial norms and what is made from their sum) cross
    between stages."""
    from autopar import outer

    case = make_case("mlp", "adamw")
    state, batch = case.init()
    step = autopar.parallelize(case.step, method=autopar.PipeshardParallel(
        num_micro_batches=2, num_stages=2, **FAST), donate_argnums=())
    runtime = step.trace(state, batch).executable
    jaxpr = runtime.split.step.jaxpr
    post = [i for seg in runtime.post for i in seg.eqns]
    tiny = {v for i in outer.tiny_eqns(jaxpr, post) for v in jaxpr.eqns[i].outvars}
    assert any(v.aval.dtype == np.int32 for v in tiny), "the step count's increment is tiny"
    made_on = {v: seg.stage for seg in runtime.post for v in seg.outputs}
    crossing = [v for seg in runtime.post for v in seg.inputs
                if v in made_on and made_on[v] != seg.stage]
    assert crossing, "the clip's norms cross between the stages"
    assert not [v for v in crossing if v in tiny], crossing
    recomputed = [seg for seg in runtime.post if seg.copies]
    assert recomputed and all(seg.copies <= tiny for seg in recomputed)
    assert_same_micro_batched_run(case, step, 2, **TOL)


def test_moves_between_stages_stay_on_the_devices(monkeypatch):
    """`transfer.local_move` re-lays an array out and moves it between device sets without
    reading it to the host (`jax.device_put` does, for any destination shard the source
    does not hold whole: that read waits for the producer and stalls the driver)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from autopar import transfer

    d = jax.devices()
    grid = Mesh(np.array(d[:4]).reshape(2, 2), ("x", "y"))
    line = Mesh(np.array(d[4:]), ("x",))
    pair = Mesh(np.array(d[4:6]), ("x",))
    ref = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    host_reads = []
    cls = type(jax.device_put(ref, NamedSharding(grid, P())))
    read = cls._value

    def counted(self):
        host_reads.append(self.shape)
        return read.fget(self)

    cases = [(P("x", "y"), line, P(None, "x")),   # same count, new tiling
             (P("x", "y"), line, P()),            # gathered on the way
             (P(), line, P("x")),                 # sliced on the way
             (P("x", "y"), grid, P("y", "x")),    # same devices
             (P("x", "y"), pair, P("x")),         # fewer devices
             (P("x"), grid, P("x"))]              # more devices
    for src_spec, mesh, dst_spec in cases:
        x = jax.device_put(ref, NamedSharding(grid, src_spec)).block_until_ready()
        dst = NamedSharding(mesh, dst_spec)
        with monkeypatch.context() as m:
            m.setattr(cls, "_value", property(counted))
            y = transfer.local_move(x, dst).block_until_ready()
            assert not host_reads, (src_spec, dst)
            # The plain device_put reads the array to the host here (jax 0.10.2): the case
            # is one the fast path must handle.
            if src_spec == P("x", "y") and mesh is line:
                jax.device_put(x, dst).block_until_ready()
                assert host_reads
                host_reads.clear()
        assert y.sharding == dst
        np.testing.assert_array_equal(np.asarray(y), ref)


def test_parameters_are_read_from_the_layout_they_arrive_in():
    """A parameter that arrives replicated, pinned split for one reader and read whole by
    another: pinning the value first makes XLA all-gather it back (a weight's all-gather
    per call); reading each layout from the arriving value (`raw_inputs`) slices
    locally. Same numbers either way."""
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    from autopar.constraints import Constraints
    from autopar.graph import Graph

    mesh = Mesh(np.array(jax.devices()[:8]), ("x",), axis_types=(AxisType.Auto,))
    w = jax.random.normal(jax.random.key(0), (64, 32))
    x = jax.random.normal(jax.random.key(1), (16, 64))
    graph = Graph.from_jaxpr(jax.make_jaxpr(lambda w, x: (x @ w, w * 2.0))(w, x))
    wid, xid = graph.invars
    dot = next(e for e, eqn in enumerate(graph.eqns) if wid in eqn.inputs and
               len(eqn.inputs) == 2 and xid in eqn.inputs)
    split, whole = (("x",), ()), ((), ())

    def program(raw):
        hooks = Constraints.build(graph, mesh, [(wid, split)], [(dot, 1, whole)],
                                  raw_inputs=[(wid, whole)] if raw else ())

        def f(w, x):
            env = {wid: hooks.on_value(wid, w), xid: x}
            graph.run_eqns(range(len(graph.eqns)), env, hooks.on_value, hooks.on_operand)
            return [env[v] for v in graph.outvars]
        rep = NamedSharding(mesh, PartitionSpec())
        return jax.jit(f, in_shardings=(rep, rep)).lower(w, x).compile()

    pinned, raw = program(False), program(True)
    gathered = hlo_audit.audit(pinned, (8,), ("x",)).bytes_by_kind()
    assert gathered.get("all-gather", 0) >= w.nbytes * 7 / 8
    assert hlo_audit.audit(raw, (8,), ("x",)).collectives == ()
    for a, b in zip(pinned(w, x), raw(w, x)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(raw(w, x)[0]), np.asarray(x @ w), rtol=1e-5)


def test_a_stage_input_moved_and_split_leaves_the_original_donatable():
    """A parameter replicated on its owner's devices and split on another stage's: the
    moved copy must not keep a hold on the original, or apply-grad's donation of it is
    silently refused (JAX keeps the buffer and the update is a copy)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from autopar.runtime import _stage_input

    devices = np.array(jax.devices()[:8])
    owner = Mesh(devices[:4].reshape(2, 2), ("x", "y"))
    other = Mesh(devices[4:].reshape(2, 2), ("x", "y"))
    host = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    x = jax.device_put(host, NamedSharding(owner, PartitionSpec()))
    split = NamedSharding(other, PartitionSpec(("x", "y"), None))
    moved = _stage_input(x, split)
    assert moved.sharding == split
    # Compared with the host copy: since jax 0.11 `np.asarray(x)` of a CPU array is a
    # zero-copy view that itself keeps `x` from being donated.
    np.testing.assert_array_equal(np.asarray(moved), host)
    update = jax.jit(lambda a: a * 2, donate_argnums=0)
    update(x)
    assert x.is_deleted()


@pytest.mark.parametrize("have,spec", [
    (((), ("y",)), (("x",), ("y",))),      # the state split joins the kept one
    ((("y",), ()), (("x", "y"), ())),      # on the same dim: y stays major, then a permute
    (((), ()), (("x",), ())),              # nothing kept
])
def test_gradient_reduction_keeps_the_accumulators_other_splits(have, spec):
    """Partial sums stacked over x (a 2x2 mesh), the gradient split over y as they were
    accumulated: the step's one reduction reduce-scatters over x each device's own block,
    and gathers nothing over y first."""
    from jax.sharding import AxisType, Mesh, NamedSharding

    from autopar.constraints import to_pspec
    from autopar.grad_accum import reduce_to, stacked_spec

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"),
                axis_types=(AxisType.Auto,) * 2)
    stack = jax.random.normal(jax.random.key(0), (2, 64, 32))
    layout = NamedSharding(mesh, to_pspec(stacked_spec(have, ("x",))))
    fn = jax.jit(lambda s: reduce_to({("x",): s}, spec, mesh, have=have),
                 in_shardings=layout).lower(jax.device_put(stack, layout)).compile()
    kinds = hlo_audit.audit(fn, (2, 2), ("x", "y")).bytes_by_kind()
    assert "all-gather" not in kinds and "all-reduce" not in kinds, kinds
    assert kinds["reduce-scatter"] == 64 * 32 * 4 / mesh.shape["y"] ** (have != ((), ())), kinds
    out = fn(jax.device_put(stack, layout))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, to_pspec(spec)), out.ndim)
    np.testing.assert_allclose(np.asarray(out), np.asarray(stack.sum(0)), rtol=1e-6)


def test_state_keeps_its_layout_and_is_donated():
    case = make_case("gpt", "adamw")
    state, batch = case.init()
    step = autopar.parallelize(case.step, method=autopar.PipeshardParallel(
        num_micro_batches=2, num_stages=2, **FAST), cluster=cheap_comm_cluster())
    s1, _ = step(state, batch)
    s2, _ = step(s1, case.batch_for_step(1))
    # The state the step returns is laid out as the step takes it (the next call moves
    # nothing), and it is donated by default: the input buffers are updated in place.
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
        assert b.sharding == a.sharding
    params_and_moments = jax.tree.leaves((s1["params"], s1["opt_state"][1][0].mu))
    assert all(x.is_deleted() for x in params_and_moments)
    leaves = jax.tree.leaves(s2)
    assert any(len(x.sharding.device_set) < len(jax.devices()) for x in leaves), \
        "parameters and optimizer state live on their stage's devices"
    # Adam's moments take their parameter's state layout: the parameter's, cut further
    # over the stage's data-parallel axes (the plan's state_specs).
    params = jax.tree.leaves(s2["params"])
    mu = jax.tree.leaves(s2["opt_state"][1][0].mu)
    for p, m in zip(params, mu):
        assert m.sharding.mesh == p.sharding.mesh
        assert is_slice(_spec(p), _spec(m)), (p.sharding, m.sharding)
    smaller = [m for p, m in zip(params, mu) if _shard_bytes(m) < _shard_bytes(p)]
    assert smaller, "the optimizer state is split over the stages' data-parallel axes"
    assert all(st.state_specs for st in step.get_plan(s2, case.batch_for_step(2)).stages)


def _spec(x) -> tuple[tuple[str, ...], ...]:
    spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
    return tuple(() if a is None else (a,) if isinstance(a, str) else tuple(a) for a in spec)


def _shard_bytes(x) -> int:
    return int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize


def test_optimizer_state_split_where_it_pays_or_memory_needs_it():
    # Without the split the moments keep their parameter's layout.  With it allowed, a
    # stage splits its state where that is faster or where its memory needs it: on this
    # small model the all-gather after a split update costs more than the smaller update
    # saves, so no split; under a budget the unsplit stage does not fit, the state is
    # split, the planner prices less memory and the compiled step holds less.
    case = make_case("mlp", "adamw")
    state, batch = case.init()

    def step(split: bool, budget: float | None = None):
        return autopar.parallelize(case.step, method=autopar.PipeshardParallel(
            num_micro_batches=2, num_stages=1, shard_optimizer_state=split,
            memory_budget_bytes=budget, **FAST), donate_argnums=())

    off = step(False)
    s, _ = off(state, batch)
    for p, m in zip(jax.tree.leaves(s["params"]), jax.tree.leaves(s["opt_state"][1][0].mu)):
        assert m.sharding == p.sharding
    plan_off = off.get_plan(state, batch)
    assert not plan_off.stages[0].state_specs
    assert not step(True).get_plan(state, batch).stages[0].state_specs
    # (At 0.999 of it, another unsplit layout fits: the planner counts each gradient
    # accumulator unreduced over the data-parallel axes, as the runtime keeps it.)
    budget = plan_off.predicted.memory_bytes * 0.9
    tight = step(True, budget)
    plan = tight.get_plan(state, batch)
    assert plan.stages[0].state_specs
    assert plan.predicted.memory_bytes <= budget
    compiled = {z: max(f.lower(state, batch).compile().stage_memory_bytes())
                for z, f in ((True, tight), (False, off))}
    assert compiled[True] < compiled[False], compiled
    with pytest.raises(ValueError, match="shard_optimizer_state"):
        autopar.PipeshardParallel(shard_optimizer_state="yes")


def test_parameters_are_kept_as_read_not_gathered_after_the_update():
    """The layer ILPs price each parameter layout's all-gather after a split update, so
    a tensor-parallel stage keeps its weights split as its layers read them (no gather)
    instead of replicated for free slicing (a whole all-gather per step).  Wide MLP on
    one 8-device stage, the one-stage step's programs read by their HLO."""
    case = mlp_case(batch=64, hidden=256, layers=2, optimizer="adamw")
    state, batch = case.init()
    step = autopar.parallelize(case.step, method=autopar.PipeshardParallel(
        num_micro_batches=2, num_stages=1, **FAST), donate_argnums=())
    plan = step.get_plan(state, batch)
    weights = [v for v, spec in plan.stages[0].input_specs if len(spec) == 2
               and step.trace(state, batch).executable.graph.values[v].shape == (256, 256)]
    assert weights
    audit = _step_audit(step, (state, batch))
    gathered = audit.get("apply", {}).get("all-gather", 0.0)
    assert gathered < 0.1 * _param_bytes(state), (audit, plan.stages[0].input_specs)
    assert_same_micro_batched_run(case, step, 2, **TOL)


def test_donation_opt_out():
    case = make_case("mlp", "sgd")
    state, batch = case.init()
    step = autopar.parallelize(case.step, method=autopar.PipeshardParallel(
        num_micro_batches=2, num_stages=2, **FAST), donate_argnums=())
    step(state, batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))


def test_transfers_are_priced_and_non_differentiable_values_get_no_cotangent():
    case = make_case("gpt", "sgd")
    args = case.init()
    step = autopar.parallelize(case.step, method=autopar.PipeshardParallel(
        num_micro_batches=4, num_stages=2, **FAST))
    traced = step.trace(*args)
    plan = traced.plan
    assert plan.stages[0].transfer_s == 0.0 and plan.stages[1].transfer_s > 0.0
    runtime = traced.executable
    second = runtime.stages[1]
    graph = runtime.graph
    floats = [v for v in second.micro_ids if v not in runtime.batch_vids
              and np.issubdtype(graph.values[v].dtype, np.floating)]
    # The causal mask (computed from iota, not from the parameters) crosses the boundary
    # but gets no cotangent back.
    assert set(second.act_ct_ids) < set(floats), (second.act_ct_ids, floats)


@pytest.mark.parametrize("micro_batches,group", [(4, 4), (16, 8)])
def test_one_stage_1f1b_step_is_one_program(micro_batches, group):
    # One stage under 1F1B runs each micro-batch's forward then its backward: the runtime
    # runs them, the accumulator reset and the reduction as one program per step (plus
    # apply-grad), built from the same layer programs; GPipe keeps its schedule.  Up to
    # UNROLL (8) micro-batches are written out one after another; 16 run as a loop of two
    # groups of 8.
    from autopar.stage_runner import UNROLL
    assert group == min(UNROLL, micro_batches)
    case = mlp_case(batch=128, optimizer="sgd")
    state, batch = case.init()
    step = autopar.parallelize(case.step, method=autopar.PipeshardParallel(
        num_micro_batches=micro_batches, num_stages=1, **FAST), cluster=cheap_comm_cluster())
    assert step.trace(state, batch).executable.fused
    compiled = step.lower(state, batch).compile()
    assert {name for name, *_ in compiled.programs()} <= {"step", "apply"}
    (stage,) = compiled.stages
    plan = step.get_plan(state, batch)
    mesh = (plan.stages[0].mesh_shape, plan.stages[0].mesh_axes)
    fused = hlo_audit.audit(stage.step, *mesh)
    total = lambda *progs: sum(sum(hlo_audit.audit(p, *mesh).bytes_by_kind().values())
                               for p in progs)
    # A loop's body runs micro_batches / group times; its collectives are those of `group`
    # forwards and backwards (XLA may merge some).  The rest run once per step: the
    # reduction, the re-layouts of parameters (at most the parameters' bytes) and, written
    # out, every micro-batch's.
    loops = micro_batches // group
    assert {c.count for c in fused.collectives} <= {1, loops}, fused.summary()
    per_micro = total(stage.forward, stage.backward)
    if loops > 1:
        in_loop = sum(c.nbytes for c in fused.collectives if c.count == loops)
        assert 0 < in_loop <= group * per_micro + 1e-6, fused.summary()
    assert 0 < sum(fused.bytes_by_kind().values()) <= (
        micro_batches * per_micro + total(stage.finalize) + _param_bytes(state) + 1e-6), \
        fused.summary()
    assert_same_micro_batched_run(case, step, micro_batches, **TOL)
    gpipe = autopar.parallelize(case.step, method=autopar.PipeshardParallel(
        num_micro_batches=micro_batches, num_stages=1, schedule="gpipe", **FAST),
        cluster=cheap_comm_cluster())
    assert not gpipe.trace(state, batch).executable.fused


@pytest.mark.parametrize("name,stages,schedule,optimizer", [
    ("gpt", 1, "1f1b", "adamw"),
    ("scan", 2, "1f1b", "sgd"),
    ("remat_dropout", 2, "gpipe", "adamw"),
])
def test_pipeline_equivalence_more_models(name, stages, schedule, optimizer):
    case = make_case(name, optimizer)
    step = autopar.parallelize(case.step, method=autopar.PipeshardParallel(
        num_micro_batches=4, num_stages=stages, schedule=schedule, **FAST),
        cluster=cheap_comm_cluster())
    tol = TOL if optimizer == "sgd" else dict(rtol=1e-3, atol=1e-4)
    assert_same_micro_batched_run(case, step, 4, **tol)


_UNBLOCKED_STEPS = r'''
import jax
jax.config.update("jax_num_cpu_devices", 8)
import flax.linen as nn
import optax
import autopar

class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(16)(x)

model, tx = MLP(), optax.adam(1e-3)
def step(state, batch):
    def loss_fn(p):
        logits = model.apply({"params": p}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    loss, grads = autopar.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

k = jax.random.split(jax.random.key(0), 3)
batch = {"x": jax.random.normal(k[0], (256, 512)), "y": jax.random.randint(k[1], (256,), 0, 16)}
params = model.init(k[2], batch["x"])["params"]
state = {"params": params, "opt": tx.init(params)}
par = autopar.parallelize(step, method=autopar.PipeshardParallel(
    num_micro_batches=4, num_stages=1, time_limit_s=5.0))
losses = []
for _ in range(12):   # no block_until_ready between steps, as a training loop is written
    state, loss = par(state, batch)
    losses.append(loss)
print("losses", [round(float(x), 4) for x in losses], flush=True)
'''


def test_unblocked_steps_on_cpu_devices_do_not_deadlock(tmp_path):
    # A training loop that never waits for a step: with the steps' programs overlapping,
    # XLA's CPU client deadlocked in an all-gather on the 5th step (1 stage on 8 emulated
    # devices).  The runtime now returns each CPU step once it is done.  In a child
    # process: a deadlock ends in XLA's fatal rendezvous timeout, which would take pytest
    # down with it.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _UNBLOCKED_STEPS], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = eval(proc.stdout.split("losses", 1)[1])  # noqa: S307 (our own print)
    assert len(losses) == 12 and losses[-1] < losses[0]
