"""Pipelines and micro-batches return the same numbers as the jitted step that averages
loss and gradients over the same micro-batch splits (tests/helpers.py's reference).

Tolerances: SGD-momentum, rtol 2e-4 / atol 2e-5 (summation order only)."""

from __future__ import annotations

import generated
import jax
import numpy as np
import pytest

import autopar
from autopar.microbatch import MicroBatchError
from autopar.pipeline import PipelineError

from helpers import assert_same_micro_batched_run, cheap_comm_cluster
from models import make_case

TOL = dict(rtol=2e-4, atol=2e-5)
# Plans here only need to be valid, not proved optimal: short ILP limits keep the suite fast.
FAST = dict(time_limit_s=5.0)


def _pipeshard(case, **kwargs):
    return autopar.parallelize(case.step, method=autopar.PipeshardParallel(**FAST, **kwargs),
                               cluster=cheap_comm_cluster())


def _runtime(step, case):
    return step.trace(*case.init()).executable


@pytest.mark.parametrize("stages,micro,schedule", [(2, 4, "1f1b"), (4, 8, "1f1b"),
                                                   (2, 8, "gpipe"), (4, 4, "gpipe")])
def test_gpt_pipeline_matches_reference(stages, micro, schedule):
    case = make_case("gpt", "sgd")
    step = _pipeshard(case, num_micro_batches=micro, num_stages=stages, schedule=schedule)
    assert_same_micro_batched_run(case, step, micro, **TOL)
    plan = step.get_plan(*case.init())
    assert len(plan.stages) == stages
    used = [d for st in plan.stages for d in st.device_ids]
    assert len(used) == len(set(used)) == 8
    in_flight = _runtime(step, case).in_flight_max
    if schedule == "1f1b":
        assert all(n <= stages - s for s, n in enumerate(in_flight)), in_flight
    else:
        assert in_flight == [micro] * stages


def test_unequal_sub_meshes():
    case = make_case("gpt", "sgd")
    step = _pipeshard(case, num_micro_batches=4, submesh_shapes=((1, 2), (1, 2), (1, 4)))
    assert_same_micro_batched_run(case, step, 4, **TOL)
    plan = step.get_plan(*case.init())
    assert [len(st.device_ids) for st in plan.stages] == [2, 2, 4]


@pytest.mark.parametrize("name", ["convbn", "moe"])
def test_other_models_pipeline(name):
    case = make_case(name, "sgd")
    step = _pipeshard(case, num_micro_batches=4, num_stages=2)
    assert_same_micro_batched_run(case, step, 4, **TOL)


def test_adamw_pipeline():
    case = make_case("gpt", "adamw")
    step = _pipeshard(case, num_micro_batches=4, num_stages=2)
    assert_same_micro_batched_run(case, step, 4, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", ["gpt", "convbn", "remat_dropout"])
def test_shard_parallel_micro_batches(name):
    case = make_case(name, "sgd")
    step = autopar.parallelize(case.step, method=autopar.ShardParallel(
        mesh_shape=(2, 4), num_micro_batches=4, **FAST), cluster=cheap_comm_cluster())
    assert_same_micro_batched_run(case, step, 4, **TOL)


def test_pipeline_plan_round_trip_runs_without_search(tmp_path):
    case = make_case("mlp", "sgd")
    step = _pipeshard(case, num_micro_batches=2, num_stages=2)
    plan = step.get_plan(*case.init())
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded == plan and loaded.stages == plan.stages
    replay = autopar.parallelize(case.step, plan=path, cluster=cheap_comm_cluster())
    assert_same_micro_batched_run(case, replay, 2, **TOL)
    chart = tmp_path / "schedule.png"
    loaded.schedule_chart(chart)
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stage_programs_compile_for_inspection():
    case = make_case("mlp", "sgd")
    step = _pipeshard(case, num_micro_batches=2, num_stages=2)
    compiled = step.lower(*case.init()).compile()
    assert len(compiled.stages) == 2
    for stage in compiled.stages:
        assert "dot" in stage.forward.as_text()
        assert stage.backward.memory_analysis() is not None
    names = {name for name, *_ in compiled.programs()}
    assert names == {"forward", "backward", "zeros", "finalize", "apply"}


def test_manual_3d_baseline():
    case = make_case("gpt", "sgd")
    step = autopar.parallelize(case.step, method=autopar.Manual3DParallel(
        dp=2, tp=2, pp=2, num_micro_batches=4, **FAST), cluster=cheap_comm_cluster())
    assert_same_micro_batched_run(case, step, 4, **TOL)
    plan = step.get_plan(*case.init())
    assert [st.mesh_shape for st in plan.stages] == [(2, 2), (2, 2)]


def test_batch_not_divisible_by_micro_batches():
    case = make_case("mlp", "sgd")   # batch 16
    step = _pipeshard(case, num_micro_batches=3, num_stages=2)
    with pytest.raises(MicroBatchError, match=r"batch dim 16 of argument \['arg1'\]\['x'\] is "
                                              r"not divisible by num_micro_batches=3"):
        step.get_plan(*case.init())


def test_pipeline_needs_autopar_grad():
    def step(w, batch):
        g = jax.grad(lambda w: ((batch["x"] @ w) ** 2).mean())(w)
        return w - 0.1 * g

    w = np.ones((8, 8), np.float32)
    batch = {"x": np.ones((16, 8), np.float32)}
    par = autopar.parallelize(step, method=autopar.PipeshardParallel(num_stages=2))
    with pytest.raises(PipelineError, match="autopar.value_and_grad"):
        par.get_plan(w, batch)


def test_more_stages_than_devices():
    case = make_case("gpt", "sgd")
    step = autopar.parallelize(case.step, method=autopar.PipeshardParallel(
        num_micro_batches=2, num_stages=2), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="2 stages need at least 2 devices, 1 are used"):
        step.get_plan(*case.init())


def test_state_larger_than_all_devices_fails_before_searching():
    """MoE-70B on 64 V100-16GB: 70.4e9 float32 parameters, their gradients and AdamW's
    moments need 16.4 GiB per device even split over all 64: the search says so at once
    (it used to price every stage option first, minutes on 64 devices)."""
    import time

    step, args = autopar.models.train_step_and_args("moe-70b", 1024)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"need 16\.39 GiB per device even split over "
                                         r"all 64 devices"):
        autopar.plan(step, *args, cluster="8x8xV100-16GB",
                     method=autopar.PipeshardParallel(num_micro_batches=1024))
    assert time.perf_counter() - t0 < 120


