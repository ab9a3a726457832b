"""A pipeline stage's layers solved as one program (`pipeline_search.StageCosts.
joint_alternatives`): where each layer's own ILP chose its half of a boundary and the stage
pays for the mismatch (a GShard MoE's expert dispatch, an attention block's heads), one ILP
over the stage's equations sees the values the layers share.  The assembly keeps it only
where the step gets faster, records the plan of layer solutions' step, and the runtime runs
the one solution over the stage's equations and gives `jax.jit`'s numbers."""

from __future__ import annotations

import generated
import numpy as np
import pytest

import autopar
from autopar import pipeline_search


def _plan(case: generated.Case, stages: int) -> autopar.Plan:
    method = autopar.PipeshardParallel(num_micro_batches=generated.MICRO_BATCHES,
                                       num_stages=stages, time_limit_s=5.0)
    return autopar.parallelize(case.step, method=method).get_plan(case.init(), case.batch(0))


def test_a_stage_of_disagreeing_layers_is_solved_as_one_program(monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", "")     # both plans searched, none cached
    case = generated.generate(3, family="moe")
    plan = _plan(case, 1)
    (stage,) = plan.stages
    assert stage.layers[1] > stage.layers[0]        # several layers ...
    assert [lp.eqn_range for lp in stage.layer_plans] == [stage.eqn_range]  # ... one solution
    # measured 0.53 of the plan of layer solutions (cpu-local, 8 devices)
    assert plan.predicted.step_s < 0.8 * plan.solver["layered_step_s"]
    assert plan.predicted.memory_bytes == stage.memory_bytes
    assert "stage 0 solved as one program each (the layers' own solutions: " \
        f"{plan.solver['layered_step_s'] * 1e3:.3f} ms per step)" in autopar.report.summary(plan)

    # Without joint solves: the plan of layer solutions, one solution per layer, at the
    # step the joint plan recorded for it.
    monkeypatch.setattr(pipeline_search.stage_costs, "JOINT_MAX_EQNS", 0)
    layered = _plan(case, 1)
    assert "layered_step_s" not in layered.solver
    assert layered.predicted.step_s == pytest.approx(plan.solver["layered_step_s"], rel=1e-9)
    (kept,) = layered.stages
    assert len(kept.layer_plans) == kept.layers[1] - kept.layers[0] + 1
    assert "solved as one program" not in autopar.report.summary(layered)


def test_a_stage_of_one_layer_or_of_agreeing_layers_keeps_its_layer_solutions(monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", "")
    case = generated.generate(0, family="mlp")
    for stages in (1, 2):
        plan = _plan(case, stages)
        assert plan.predicted.step_s <= plan.solver.get("layered_step_s", np.inf)
        for st in plan.stages:
            if st.layers[0] == st.layers[1]:
                assert len(st.layer_plans) == 1 and st.layer_plans[0].eqn_range == st.eqn_range


@pytest.mark.parametrize("seed,family,method", [(3, "moe", "pipeshard-1"),
                                                (7, "attention", "pipeshard-2")])
def test_joint_stage_plans_equal_jit(seed, family, method):
    """The step runs the stage's one solution and gives the micro-batched `jax.jit` step's
    numbers (`generated.check`: losses and every state leaf, the optimizer's tolerances);
    attention-7 on 2 stages: one stage solved as one program, the other as its layers."""
    case = generated.generate(seed, family=family)
    plan = _plan(case, int(method.split("-")[1]))
    assert "layered_step_s" in plan.solver
    assert any(len(st.layer_plans) == 1 and st.layers[1] > st.layers[0] for st in plan.stages)
    result = generated.check(case, method, comm_name="local")
    assert result["outcome"] == "equal", result
    assert np.isfinite(result["err_over_tol"])


def test_a_cut_between_layers_adds_no_free_communication(monkeypatch):
    # mlp-0 at scale 4: the first layer's matmul leaves partial sums that the second layer
    # reads at once. When a layer ILP priced its outputs' reductions like the parameter
    # gradients' (a pro-rated share of a combined bucket's latency), the cut made the same
    # layouts 4.70 ms per step against 5.92 ms as one program; what a layer hands on is
    # awaited (`memory.analyze`), so the plan of layer solutions is never below it.
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", "")
    monkeypatch.setattr(pipeline_search.stage_costs, "JOINT_MAX_EQNS", 0)
    case = generated.generate(0, family="mlp", scale=4)
    steps = {}
    for layer_num in (1, 2):
        method = autopar.PipeshardParallel(num_micro_batches=4, num_stages=1,
                                           layer_num=layer_num, time_limit_s=10.0)
        plan = autopar.parallelize(case.step, method=method).get_plan(case.init(),
                                                                       case.batch(0))
        assert len(plan.stages[0].layer_plans) == layer_num
        steps[layer_num] = plan.predicted.step_s
    assert steps[2] >= steps[1] * (1 - 1e-9), steps
