"""Says, per case, why autopar's plan is predicted slower than a row it must beat (issue 41).

    python -m benchmarks.explain benchmarks/results/gpt-8x8xV100-16GB.json

A suite prices the hand-written rows with its step model (`benchmarks.layouts.Pricer`) and
autopar's row with the planner's own prediction.  Where autopar's row is the slower, the
winning row's layout is planned again by autopar's planner, through the public API
(`autopar.plan(..., method=Manual3DParallel(dp, tp, pp, B, shard_optimizer_state=...))`:
the same stages, sub-meshes, batch split and micro-batch count, the sharding over tp searched
on that mesh), so both layouts are priced by one model.  The verdict (`VERDICTS`):

The layout is planned twice: within the device memory, and without a budget (its fastest).

* ``search miss`` — within the budget the planner prices it faster than the plan it chose:
  a plan the search should have found;
* ``over memory`` — at its fastest the planner prices it faster than its own plan, but over
  the device memory by the planner's memory model (the step model's figure shown next to
  it), and within the budget no faster: the memory models differ;
* ``slower in the planner`` — even at its fastest the planner prices it no faster than its
  own plan: the search chose right by its model, the gap is between the two time models.

ZeRO-3 has no `Manual3DParallel` equivalent (its parameters live split), so a case it wins
is explained as "not re-planned".  The verdicts go into the suite's JSON
(`rows[i]["planner_view"]`) and its markdown's list of slower cases.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import time

import autopar
from autopar import models as zoo
from autopar.cost_model import ClusterSpec
from benchmarks import suite

#: Over-budget layouts are planned again under this multiple of the device memory, to say
#: how much the planner's model needs for them.
UNBOUNDED = 64.0

VERDICTS = {
    "over memory": "autopar's planner prices this layout at {fast_time} at its fastest, but "
                   "at {fast_memory} per device, over the {budget} of a device (the step "
                   "model: {suite_memory}); within the budget its best on this layout is "
                   "{time} ({memory})",
    "slower in the planner": "autopar's planner prices this layout at {fast_time} at its "
                             "fastest ({fast_memory}), no faster than its own plan: the gap "
                             "is between the two time models, not a choice the search missed",
    "search miss": "autopar's planner prices this layout at {time} ({memory}) within the "
                   "budget, faster than the plan it chose: a search miss",
}


def manual_method(entry: dict) -> autopar.Manual3DParallel | None:
    """The hand-written row's layout as a `Manual3DParallel`; None for ZeRO-3 (parameters
    split: no equivalent)."""
    if entry.get("params") == "zero3" or "dp" not in entry or not entry.get("pp"):
        return None
    return autopar.Manual3DParallel(dp=entry["dp"], tp=entry["tp"], pp=entry["pp"],
                                    num_micro_batches=entry["micro"],
                                    shard_optimizer_state=bool(entry.get("zero_state")))


def _fmt_s(value_s: float | None) -> str:
    return f"{value_s:.4g} s" if value_s is not None else "no plan"


def _fmt_gib(nbytes: float | None) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes is not None else "—"


def _plan(step, args, cluster: ClusterSpec, method) -> dict:
    """The planner's step time (s) and memory per device of the largest stage (bytes) for
    `method`, and its planning time; `error` instead where no layout fits the budget."""
    t0 = time.perf_counter()
    try:
        plan = autopar.plan(step, *args, cluster=cluster, method=method)
    except ValueError as err:      # no layout of the layer ILPs fits the budget
        return {"step_s": None, "memory_bytes": None,
                "error": " ".join(str(err).split())[:240],
                "planning_s": round(time.perf_counter() - t0, 1)}
    memory = max((st.memory_bytes for st in plan.stages), default=plan.predicted.memory_bytes)
    return {"step_s": plan.predicted.step_s, "memory_bytes": memory,
            "planning_s": round(time.perf_counter() - t0, 1)}


def verdict(auto_s: float, budgeted: dict, fastest: dict) -> str:
    """The name in `VERDICTS` for the planner's prices of the layout autopar lost to:
    `budgeted` within the device memory, `fastest` without a budget."""
    if budgeted["step_s"] is not None and budgeted["step_s"] < auto_s:
        return "search miss"
    if fastest["step_s"] is not None and fastest["step_s"] < auto_s:
        return "over memory"
    return "slower in the planner"


def explain_case(row: dict, cluster: ClusterSpec, global_batch: int,
                 overrides: dict | None = None) -> dict | None:
    """The planner's view of the row autopar loses to; None where autopar does not lose."""
    if not suite.loses(row.get("ratio")):
        return None
    st = row["strategies"]
    best = min((s for s in suite.BASELINES if "step_s" in st.get(s, {}) and not st[s]["oom"]),
               key=lambda s: st[s]["step_s"])
    entry, out = st[best], {"against": best}
    method = manual_method(entry)
    if method is None:
        return {**out, "verdict": "not re-planned",
                "reason": f"{suite.LABELS[best]} has no Manual3DParallel equivalent"}
    sub = suite.case_cluster(cluster, row["devices"])
    step, args = zoo.train_step_and_args(row["model"], global_batch, overrides=overrides)
    budgeted = _plan(step, args, sub, method)
    fastest = _plan(step, args, sub, dataclasses.replace(
        method, memory_budget_bytes=UNBOUNDED * sub.memory_bytes))
    name = verdict(st["autopar"]["step_s"], budgeted, fastest)
    reason = VERDICTS[name].format(
        budget=_fmt_gib(sub.memory_bytes), suite_memory=_fmt_gib(entry["memory_bytes"]),
        time=_fmt_s(budgeted["step_s"]), memory=_fmt_gib(budgeted["memory_bytes"]),
        fast_time=_fmt_s(fastest["step_s"]), fast_memory=_fmt_gib(fastest["memory_bytes"]))
    return {**out, "method": repr(method), "verdict": name, "budgeted": budgeted,
            "fastest": fastest, "reason": reason}


def run(path: str | os.PathLike) -> dict:
    """Explains every slower case of a suite's JSON; rewrites the JSON and its markdown."""
    return suite.annotate(path, "planner_view", explain_case, "explain_meta",
                          f"python -m benchmarks.explain {pathlib.Path(path).name}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        run(p)
