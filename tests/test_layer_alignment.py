"""Layers of a stage laid out knowing their neighbours (`pipeline_search.layer_solutions`'s
`LayerSolutions.aligned`): each layer's ILP chooses the layouts of the values it shares
with the layers next to it freely, and the stage then pays for resharding between them;
where that resharding costs, the layer is solved again paying for it, and the cheaper of
the two is kept.  On a tied embedding and a GShard MoE layer, the free layouts disagree at
the layer boundaries (a layer asks for its output's cotangent replicated where the next
gives it split by batch, or reads the expert dispatch replicated): the stage's predicted
time per micro-batch must drop, and the plan must still compute what `jax.jit` does."""

from __future__ import annotations

import generated
import numpy as np
import pytest

import autopar
from autopar import pipeline_search

# The stage's time per micro-batch with neighbours known, as a fraction of the time with
# every layer's free layout at most (measured on cpu-local, 4 micro-batches, one stage over
# 8 devices: tied_embed-4 0.08, moe-3 0.26).
MAX_FRACTION = 0.5
CASES = [(4, "tied_embed"), (3, "moe")]


def _stage_s(case: generated.Case, state, batch) -> float:
    method = autopar.PipeshardParallel(num_micro_batches=4, num_stages=1, time_limit_s=5.0)
    plan = autopar.parallelize(case.step, method=method).get_plan(state, batch)
    return plan.stages[0].predicted_s


@pytest.mark.parametrize("seed,family", CASES)
def test_neighbour_aware_layouts_cost_less(seed, family, monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", "")     # both plans searched, none cached
    # the stage of layer solutions: none of its layers solved together as one program
    monkeypatch.setattr(pipeline_search.stage_costs, "JOINT_MAX_EQNS", 0)
    case = generated.generate(seed, family=family)
    state, batch = case.init(), case.batch(0)
    aligned = _stage_s(case, state, batch)
    # Without the neighbours' resharding seen, every layer keeps its free layout.
    monkeypatch.setattr(pipeline_search.layer_solutions, "neighbour_reshard_s", lambda *a, **k: 0.0)
    free = _stage_s(case, state, batch)
    assert aligned <= MAX_FRACTION * free, (aligned, free)


@pytest.mark.parametrize("seed,family", CASES)
def test_neighbour_aware_plans_equal_jit(seed, family):
    """The aligned layouts run and give the micro-batched `jax.jit` step's numbers
    (`generated.check`: losses and every state leaf, the optimizer's tolerances)."""
    case = generated.generate(seed, family=family)
    result = generated.check(case, "pipeshard-1", comm_name="local")
    assert result["outcome"] == "equal", result
    assert np.isfinite(result["err_over_tol"])
