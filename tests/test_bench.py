"""The benchmark harness (issue 6): FLOP formulas, hand-written layouts and their grid
search, the step model's memory terms, suite output, and the toy suite's real runs."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from autopar import models as zoo
from autopar.cost_model import ClusterSpec
from autopar.graph import Graph
from autopar.passes.sharding_spec import MeshContext
from benchmarks import explain, layouts, suite, toy
from benchmarks.workload import Workload


def _forward_flops(cfg, batch: int) -> float:
    """FLOPs of the model's forward as autopar's graph counts them (every equation)."""
    if isinstance(cfg, zoo.WRNConfig):
        model = zoo.WideResNet(cfg)
        x = jax.ShapeDtypeStruct((batch, cfg.image, cfg.image, 3), jnp.float32)
        v = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                              jnp.zeros((1, cfg.image, cfg.image, 3))))
        f = lambda v, x: model.apply(v, x, mutable=["batch_stats"])[0]
    else:
        model = zoo.GPT(cfg) if isinstance(cfg, zoo.GPTConfig) else zoo.MoE(cfg)
        x = jax.ShapeDtypeStruct((batch, cfg.seq), jnp.int32)
        v = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                              jnp.zeros((1, cfg.seq), jnp.int32)))
        f = model.apply
    return Graph.from_jaxpr(jax.make_jaxpr(f)(v, x)).total_flops()


@pytest.mark.parametrize("cfg,rule,batch,tol", [
    (zoo.GPTConfig(512, 2, 8, vocab=2048, seq=256, remat=False), zoo.gpt_flops_per_step, 4, 0.02),
    (zoo.MoEConfig(512, 2, 4, heads=8, vocab=2048, seq=256, group=256, remat=False),
     zoo.moe_flops_per_step, 4, 0.02),
    (zoo.WRNConfig(16, 2, image=64, classes=64, remat=False), zoo.wrn_flops_per_step, 2, 0.05),
])
def test_flop_formula_matches_the_traced_forward(cfg, rule, batch, tol):
    # Formulas count matmuls/convolutions only; the graph also counts elementwise ops.
    counted = 3 * _forward_flops(cfg, batch)
    assert rule(cfg, batch) == pytest.approx(counted, rel=tol)
    assert rule(cfg, batch) <= counted


def test_gpt_formula_is_narayanan_eq3():
    cfg = zoo.GPT_CONFIGS["gpt-1.3b"]
    b, s, layers, h, v = 1024, 1024, 24, 2048, 51200
    assert zoo.gpt_flops_per_step(cfg, b) == 72 * b * s * layers * h * h * (
        1 + s / (6 * h) + v / (12 * layers * h))


@pytest.mark.parametrize("name,billions", [("gpt-39b", 39.1), ("moe-380m", 0.38),
                                           ("moe-70b", 70.4), ("wrn-250m", 0.25),
                                           ("wrn-6.8b", 6.7)])
def test_zoo_parameter_counts_match_the_names(name, billions):
    assert zoo.param_count(name) / 1e9 == pytest.approx(billions, rel=0.03)


def test_flops_per_step_rejects_unknown_model():
    with pytest.raises(ValueError, match="unknown model 'gpt-1t'"):
        zoo.flops_per_step("gpt-1t", 8)


def test_grid_and_micro_batch_candidates():
    assert layouts.micro_candidates(16, dp=2, pp=2) == [2, 4, 8]
    assert layouts.micro_candidates(16, dp=1, pp=1, max_micro=4) == [1, 2, 4]
    grid = layouts.grid_3d(8, devices_per_host=4, num_layers=4, global_batch=16)
    assert all(dp * tp * pp == 8 and tp <= 4 and pp <= 4 for dp, tp, pp in grid)
    assert (8, 1, 1) in grid and (2, 4, 1) in grid and (1, 2, 4) in grid
    assert (1, 8, 1) not in grid  # tensor parallel stays inside a host
    assert (1, 1, 8) not in grid  # more stages than layers


def test_tensor_parallel_rule():
    mesh = MeshContext.build((2, 4), ClusterSpec.preset("8xA100-80GB"))
    rule = layouts.param_rule("tensor")
    assert rule("['arg0']['params']['Block_0']['Dense_0']['kernel']", (64, 256), mesh) == \
        ((), ("y",))
    assert rule("['arg0']['params']['Block_0']['Dense_1']['kernel']", (256, 64), mesh) == \
        (("y",), ())
    assert rule("['arg0']['params']['MoEFFN_0']['wi']", (8, 64, 512), mesh) == \
        (("y",), (), ())
    assert rule("['arg0']['params']['Conv_0']['kernel']", (3, 3, 16, 32), mesh) == \
        ((), (), (), ("y",))
    assert rule("['arg0']['params']['LayerNorm_0']['scale']", (64,), mesh) == ((),)
    assert layouts.param_rule("zero3")("w", (6, 8), mesh) == ((), ("x",))
    with pytest.raises(ValueError, match="unknown parameter rule 'megatron'"):
        layouts.param_rule("megatron")


@pytest.fixture(scope="module")
def toy_pricer():
    cluster = ClusterSpec.preset("8xA100-80GB").with_devices(1, 4)
    return layouts.Pricer("gpt-toy", 16, cluster)


def test_stage_remat_keeps_only_stage_inputs(toy_pricer):
    """The zoo's blocks use nn.remat; the planner rematerializes per stage, so a middle
    layer keeps only its input activations for the backward."""
    w = toy_pricer.workload(2)
    assert w.split.remat
    p = toy_pricer.layer(w, 1, (2, 2), "replicated")
    act = [v for v in w.layers[1].inputs if v not in w.param_ids]
    kept = sum(w.value_bytes(v) for v in act)
    assert 0 < p.residual_bytes <= kept


def test_lean_layer_solve_cuts_every_parameter_as_finely_as_it_goes(toy_pricer):
    """The memory-lean end of a layer's trade-off (`start_price_stage(lean=True)`, taken
    by a stage whose time-optimal layouts do not fit): every parameter input is cut into
    as many shards as its shape allows on the mesh, at a finite time no lower than the
    time-optimal solve's, holding no more parameter bytes."""
    from autopar.passes.sharding_spec import enumerate_specs
    from autopar.pipeline_search import LEAN_PENALTY_S, price_stage

    w = toy_pricer.workload(2)
    kw = dict(solver="auto", time_limit_s=10, batch_size=w.micro_batch, shapes=[(2, 2)],
              remat=w.split.remat, num_micro_batches=2)
    args = (w.graph, w.layers[1], w.diff, toy_pricer.cluster, (1, 4))
    fast = price_stage(*args, **kw)[(2, 2)]
    lean = price_stage(*args, lean=True, **kw)[(2, 2)]
    assert fast.cost_s <= lean.cost_s < LEAN_PENALTY_S
    held = {"fast": 0.0, "lean": 0.0}
    for vid, f_spec, l_spec in zip(w.layers[1].inputs, fast.input_specs, lean.input_specs):
        if vid not in w.param_ids:
            continue
        shape = w.graph.values[vid].shape
        finest = max(lean.mesh.shards(s) for s in enumerate_specs(shape, lean.mesh))
        assert lean.mesh.shards(l_spec) == finest, (shape, l_spec)
        held["fast"] += w.value_bytes(vid) / fast.mesh.shards(f_spec)
        held["lean"] += w.value_bytes(vid) / lean.mesh.shards(l_spec)
    assert held["lean"] < held["fast"], held