def test_a_parameter_read_by_several_layers_is_updated_once_per_stage():
    """A tied embedding is read by the first layer (lookup) and the last (logits); each
    layer's ILP charges its update, but the stage updates it once, at its first reader's
    layout (where the stage's memory holds it): the stage estimate counts it once."""
    from types import SimpleNamespace

    from autopar.cost_model import ClusterSpec
    from autopar.passes.sharding_spec import MeshContext
    from autopar.pipeline_search import StateSplit, updates_s

    cluster = ClusterSpec.preset("8xV100-16GB").with_devices(1, 4)
    mesh = MeshContext.build((4,), cluster)
    embed, other = 0, 1
    graph = SimpleNamespace(values={embed: SimpleNamespace(shape=(1024, 64), nbytes=2**18),
                                    other: SimpleNamespace(shape=(64, 64), nbytes=2**14)})
    progs = [SimpleNamespace(inputs=(embed,)), SimpleNamespace(inputs=(embed, other))]
    for mode in ("none", "all"):
        # Layer solutions (stand-ins) with their memo (`LayerCost._memo`), fresh per mode.
        first = SimpleNamespace(mesh=mesh, input_specs=(((), ()),), _memo={})
        last = SimpleNamespace(mesh=mesh, input_specs=(((), ()), ((), ())), _memo={})
        split = StateSplit(mode, 2.0, cluster)
        one = {v: split.cost_s(((), ()), graph.values[v].shape, graph.values[v].nbytes, mesh)
               for v in (embed, other)}
        stage = updates_s([first, last], progs, {embed, other}, graph, split, 2)
        per_layer = updates_s([first, last], progs, {embed, other}, graph, split, 2,
                              per_layer=True)
        assert stage == pytest.approx((one[embed] + one[other]) / 2)
        assert per_layer == pytest.approx((2 * one[embed] + one[other]) / 2)


def test_stage_search_is_no_slower_than_any_pipeline_of_equal_sub_meshes():
    """The stage DP prices a stage's received activations as if sent by a stage of its own
    size; its choice is assembled with the real transfers next to the DP's best pipeline
    on each single sub-mesh shape (the hand-written 3-D plans' kind), and the fastest is
    kept: the search's plan is never slower than a pipeline of equal sub-meshes it could
    be forced to (GPT-15B on 32 V100s: the DP's mixed stages assembled at 130.5 s, four
    equal (2, 4) stages at 118.3 s)."""
    from autopar import models as zoo

    step, args = zoo.train_step_and_args("gpt-toy", 16)
    cluster = autopar.ClusterSpec.preset("8xV100-16GB").with_devices(2, 4)
    kw = dict(num_micro_batches=4, time_limit_s=5.0)
    auto = autopar.plan(step, *args, cluster=cluster, method=autopar.PipeshardParallel(**kw))
    assert auto.solver["stage_candidates"] >= 2
    layers = auto.solver["layers"]
    for submesh, count in (((1, 2), 4), ((1, 4), 2)):
        if count > layers:
            continue
        forced = autopar.plan(step, *args, cluster=cluster, method=autopar.PipeshardParallel(
            submesh_shapes=(submesh,) * count, **kw))
        assert auto.predicted.step_s <= forced.predicted.step_s * (1 + 1e-9), submesh


