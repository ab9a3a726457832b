"""`num_micro_batches="auto"` (autopar.micro_batches) gives the count trying every count
gives, without trying every one: the bounded search over synthetic landscapes, the stage-cost
bound against real searches of a small GPT, and auto's plan against the best explicit one."""

from __future__ import annotations

import dataclasses

import generated
import pytest

import autopar
from autopar import micro_batches, models, pipeline_search, plan_cache

COUNTS = [2 ** k for k in range(11)]


def _run(values: dict[int, float | None], slack: float) -> tuple[int | None, list[int]]:
    """`bounded` over `values` (count -> seconds, None: does not fit) with a bound that is
    the value of a count times `slack` once a count at or below it has been evaluated."""
    seen: list[int] = []

    def evaluate(count: int) -> float | None:
        seen.append(count)
        return values[count]

    def bound(count: int) -> float | None:
        if not any(c <= count for c in seen) or values[count] is None:
            return None
        return values[count] * slack

    return micro_batches.bounded(list(values), evaluate, bound), seen


GPT_39B = dict(zip(COUNTS, [132.69, 133.70, 135.0, 150.0, 198.83, 173.38, 189.63, 183.39,
                            170.0, 168.0, 165.24]))


@pytest.mark.parametrize("landscape", [
    # GPT-15B on 32 V100s (suite, 2026-11-24): fewer micro-batches fit only memory-lean.
    {c: (None if c < 16 else {16: 4686.0, 32: 5422.0}.get(c, 100.0 + abs(c - 256) / 8))
     for c in COUNTS},
    # GPT-15B with the ZeRO-2 gathers priced: a bump at 128 between 64 and 256.
    {c: (None if c < 16 else {32: 982.7, 64: 122.92, 128: 123.33, 256: 119.5, 512: 121.0,
                              1024: 125.0}.get(c, 4642.0)) for c in COUNTS},
    # wrn-6.8b on 32 H100s (suite, 2026-11-25): two valleys, one stage at 2, a pipeline at 128.
    dict(zip(COUNTS, [7.965, 7.947, 7.955, 7.97, 8.002, 8.021, 7.983, 7.967, 8.371, 8.768,
                      9.5])),
    GPT_39B,
    {1: 2.0, 2: 1.0, 4: 1.0, 8: 3.0},  # a tie: the smaller count
    {c: None for c in COUNTS},
])
def test_bounded_finds_the_exhaustive_answer(landscape):
    fit = [(v, k) for k, v in enumerate(landscape.values()) if v is not None]
    for slack in (0.0, 0.9, 1.0):  # no bound, a loose one, the exact value
        got, seen = _run(landscape, slack)
        assert got == (min(fit)[1] if fit else None)
        assert len(seen) == len(set(seen))
    assert _run(GPT_39B, 1.0)[1] == [1]  # every larger count bounded out


def test_bounded_bisects_for_the_memory_floor():
    landscape = {c: (None if c < 256 else 1.0 + c / 1024) for c in COUNTS}
    got, seen = _run(landscape, 1.0)
    assert COUNTS[got] == 256
    assert seen == [1, 64, 512, 256, 128]  # fewest first, then bisection; 1024 bounded out


def test_auto_on_a_small_gpt_is_the_best_explicit_count(tmp_path, monkeypatch):
    """gpt-toy on 4 V100s: auto's plan is the fastest of every explicit count's (those auto
    searched come from the plan cache it filled, the others are searched here), and every
    searched count's stage costs bound every larger count's plan from below."""
    monkeypatch.setenv(plan_cache.ENV_VAR, str(tmp_path))
    step, args = models.train_step_and_args("gpt-toy", 8)
    cluster = autopar.ClusterSpec.preset("2x8xV100-16GB").with_devices(1, 4)
    with pipeline_search.recording():
        auto = autopar.plan(step, *args, cluster=cluster,
                            method=autopar.PipeshardParallel(num_micro_batches="auto"))
        plans = {count: autopar.plan(step, *args, cluster=cluster,
                                     method=autopar.PipeshardParallel(num_micro_batches=count))
                 for count in micro_batches.ladder(8)}
    tried = [t["num_micro_batches"] for t in auto.solver["micro_batch_tries"]]
    bounded = [t["num_micro_batches"] for t in auto.solver["micro_batch_bounded"]]
    # each try's seconds: its trace at that micro-batch size, then its search
    assert all(0.0 < t["trace_s"] < t["search_s"] for t in auto.solver["micro_batch_tries"])
    assert "trace " in autopar.report.summary(auto)
    assert bounded and sorted(tried + bounded) == list(plans)
    best = min(plans, key=lambda c: (plans[c].predicted.step_s, c))
    assert dataclasses.replace(auto, solver={}) == dataclasses.replace(plans[best], solver={})
    assert "stage_costs" not in auto.solver
    tables = {c: pipeline_search.StageCostTable.from_json(p.solver["stage_costs"])
              for c, p in plans.items()}
    for b, table in tables.items():
        assert table.num_micro_batches == b
        assert table.step_s == _layered_s(plans[b])
        assert table.fixed_s and all(0.0 < table.fixed_s[k] <= c
                                     for k, c in table.least_s.items() if c is not None)
        unfixed = dataclasses.replace(table, fixed_s={})
        for count, plan in plans.items():
            bound = micro_batches.lower_bound_s([table], count)
            assert (bound is None) == (count < b)
            assert bound is None or bound <= _layered_s(plan) * (1 + 1e-9)
            # the fixed part kept whole only tightens the bound
            loose = micro_batches.lower_bound_s([unfixed], count)
            assert bound is None or bound >= loose * (1 - 1e-12)
    for count, plan in plans.items():
        # every table at once: each range's largest floor
        every = micro_batches.lower_bound_s(list(tables.values()), count)
        alone = [micro_batches.lower_bound_s([t], count) for t in tables.values()]
        assert every <= _layered_s(plan) * (1 + 1e-9)
        assert every >= max(a for a in alone if a is not None) * (1 - 1e-12)