def test_memory_priced_layer_solves_sit_between_the_two_ends(toy_pricer):
    """The memory-priced solves (`start_price_stage(memory_price=...)`, the levels a stage
    tries between time-optimal and lean): a higher price keeps no more parameter bytes
    per device, and the time reported is the layout's own, the price taken off (a zero
    price reproduces the time-optimal solve)."""
    from autopar.pipeline_search import price_stage

    w = toy_pricer.workload(2)
    kw = dict(solver="auto", time_limit_s=10, batch_size=w.micro_batch, shapes=[(2, 2)],
              remat=w.split.remat, num_micro_batches=2)
    args = (w.graph, w.layers[1], w.diff, toy_pricer.cluster, (1, 4))

    def held(p) -> float:
        return sum(w.value_bytes(v) / p.mesh.shards(spec)
                   for v, spec in zip(w.layers[1].inputs, p.input_specs) if v in w.param_ids)

    fast = price_stage(*args, **kw)[(2, 2)]
    lean = price_stage(*args, lean=True, **kw)[(2, 2)]
    bandwidth = toy_pricer.cluster.memory_bandwidth_bytes_per_s
    # Prices from negligible to far above any layer time per byte held.
    priced = [price_stage(*args, memory_price=f / bandwidth, **kw)[(2, 2)]
              for f in (1e-9, 1e3, 1e9)]
    assert priced[0].cost_s == pytest.approx(fast.cost_s, rel=1e-6)
    assert held(priced[0]) == held(fast)
    amounts = [held(p) for p in priced]
    assert amounts == sorted(amounts, reverse=True), amounts
    assert amounts[-1] == pytest.approx(held(lean)) and amounts[-1] < held(fast)
    for p in priced:
        assert fast.cost_s * (1 - 1e-9) <= p.cost_s


