"""Rematerialization chosen by the pipeline search (issue 47): where a stage's time-optimal
layouts do not fit its memory with the micro-batches in flight, the search rematerializes
some of its layers (`PipeshardParallel(remat="auto")`, the default), the plan records which
(`LayerPlan.remat`), and the runtime runs exactly those layers under `jax.checkpoint`:
the same numbers as the micro-batched `jax.jit` step, each stage's compiled memory within
25% of the planner's and under the budget."""

from __future__ import annotations

import json

import numpy as np
import pytest

import autopar
from autopar.passes.inter_op import NoStageLayoutError
from autopar.passes.intra_op import MemoryBudgetError
from autopar.pipeline_search.stage_costs import _least
from autopar.plan import LayerPlan, Plan, StagePlan

from helpers import assert_same_micro_batched_run
from models import convbn_case, gpt_case, moe_case, remat_dropout_case

MICRO = 4
TIME_LIMIT_S = 5.0
# Fraction of the unconstrained plan's largest stage (bytes per device) given as budget: the
# time-optimal layouts then do not fit and some layers must be rematerialized or laid out
# leaner.
BUDGET_FRACTION = 0.85
# Compiled peak of each stage against the planner's prediction (the bound).
MEMORY_RTOL = 0.25
TOL = dict(rtol=2e-4, atol=2e-5)


def _step(case, **kw):
    method = autopar.PipeshardParallel(num_micro_batches=MICRO, time_limit_s=TIME_LIMIT_S,
                                       layer_num=4, **kw)
    return autopar.parallelize(case.step, donate_argnums=(), method=method)


def _remat_flags(plan: Plan) -> list[list[bool]]:
    return [[lp.remat for lp in st.layer_plans] for st in plan.stages]


@pytest.mark.parametrize("name, make, kw, compare", [
    # one stage: GPipe keeps every micro-batch's residuals until the backward
    pytest.param("gpt-1-stage", lambda: gpt_case(optimizer="adamw", batch=32, seq=32),
                 dict(num_stages=1, schedule="gpipe"), False, id="gpt-1-stage"),
    # 1F1B: the first stage keeps as many micro-batches in flight as there are stages
    pytest.param("gpt-2-stages", lambda: gpt_case(optimizer="adamw", batch=32, seq=32),
                 dict(num_stages=2), True, id="gpt-2-stages"),
    pytest.param("convbn-2-stages", lambda: convbn_case(optimizer="adamw", batch=64, size=16),
                 dict(num_stages=2, schedule="gpipe"), False,
                 id="convbn-2-stages"),
    pytest.param("moe-4-stages", lambda: moe_case(optimizer="adamw", batch=32, seq=16),
                 dict(num_stages=4), False, id="moe-4-stages"),
])
def test_search_rematerializes_where_memory_binds(name, make, kw, compare):
    case = make()
    state, batch = case.init()
    free = _step(case, **kw).get_plan(state, batch)
    assert not any(f for flags in _remat_flags(free) for f in flags), free.summary()
    budget = BUDGET_FRACTION * max(st.memory_bytes for st in free.stages)

    step = _step(case, memory_budget_bytes=budget, **kw)
    plan = step.get_plan(state, batch)
    flags = [f for stage in _remat_flags(plan) for f in stage]
    assert any(flags), plan.summary()
    assert "rematerializes" in plan.summary()
    assert max(st.memory_bytes for st in plan.stages) <= budget
    # on the same stages and sub-meshes a budget only takes options away: the free plan is
    # not the slower one (the stages' logical meshes are chosen together,
    # `pipeline_search.assemble._assemble`).  Where the budget moves the stages the stage DP's
    # choice, priced without layouts, may differ the other way (MoE, 4 stages).
    if [(st.layers, len(st.device_ids)) for st in free.stages] == [
            (st.layers, len(st.device_ids)) for st in plan.stages]:
        assert free.predicted.step_s <= plan.predicted.step_s, (free.summary(), plan.summary())
    # each stage's compiled peak near the planner's (a stage of a few bytes: within 1 KiB),
    # and under the budget
    compiled = step.lower(state, batch).compile().stage_memory_bytes()
    for st, got in zip(plan.stages, compiled):
        assert got <= budget, (name, got, budget)
        np.testing.assert_allclose(got, st.memory_bytes, rtol=MEMORY_RTOL, atol=1024,
                                   err_msg=f"{name}: stage {st.layers} compiled vs planned")
    # the plan file keeps each layer's choice
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert _remat_flags(again) == _remat_flags(plan)
    assert_same_micro_batched_run(case, step, MICRO, **TOL)
    if not compare:
        return
    # without rematerialization the budget holds only with slower layouts, or not at all
    try:
        lean = _step(case, memory_budget_bytes=budget, remat=False, **kw).get_plan(state, batch)
    except (NoStageLayoutError, MemoryBudgetError):
        return
    assert plan.predicted.step_s < lean.predicted.step_s, (plan.summary(), lean.summary())