def test_lower_bound_keeps_the_fixed_part_whole():
    """One layer on one device: 10 s per micro-batch at 2 micro-batches, 4 s of it fixed;
    at 8 micro-batches a step takes at least 8 x (4 + 6 x 2/8) s, and two tables give each
    range the larger of their floors."""
    table = pipeline_search.StageCostTable(2, 1, 1, ((1, 1),), None, {(0, 0, (1, 1)): 10.0},
                                            20.0, {(0, 0, (1, 1)): 4.0})
    assert micro_batches.lower_bound_s([table], 8) == pytest.approx(8 * (4.0 + 6.0 / 4))
    assert micro_batches.lower_bound_s([dataclasses.replace(table, fixed_s={})], 8) \
        == pytest.approx(8 * 10.0 / 4)
    assert micro_batches.lower_bound_s([table], 1) is None
    other = dataclasses.replace(table, num_micro_batches=4, least_s={(0, 0, (1, 1)): 6.0},
                                fixed_s={})
    assert micro_batches.lower_bound_s([table, other], 8) == pytest.approx(8 * 5.5)
    assert pipeline_search.StageCostTable.from_json(table.to_json()) == table


def test_count_free_values_are_the_parameters_own_work():
    """What elementwise equations and transposes make of the parameters alone keeps its
    shape at any micro-batch count; a broadcast to the batch, or anything reading the
    batch, does not."""
    import jax
    import jax.numpy as jnp

    from autopar.graph import Graph

    def f(w, b, x):
        w16 = w.astype(jnp.float16).T
        return x @ w16, x + jnp.broadcast_to(b * 2.0, x.shape), w16 * 3.0

    fb = Graph.from_jaxpr(jax.make_jaxpr(f)(jnp.zeros((4, 8)), jnp.zeros((8,)),
                                            jnp.zeros((2, 8), jnp.float16)))
    w, b, x = fb.invars
    free = pipeline_search.layer_cost._count_free(fb, {w, b})
    made = [(e.name, e.outputs[0]) for e in fb.eqns]
    # w16 (cast, transpose), b * 2 and w16 * 3; not the dot, the broadcast, x's cast, the sum
    assert [name for name, v in made if v in free] == ["convert_element_type", "transpose",
                                                      "mul", "mul"]
    assert x not in free and {w, b} <= free
    assert pipeline_search.layer_cost._count_free(fb, set()) == set()


def test_a_pipeline_over_several_hosts_receives_from_another_host_somewhere():
    """Two hosts of two devices: two stages of (1, 2) are on different hosts, so the second
    takes its cross-host time (5 s, not 2 s): 2 + 5 + 3 x 5 s at 4 micro-batches, against
    4 x 10 s for one stage over both hosts; a parameter the two stages share adds its
    moves once."""
    least = {(0, 1, (2, 2)): 10.0, (0, 0, (1, 2)): 2.0, (1, 1, (1, 2)): 2.0}
    table = pipeline_search.StageCostTable(4, 2, 4, ((1, 1), (1, 2), (2, 2)), None, least,
                                            22.0, {}, {(1, 1, (1, 2)): 5.0})
    assert micro_batches.lower_bound_s([table], 4) == pytest.approx(22.0)
    assert micro_batches.lower_bound_s([dataclasses.replace(table, cross_s={})], 4) \
        == pytest.approx(10.0)
    assert micro_batches.lower_bound_s([dataclasses.replace(
        table, least_s={**least, (0, 1, (2, 2)): 5.0})], 4) == pytest.approx(20.0)
    # moving a tied parameter to the last stage and its gradient back: once per step
    assert micro_batches.lower_bound_s([dataclasses.replace(
        table, tied_s={(1, 2): 1.5})], 4) == pytest.approx(23.5)