def test_knee_price_is_the_median_rate_of_time_for_bytes():
    """The memory-priced levels' prices come from the layers' own trade-off: the median
    over (time-optimal, lean) solution pairs of the seconds the lean one adds per byte it
    saves; pairs that trade nothing (lean no slower, or no smaller) do not count."""
    from autopar.pipeline_search import knee_price

    pairs = [(1.0, 100.0, 2.0, 50.0),    # 1 s for 50 B: 0.02 s/B
             (1.0, 100.0, 1.5, 0.0),     # 0.005 s/B
             (1.0, 100.0, 5.0, 20.0),    # 0.05 s/B
             (1.0, 100.0, 1.0, 10.0),    # lean no slower: no trade
             (1.0, 10.0, 3.0, 10.0)]     # lean no smaller: no trade
    assert knee_price(pairs) == pytest.approx(0.02)
    assert knee_price(pairs[3:]) is None and knee_price([]) is None


def test_fixed_3d_layout_splits_the_batch_over_dp_only():
    """A (dp, tp) stage of Manual3DParallel (`forced_batch_axis`): no value of the layer's
    forward+backward splits its batch dim over the tp axis, so tp is tensor parallelism.
    Left free, a GPT-350M layer on 4 V100s is data parallel over both axes; with only the
    stage's inputs held to dp, its activations were still resharded onto dp x tp inside."""
    from autopar.layer import LayerProgram
    from autopar.pipeline_search import LEAN_PENALTY_S, price_stage

    cluster = ClusterSpec.preset("8xV100-16GB").with_devices(1, 4)
    w = layouts.Pricer("gpt-350m", 32, cluster).workload(2)
    kw = dict(solver="auto", time_limit_s=10, batch_size=w.micro_batch, shapes=[(2, 2)],
              remat=w.split.remat, num_micro_batches=2)
    args = (w.graph, w.layers[1], w.diff, cluster, (1, 4))
    fb = LayerProgram.build(w.graph, w.layers[1], w.diff, remat=w.split.remat).fb

    def batch_split_over_tp(priced) -> int:
        return sum(1 for vid, spec in priced.value_specs
                   if fb.values[vid].shape[:1] == (w.micro_batch,) and "y" in spec[0])

    free = price_stage(*args, **kw)[(2, 2)]
    fixed = price_stage(*args, forced_batch_axis=True, **kw)[(2, 2)]
    assert batch_split_over_tp(free) > 0
    assert batch_split_over_tp(fixed) == 0
    assert free.cost_s <= fixed.cost_s < LEAN_PENALTY_S


def test_best_fitting_takes_the_fastest_layout_that_fits(toy_pricer):
    cands = [layouts.Layout("3d", dp, tp, pp, b, "tensor")
             for dp, tp, pp in [(4, 1, 1), (2, 2, 1), (1, 2, 2)] for b in (2, 4)]
    best, evals = layouts.best_fitting(toy_pricer, cands)
    assert best is not None and not best.oom
    assert best.step_s == min(e.step_s for e in evals if not e.oom)
    assert all(e.step_s > 0 and e.memory_bytes > 0 for e in evals)
    # A device too small for anything: nothing fits.
    tiny = layouts.Pricer("gpt-toy", 16, dataclasses.replace(
        toy_pricer.cluster, memory_bytes=1e3))
    tiny._cache = toy_pricer._cache
    none, evals = layouts.best_fitting(tiny, cands[:2])
    assert none is None and all(e.oom for e in evals)


def test_zero_state_is_split_over_dp(toy_pricer):
    dp = toy_pricer.evaluate(layouts.Layout("dp", 4, 1, 1, 2, "replicated"))
    z2 = toy_pricer.evaluate(layouts.Layout("zero2", 4, 1, 1, 2, "replicated",
                                            zero_state=True, zero_gather=True))
    assert z2.memory_bytes < dp.memory_bytes
    assert z2.step_s > dp.step_s  # the parameter all-gather after the update