def test_stage_search_is_no_slower_than_one_stage_over_every_device(monkeypatch):
    """One stage over every device moves nothing between stages, so the DP prices it as
    the assembly does; the DP's pipelines leave out the sender's re-layout of each transfer
    and the per-step moves of a tied embedding.  Generated tied_embed-10 (cpu-local, 8
    devices, 8 micro-batches): the DP's 2 stages on (1, 4) sub-meshes (6.74 ms in the DP)
    assembled at 17.93 ms, one stage at 6.90 ms; the search must keep the faster."""
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", "")
    case = generated.generate(10, family="tied_embed")
    state, batch = case.init(), case.batch(0)

    def plan(**kw):
        method = autopar.PipeshardParallel(num_micro_batches=8, time_limit_s=5.0, **kw)
        return autopar.parallelize(case.step, method=method).get_plan(state, batch)

    auto, one = plan(), plan(num_stages=1)
    assert len(one.stages) == 1 and len(one.stages[0].device_ids) == 8
    assert auto.predicted.step_s <= one.predicted.step_s * (1 + 1e-9)


def test_layers_that_read_their_parameters_in_another_id_order_share_one_solution():
    """Layer solutions are stored by input position and reused for every layer with the
    same key.  Two layers with the same equations can read their parameters in the other id
    order (Block_10's parameters are numbered before Block_7's): layer 1 reads w0 then w1
    (ids in that order), layer 2 reads w3 then w2, layer 3 reads w4 then w5.  A layer lists
    its inputs in the order it first reads them, so all three are one program (one set of
    layer ILPs, GPT-39B's layers 1 and 3 were solved apart), and their forward+backward
    programs number their values alike, so one layer's solution names the same values in
    the others; a layer that reads them in another pattern is another program."""
    import jax.numpy as jnp

    from autopar.graph import Graph
    from autopar.layer import LayerProgram
    from autopar.pipeline import program_for_range
    from autopar.pipeline_search.reuse import _program_key

    def f(w, x):
        for first, second in ((0, 1), (3, 2), (4, 5)):
            x = jnp.tanh(jnp.tanh(x @ w[first]) @ w[second])
        x = jnp.tanh(w[6] @ jnp.tanh(x @ w[7]))  # the other operand order
        return x.sum()

    w = [jax.ShapeDtypeStruct((16, 16), jnp.float32)] * 8
    x = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    graph = Graph.from_jaxpr(jax.make_jaxpr(f)(w, x))
    assert [e.name for e in graph.eqns[:4]] == ["dot_general", "tanh"] * 2
    layers = [program_for_range(graph, 4 * k, 4 * k + 4) for k in range(4)]
    ws = graph.invars[:8]
    assert [tuple(ws.index(v) if v in ws else "x" for v in p.inputs) for p in layers] == [
        ("x", 0, 1), ("x", 3, 2), ("x", 4, 5), ("x", 7, 6)]
    keys = [_program_key(graph, prog, set(ws)) for prog in layers]
    assert keys[0] == keys[1] == keys[2] != keys[3]
    fbs = [LayerProgram.build(graph, prog, set(ws)).fb for prog in layers[:3]]
    text = [[(e.name, e.inputs, e.outputs) for e in fb.eqns] + [fb.invars, fb.outvars]
            for fb in fbs]
    assert text[0] == text[1] == text[2]


def test_a_fixed_3d_plan_on_a_communication_only_cluster():
    """Layer solves that cost more than the penalty seconds are not penalized ones: on a
    cluster priced on communication only (free compute, 10 s per byte) every layer costs over
    1e4 s, and the pipeline planner, which told a penalized solve by its cost, dropped them
    all ("min() arg is an empty sequence")."""
    import dataclasses

    from autopar.cost_model import ClusterSpec, Link

    case = make_case("mlp", "sgd")
    comm = dataclasses.replace(ClusterSpec.preset("cpu-local"), name="comm-only",
                               intra_host=Link(0.0, 10.0), inter_host=Link(0.0, 10.0),
                               peak_flops={"float32": 1e30}, memory_bandwidth_bytes_per_s=1e30)
    method = autopar.Manual3DParallel(dp=2, tp=2, pp=2, num_micro_batches=2, **FAST)
    step = autopar.parallelize(case.step, method=method, cluster=comm)
    plan = step.get_plan(*case.init())
    assert len(plan.stages) == 2 and plan.predicted.step_s > 1e4
    assert_same_micro_batched_run(case, step, 2, **TOL)