def test_the_steps_own_remat_is_kept_on_every_layer():
    """A step written with `nn.remat` rematerializes every layer whatever `remat` says (the
    flattened step no longer shows which layers it wrapped): never undone."""
    case = remat_dropout_case()
    state, batch = case.init()
    step = _step(case, num_stages=2, remat=False)
    plan = step.get_plan(state, batch)
    assert all(f for stage in _remat_flags(plan) for f in stage), plan.summary()


def test_hand_written_plan_rematerializes_every_layer():
    case = gpt_case(optimizer="adamw")
    state, _ = case.init()
    method = autopar.Manual3DParallel(dp=2, tp=2, pp=2, num_micro_batches=2, remat=True,
                                      time_limit_s=TIME_LIMIT_S)
    step = autopar.parallelize(case.step, donate_argnums=(), method=method)
    plan = step.get_plan(state, case.batch_for_step(0))
    assert all(f for stage in _remat_flags(plan) for f in stage), plan.summary()
    assert_same_micro_batched_run(case, step, 2, **TOL)


def test_remat_policy_is_checked():
    with pytest.raises(ValueError, match="remat"):
        autopar.PipeshardParallel(remat="some")
    with pytest.raises(ValueError, match="remat"):
        autopar.Manual3DParallel(remat="auto")


def test_layer_plan_json_keeps_the_choice():
    layers = tuple(LayerPlan(eqn_range=(k, k + 1), value_specs=((0, ((),)),), operand_specs=(),
                             num_values=1, predicted_s=1e-3, remat=k == 1) for k in range(3))
    stage = StagePlan(layers=(0, 2), eqn_range=(0, 3), device_ids=(0,), mesh_shape=(1,),
                      mesh_axes=("x",), input_specs=(), predicted_s=3e-3, memory_bytes=1.0,
                      layer_plans=layers)
    solutions: dict[str, int] = {}
    d = json.loads(json.dumps(stage.to_json(solutions)))
    # layers not rematerialized write nothing (plans from before the choice read the same)
    assert ["remat" in lp for lp in d["layer_plans"]] == [False, True, False]
    back = StagePlan.from_json(d, [json.loads(k) for k in solutions])
    assert [lp.remat for lp in back.layer_plans] == [False, True, False]


@pytest.mark.parametrize("fits, count, want", [
    (lambda r: r >= 3, 5, 3), (lambda r: True, 4, 1), (lambda r: False, 4, None),
    (lambda r: r >= 7, 7, 7), (lambda r: True, 0, None)])
def test_least_bisects(fits, count, want):
    asked = []

    def ok(r):
        asked.append(r)
        return fits(r)

    assert _least(count, ok) == want
    assert len(asked) <= 1 + max(1, count).bit_length()


def test_the_policy_is_part_of_the_plan_cache_key():
    """A plan searched under one policy is never served for another."""
    from autopar.plan_cache import method_fields

    assert method_fields(autopar.PipeshardParallel(remat=False)) != method_fields(
        autopar.PipeshardParallel())


def test_benchmark_page_states_the_ratio_and_the_missing_cases():
    from benchmarks import remat_search

    def ev(step_s, **kw):
        return {"step_s": step_s, "memory_bytes": 2**30, "oom": False, "strategy": "3d",
                "dp": 2, "tp": 2, "pp": 2, "micro": 8, **kw}

    row = {"devices": 8, "model": "gpt-2.6b", "ratio": 0.9, "best_hand_s": 10.0,
           "rows": {"3d-remat-on": ev(10.0), "3d-remat-off": ev(12.0, oom=True),
                    "autopar": ev(9.0, strategy="autopar", remat_layers=3,
                                  plan_layers=8)}}
    page = remat_search.markdown({
        "meta": {"commit": "abc"}, "cluster": "8x8xV100-16GB", "global_batch": 1024,
        "workload_source": "alpa", "wall_s": 1.0, "rows": [row],
        "cases": ["8:gpt-2.6b", "64:gpt-39b"]})
    assert "| 8 | gpt-2.6b | 10.00 s" in page and "**OOM**" in page
    assert "3 of 8 layers remat" in page and "| 0.900 |" in page
    assert "strictly faster on 1" in page
    assert "Not run (the run stopped first): 64:gpt-39b." in page