def test_a_plans_update_is_priced_as_it_holds_its_state(toy_pricer):
    """The suite prices autopar's update from the plan's own parameter and state layouts:
    every state split over dp costs what ZeRO-2 costs (update of 1/dp, each parameter
    gathered back, the gathers' latency shared as XLA:GPU combines them), none split what
    data parallelism costs."""
    from autopar.passes.sharding_spec import state_split

    w = toy_pricer.workload(2)
    stages = [((0, len(w.layers) - 1), (4, 1))]
    z2 = toy_pricer.evaluate(layouts.Layout("zero2", 4, 1, 1, 2, "replicated",
                                            zero_state=True, zero_gather=True), stages)
    dp = toy_pricer.evaluate(layouts.Layout("dp", 4, 1, 1, 2, "replicated"), stages)
    specs = {}
    for k in range(len(w.layers)):
        p = toy_pricer.layer(w, k, (4, 1), "replicated")
        for vid, spec in zip(w.layers[k].inputs, p.input_specs):
            if vid in w.param_ids:
                specs.setdefault(vid, spec)
    mesh = toy_pricer.layer(w, 0, (4, 1), "replicated").mesh
    split = {v: state_split(spec, w.graph.values[v].shape, mesh) for v, spec in specs.items()}
    auto = layouts.Layout("autopar", 0, 0, 1, 2, "replicated")
    held_z2 = toy_pricer.evaluate(auto, stages, held=[(specs, split)])
    held_dp = toy_pricer.evaluate(auto, stages, held=[(specs, {})])
    assert held_z2.stages[0].update_s == pytest.approx(z2.stages[0].update_s, rel=1e-9)
    assert held_dp.stages[0].update_s == pytest.approx(dp.stages[0].update_s, rel=1e-9)
    assert z2.stages[0].update_s > dp.stages[0].update_s


def test_suite_writes_markdown_json_and_chart(tmp_path, monkeypatch):
    monkeypatch.setitem(suite.SUITES, "tiny", suite.Suite(16, ((1, "gpt-toy"), (2, "gpt-toy"))))
    result = suite.run("tiny", "8xA100-80GB", out_dir=tmp_path)
    stem = tmp_path / "tiny-8xA100-80GB"
    data = json.loads(stem.with_suffix(".json").read_text())
    assert [r["devices"] for r in data["rows"]] == [1, 2]
    text = stem.with_suffix(".md").read_text()
    assert data["meta"]["commit"] and data["meta"]["command"]
    for row in result["rows"]:
        assert set(row["strategies"]) == set(suite.STRATEGIES)
        # autopar's row is its plan's own prediction: where that is slower than the best
        # baseline, the page says so with both figures.
        assert row["ratio"] is not None and row["ratio"] <= 1.01
        if suite.loses(row["ratio"]):
            assert f"- {row['devices']} x gpt-toy: autopar " in text
        assert row["strategies"]["autopar"]["phases_s"]
        assert row["strategies"]["alpa"]["note"].startswith("Alpa published no plan")
    assert "| 2 | gpt-toy |" in text and "autopar / Alpa's plan" in text
    # The 3-D grid tries the optimizer state whole and split over dp (2 x 1 x 1 and 1 x 1 x 2
    # whole, 2 x 1 x 1 split), each at every micro-batch count down to the first that loses.
    threed = result["rows"][1]["strategies"]["3d"]
    assert threed["tried"] >= 3
    assert stem.with_suffix(".png").stat().st_size > 1000

    # benchmarks.explain re-plans the layout autopar loses to with the planner itself; a
    # row made to lose (autopar's time doubled) is a search miss by the planner's own model.
    row = data["rows"][1]
    row["strategies"]["autopar"]["step_s"] = 2 * row["best_baseline_s"]
    row["ratio"] = 2.0
    stem.with_suffix(".json").write_text(json.dumps(data))
    explained = explain.run(stem.with_suffix(".json"))
    view = explained["rows"][1]["planner_view"]
    first = explained["rows"][0]
    assert ("planner_view" in first) == suite.loses(first["ratio"])
    if "planner_view" in first:
        assert first["planner_view"]["verdict"] in explain.VERDICTS
    assert view["verdict"] == "search miss", view
    assert view["budgeted"]["step_s"] < 2 * row["best_baseline_s"]
    assert view["method"].startswith("Manual3DParallel(")
    assert "Why: autopar's planner prices this layout" in stem.with_suffix(".md").read_text()
    assert json.loads(stem.with_suffix(".json").read_text())["explain_meta"]["commit"]
    assert "Why-notes (`benchmarks.explain`" in stem.with_suffix(".md").read_text()