def _layered_s(plan: autopar.Plan) -> float:
    """The step of `plan`'s layer solutions, which the tables bound: before the assembly
    solved a stage's layers as one program (`SearchReport.layered_step_s`), which only
    lowers it."""
    layered = pipeline_search.layered_step_s(plan)
    assert layered >= plan.predicted.step_s
    return layered


def _plans_and_tables(batch: int, cluster: autopar.ClusterSpec, overrides=None
                      ) -> tuple[dict[int, autopar.Plan], list[pipeline_search.StageCostTable]]:
    """gpt-toy's plan at every count of `micro_batches.ladder(batch)`, and their tables."""
    step, args = models.train_step_and_args("gpt-toy", batch, overrides=overrides)
    with pipeline_search.recording():
        plans = {count: autopar.plan(step, *args, cluster=cluster,
                                     method=autopar.PipeshardParallel(num_micro_batches=count))
                 for count in micro_batches.ladder(batch)}
    return plans, _tables(plans)


def _tables(plans: dict[int, autopar.Plan]) -> list[pipeline_search.StageCostTable]:
    """The stage cost table each plan recorded (`pipeline_search.recording`)."""
    return [pipeline_search.StageCostTable.from_json(p.solver["stage_costs"])
            for p in plans.values()]


def _assert_every_bound_below(plans: dict[int, autopar.Plan],
                              tables: list[pipeline_search.StageCostTable]) -> None:
    """Every table bounds every count of `plans` at or below that count's plan."""
    for table in tables:
        for count, plan in plans.items():
            bound = micro_batches.lower_bound_s([table], count)
            assert bound is None or bound <= _layered_s(plan) * (1 + 1e-9), \
                (table.num_micro_batches, count, bound, _layered_s(plan))


def test_every_bound_is_below_the_searched_plans_in_float16(tmp_path, monkeypatch):
    """float16 gpt-toy on 4 V100s: with 2 rows per micro-batch (4 micro-batches) the layers'
    own layouts disagree at every boundary, and a stage that only aligned each layer to both
    neighbours' own layouts cost 3x B=8's per row (0.127 ms a step against B=8's 0.088 ms),
    above the bound B=4's table gives B=8; the layers that follow what the layer before
    made (`pipeline_search.AFTER_NONE`) keep it below every larger count's plan."""
    monkeypatch.setenv(plan_cache.ENV_VAR, str(tmp_path))
    cluster = autopar.ClusterSpec.preset("2x8xV100-16GB").with_devices(1, 4)
    _assert_every_bound_below(*_plans_and_tables(8, cluster, {"dtype": "float16"}))


def test_every_bound_is_below_the_searched_plans_of_a_tied_embedding(tmp_path, monkeypatch):
    """generated tied_embed-4 on 8 CPU devices (cpu-local), 32 rows: at 8 and 16
    micro-batches neither aligning each layer to its neighbours' own layouts nor to what it
    receives only found a fast stage (16 micro-batches planned 8 stages at 31.8 ms a step,
    32 plan one at 3.35 ms, and the 8 and 16 tables bounded 32 above it); aligning the
    boundaries replicated (`pipeline_search.AFTER_WHOLE`) plans 16 at 2.31 ms, and every
    table bounds every larger count below its plan."""
    monkeypatch.setenv(plan_cache.ENV_VAR, str(tmp_path))
    case = generated.generate(4, family="tied_embed")
    state, batch = case.init(), case.batch(0)
    with pipeline_search.recording():
        plans = {count: autopar.parallelize(case.step, method=autopar.PipeshardParallel(
                     num_micro_batches=count, time_limit_s=5.0)).get_plan(state, batch)
                 for count in (8, 16, 32)}
    _assert_every_bound_below(plans, _tables(plans))
    assert plans[16].predicted.step_s < plans[32].predicted.step_s


def test_every_bound_is_below_the_searched_plans_on_several_hosts(tmp_path, monkeypatch):
    """gpt-toy on 4 hosts of 2 V100s: every count's stage costs bound every count at or
    above it below its searched plan, the cross-host floors and the tied embedding's moves
    included (and never below the bound without them)."""
    monkeypatch.setenv(plan_cache.ENV_VAR, str(tmp_path))
    cluster = autopar.ClusterSpec.preset("8x8xV100-16GB").with_devices(4, 2)
    plans, tables = _plans_and_tables(16, cluster)
    assert all(t.cross_s and t.tied_s for t in tables)
    for table in tables:
        plain = dataclasses.replace(table, cross_s={}, tied_s={})
        for count, plan in plans.items():
            bound = micro_batches.lower_bound_s([table], count)
            assert (bound is None) == (count < table.num_micro_batches)
            if bound is not None:
                assert bound <= _layered_s(plan) * (1 + 1e-9)
                assert bound >= micro_batches.lower_bound_s([plain], count) * (1 - 1e-12)