def test_explain_maps_hand_written_rows_to_manual_3d():
    three = {"dp": 2, "tp": 8, "pp": 4, "micro": 128, "zero_state": True, "params": "tensor"}
    m = explain.manual_method(three)
    assert (m.dp, m.tp, m.pp, m.num_micro_batches, m.shard_optimizer_state) == (2, 8, 4, 128,
                                                                                 True)
    assert not explain.manual_method(dict(three, zero_state=False)).shard_optimizer_state
    assert explain.manual_method(dict(three, params="zero3")) is None
    assert not suite.loses(1.0000005) and suite.loses(1.001) and not suite.loses(None)
    fits, over = {"step_s": 9.0}, {"step_s": None}
    assert explain.verdict(10.0, fits, fits) == "search miss"
    assert explain.verdict(10.0, {"step_s": 12.0}, fits) == "over memory"
    assert explain.verdict(10.0, over, fits) == "over memory"
    assert explain.verdict(10.0, {"step_s": 12.0}, {"step_s": 11.0}) == "slower in the planner"


def test_suite_says_when_no_plan_can_fit():
    """MoE-70B on 64 V100-16GB: 70.4e9 float32 parameters, their gradients and AdamW's two
    moments need 16.4 GiB per device even split over all 64, over the 16 GiB of one."""
    cluster = ClusterSpec.preset("8x8xV100-16GB")
    row = {"devices": 64, "model": "moe-70b", "strategies": {}, "ratio": None,
           "state_bytes_per_device_min": 70.4e9 * 4 * 4 / 64}
    md = suite.markdown("moe", cluster, [row], 1.0)
    assert "moe-70b on 64 devices: no plan can fit" in md and "16.4 GiB per device" in md
    row["state_bytes_per_device_min"] = 12e9 / 64
    assert "no plan can fit" not in suite.markdown("moe", cluster, [row], 1.0)


def test_suite_audit_rows_say_which_xla_cpu_scheduler_compiled_them():
    cluster = ClusterSpec.preset("8x8xV100-16GB")
    audit = {"collective_bytes": {"all-reduce": 2**20}, "compiled_memory_bytes": 3 * 2**30,
             "compile_s": 1.0}
    row = {"devices": 1, "model": "gpt-350m", "ratio": 1.0,
           "strategies": {"autopar": {"memory_bytes": 2 * 2**30}}, "audit": dict(audit)}
    md = suite.markdown("gpt", cluster, [row], 1.0)
    assert "| 1 | gpt-350m | all-reduce 1.0 MiB | 3.00 GiB | 2.00 GiB | 1.0 |" in md
    assert "default (concurrency-optimized) scheduler" in md  # audits from before the flag
    row["audit"]["xla_flags"] = ("--xla_force_host_platform_device_count=8 "
                                 "--xla_cpu_enable_concurrency_optimized_scheduler=false")
    assert "XLA:CPU scheduled for memory" in suite.markdown("gpt", cluster, [row], 1.0)


def test_suite_rejects_unknown_suite():
    with pytest.raises(ValueError, match="unknown suite 'bert'"):
        suite.run("bert", "8xA100-80GB")


def test_toy_runs_match_the_single_device_step():
    rows = toy.run_model("gpt-toy", strategies=("megatron", "3d"))
    assert [r["strategy"] for r in rows] == ["megatron", "3d"]
    for r in rows:
        assert r["equal"], r["reason"]
        # Equal includes the movement check: a dropped update would be seen
        # (tests/test_toy_suite.py shows one that is).
        assert r["min_move_over_tol"] >= toy.MIN_MOVE_OVER_TOL
        assert r["collective_bytes"] or r["stages"] > 1
        assert r["memory_bytes"] > 0


def test_workload_names_and_layers():
    w = Workload.build("moe-toy", 16, 4)
    assert w.micro_batch == 4 and len(w.layers) >= 2
    assert any("wi" in w.names[v] for v in w.param_ids)
    assert w.state_bytes_per_param_byte == pytest.approx(2.0, rel=1e-3)
    with pytest.raises(ValueError, match="not divisible into 3 micro-batches"):
        Workload.build("moe-toy", 16, 3)
