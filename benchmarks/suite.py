"""Weak-scaling suites: autopar against hand-written strategies on a cluster preset (issue 6).

    python -m benchmarks suite gpt --cluster 8x8xV100-16GB
    autopar bench gpt --cluster 4x8xH100-80GB

Per case (devices → model, the Alpa paper's automatic suites) the strategies are: data
parallel, ZeRO-2, ZeRO-3, Megatron-style tensor parallel within a host + data parallel
across, the best manual 3-D plan of a grid over (dp, tp, pp, micro-batches, optimizer state
split over dp or not), Alpa's own published plan for the case (`benchmarks.alpa_plans`),
autopar intra-op only (one stage over all devices) and autopar PipeshardParallel.

Fairness rules (issue 41):
* one layout per row: a row's time and memory come from the same layer solutions — the
  hand-written rows' and Alpa's from the suite's step model (`benchmarks.layouts.Pricer`),
  autopar's rows from the plan `autopar.plan` returns (its own prediction, which adds the
  re-layouts between a stage's layers and amortizes the update over the micro-batches:
  never cheaper than the step model on the same layers);
* every row gets the same micro-batch candidates (powers of two, `micro_candidates`); a
  hand-written strategy takes the fastest count that fits memory; autopar chooses its own
  with `num_micro_batches="auto"`, falling back to counts from the best hand-written plan's
  upward (`_autopar_tries`);
* a layout that may split the optimizer state (3-D, Alpa's plans) is tried both ways, the
  fastest that fits kept;
* the workload is the one Alpa's benchmark trains (`SUITES[...].overrides`: optimizer,
  parameter dtype with a float32 master copy), for every row.

Writes benchmarks/results/<suite>-<cluster>.md, .json and a throughput chart .png.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Callable

import autopar
from autopar import models as zoo
from autopar.cost_model import ClusterSpec
from autopar.cost_model.jsonio import write_json_atomic
from autopar.pipeline_search import state_floor_bytes
from benchmarks import alpa_plans
from benchmarks.layouts import (
    Evaluation,
    Layout,
    Pricer,
    StageCost,
    best_fitting,
    grid_3d,
    micro_candidates,
)
from benchmarks.stamp import stamp, stamp_markdown

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Suite:
    """A weak-scaling suite: `global_batch`, `cases` (devices, zoo model), the zoo config
    `overrides` that make the workload Alpa's, and `source`, where Alpa's benchmark sets it."""

    global_batch: int
    cases: tuple[tuple[int, str], ...]
    overrides: tuple[tuple[str, object], ...] = ()
    source: str = ""


SUITES: dict[str, Suite] = {
    "gpt": Suite(1024, ((1, "gpt-350m"), (2, "gpt-760m"), (4, "gpt-1.3b"), (8, "gpt-2.6b"),
                        (16, "gpt-6.7b"), (32, "gpt-15b"), (64, "gpt-39b")),
                 (("param_dtype", "float16"), ("optimizer", "adamw")),
                 "alpa `benchmark_one_case_gpt_bert.py`: AdamW, float16 parameters with a "
                 "float32 master copy (`TrainState(mixed_precision=True)`), remat"),
    "moe": Suite(1024, ((1, "moe-380m"), (2, "moe-690m"), (4, "moe-1.3b"), (8, "moe-2.4b"),
                        (16, "moe-10b"), (32, "moe-27b"), (64, "moe-70b")),
                 (("param_dtype", "float16"), ("optimizer", "adafactor")),
                 "alpa `benchmark_one_case_moe.py`: Adafactor (`optax_adafactor`, optax's "
                 "defaults), float16 parameters with a float32 master copy, remat"),
    "wrn": Suite(1536, ((1, "wrn-250m"), (2, "wrn-500m"), (4, "wrn-1b"), (8, "wrn-2b"),
                        (16, "wrn-4b"), (32, "wrn-6.8b")),
                 (("optimizer", "sgd-nesterov"),),
                 "alpa `benchmark_one_case_wresnet.py`: SGD, momentum 0.9, Nesterov; "
                 "float32 (`suite_wresnet.py`), remat"),
}
STRATEGIES = ("dp", "zero2", "zero3", "megatron", "3d", "alpa", "autopar-shard", "autopar")
BASELINES = ("dp", "zero2", "zero3", "megatron", "3d")
LABELS = {"dp": "Data parallel", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
          "megatron": "Megatron TP+DP", "3d": "Best manual 3-D", "alpa": "Alpa's plan",
          "autopar-shard": "autopar intra-op", "autopar": "autopar (pipeshard)"}
#: A ratio within this of 1 is a tie: the same layout priced through two summation orders
#: (5e-7 on the V100 GPT suite's 1-device case).
TIE = 1e-5


def loses(ratio: float | None) -> bool:
    """Whether autopar's row is slower than the row the ratio compares it with."""
    return ratio is not None and ratio > 1.0 + TIE


def case_cluster(cluster: ClusterSpec, devices: int) -> ClusterSpec:
    """The first `devices` devices of `cluster`: part of one host, or whole hosts."""
    per = cluster.devices_per_host
    if devices <= per:
        return cluster.with_devices(1, devices)
    if devices % per or devices > cluster.num_devices:
        raise ValueError(f"{devices} devices do not fit {cluster.name} as whole hosts")
    return cluster.with_devices(devices // per, per)


def baseline_layouts(devices: int, devices_per_host: int, num_layers: int,
                     global_batch: int, max_micro: int = 1024) -> dict[str, list[Layout]]:
    """Candidate layouts of every hand-written strategy for one case (every micro-batch
    count of `micro_candidates`; the 3-D grid with the optimizer state whole and, where
    dp > 1, split over dp as ZeRO-2 splits it)."""
    n = devices
    tp = min(n, devices_per_host)
    out = {
        "dp": [Layout("dp", n, 1, 1, b, "replicated")
               for b in micro_candidates(global_batch, n, 1, max_micro)],
        "zero2": [Layout("zero2", n, 1, 1, b, "replicated", zero_state=True, zero_gather=True)
                  for b in micro_candidates(global_batch, n, 1, max_micro)],
        "zero3": [Layout("zero3", n, 1, 1, b, "zero3", zero_state=True)
                  for b in micro_candidates(global_batch, n, 1, max_micro)],
        "megatron": [Layout("megatron", n // tp, tp, 1, b, "tensor")
                     for b in micro_candidates(global_batch, n // tp, 1, max_micro)],
        "3d": [Layout("3d", dp, t, pp, b, "tensor", zero_state=z, zero_gather=z)
               for dp, t, pp in grid_3d(n, devices_per_host, num_layers, global_batch,
                                        max_micro)
               for z in ((False, True) if dp > 1 else (False,))
               for b in micro_candidates(global_batch, dp, pp, max_micro)],
    }
    return out


def _autopar(pricer: Pricer, step, args, cluster: ClusterSpec, method
             ) -> tuple[Evaluation, dict]:
    """Plans with autopar and takes the plan's own prediction: the step time and the
    memory of the layout the plan holds (one layout, as for every row)."""
    t0 = time.perf_counter()
    plan = autopar.plan(step, *args, cluster=cluster, method=method)
    seconds = time.perf_counter() - t0
    w = pricer.workload(plan.num_micro_batches)
    if plan.solver.get("layers") != len(w.layers):
        raise RuntimeError(f"{pricer.model}: autopar layered F into {plan.solver.get('layers')} "
                           f"layers, the suite's workload into {len(w.layers)}")
    stages = tuple(StageCost(tuple(st.layers), len(st.device_ids), tuple(st.mesh_shape),
                             st.predicted_s, 0.0, st.memory_bytes) for st in plan.stages)
    memory = max((st.memory_bytes for st in plan.stages), default=plan.predicted.memory_bytes)
    ev = Evaluation(Layout("autopar", 0, 0, len(stages), plan.num_micro_batches, "auto"),
                    plan.predicted.step_s, memory, memory > pricer.cluster.memory_bytes,
                    stages)
    phases = {k: round(v, 2) for k, v in plan.solver.get("phases_s", {}).items()}
    extra = {"search_s": round(seconds, 2), "phases_s": phases, "plan": plan.to_json()}
    if "micro_batch_tries" in plan.solver:
        extra["micro_batch_tries"] = plan.solver["micro_batch_tries"]
    return ev, extra


def _autopar_tries(pricer: Pricer, name: str, best_baseline: Evaluation | None,
                   sub: ClusterSpec, global_batch: int) -> tuple[Evaluation | None, dict]:
    """autopar with `num_micro_batches="auto"` (the planner tries the counts itself); if
    that finds no plan, or its plan does not fit, the counts by hand (`_autopar_by_hand`)."""
    step, args = zoo.train_step_and_args(pricer.model, global_batch,
                                         overrides=dict(pricer.overrides))
    t0 = time.perf_counter()
    try:
        ev, extra = _autopar(pricer, step, args, sub, _method(name, sub, "auto"))
    except ValueError as err:
        ev, extra = None, {"auto_failed": " ".join(str(err).split())[:160]}
    if ev is not None and not ev.oom:
        return ev, extra
    fallback, more = _autopar_by_hand(pricer, name, best_baseline, sub, global_batch)
    more["search_s"] = round(more.get("search_s", 0.0) + time.perf_counter() - t0, 2)
    return fallback, {**more, "auto": "no plan that fits"}


def _method(name: str, sub: ClusterSpec, micro: int | str):
    if name == "autopar-shard":
        return autopar.PipeshardParallel(
            num_micro_batches=micro, num_stages=1,
            submesh_shapes=((sub.num_hosts, sub.devices_per_host),))
    return autopar.PipeshardParallel(num_micro_batches=micro)


def _autopar_by_hand(pricer: Pricer, name: str, best_baseline: Evaluation | None,
                     sub: ClusterSpec, global_batch: int) -> tuple[Evaluation | None, dict]:
    """The micro-batch counts from the best hand-written plan's count B upward (the
    powers of two every row tries), until two give a plan that fits; keeps the faster;
    the search time is the sum over the tries."""
    counts = micro_candidates(global_batch, 1, 1)
    first = best_baseline.layout.micro if best_baseline else counts[-1]
    tries = [b for b in counts if b >= first] or [first]
    step, args = zoo.train_step_and_args(pricer.model, global_batch,
                                         overrides=dict(pricer.overrides))
    searched, failures, results = 0.0, [], []
    for micro in tries:
        method = _method(name, sub, micro)
        t0 = time.perf_counter()
        try:
            ev, extra = _autopar(pricer, step, args, sub, method)
        except ValueError as err:  # no stage layout fits memory (MemoryBudgetError among them)
            failures.append(f"B={micro}: {' '.join(str(err).split())[:160]}")
            searched += time.perf_counter() - t0
            continue
        searched += extra["search_s"]
        if ev.oom:
            failures.append(f"B={micro}: OOM ({ev.memory_bytes / 2**30:.1f} GiB)")
            continue
        results.append((ev, extra))
        if len(results) == 2:
            break
    if not results:
        return None, {"search_s": round(searched, 2), "failed_tries": failures}
    best, extra = min(results, key=lambda r: r[0].step_s)
    extra = dict(extra, search_s=round(searched, 2),
                 tried_micro_batches=[r[0].layout.micro for r in results])
    if failures:
        extra["failed_tries"] = failures
    return best, extra


def _fastest_fitting(evals: list[Evaluation]) -> Evaluation | None:
    """The fastest evaluation that fits memory; if none fits, the smallest (its row shows
    the OOM and how much it needs); None for none at all."""
    fitting = [e for e in evals if not e.oom]
    if fitting:
        return min(fitting, key=lambda e: e.step_s)
    return min(evals, key=lambda e: e.memory_bytes, default=None)


def _alpa(pricer: Pricer, suite: str, devices: int, num_layers: int
          ) -> tuple[Evaluation | None, dict]:
    """Alpa's published plan for the case priced by the step model: its stages mapped onto
    autopar's layers, each stage's layers solved on Alpa's logical mesh (the batch forced
    onto dim 0 where Alpa forced it, else free), with the optimizer state whole and split
    over dim 0 (Alpa's `prefer_reduce_scatter`), the faster that fits kept."""
    plan = alpa_plans.alpa_plan(suite, devices, pricer.model)
    if plan is None:
        return None, {"note": "Alpa published no plan for this case"}
    return price_alpa_plan(pricer, plan, num_layers)


def price_alpa_plan(pricer: Pricer, plan: alpa_plans.AlpaPlan, num_layers: int
                    ) -> tuple[Evaluation | None, dict]:
    """`plan` priced as `_alpa` prices a published one (also `benchmarks.gpu_accuracy`)."""
    try:
        stages = alpa_plans.map_stages(plan, num_layers)
    except ValueError as err:
        return None, {"note": str(err)}
    meshes = [(layers, tuple(m)) for layers, m in zip(stages, plan.logical)]
    rules = ["free" if f else "auto" for f in plan.force_dp]
    evals = []
    for split in ((False, True) if any(m[0] > 1 for m in plan.logical) else (False,)):
        layout = Layout("alpa", 0, 0, len(stages), plan.micro, "auto", zero_state=split,
                        zero_gather=split)
        evals.append(pricer.evaluate(layout, meshes, rules=rules))
    return _fastest_fitting(evals), {"alpa_plan": alpa_plans.describe(plan, stages),
                                     "tried": len(evals)}


def run_case(devices: int, model: str, global_batch: int, cluster: ClusterSpec,
             strategies=STRATEGIES, progress: Callable[[str], None] | None = None,
             suite: str = "", overrides: tuple[tuple[str, object], ...] = ()) -> dict:
    """Every strategy on one case (the workload with the zoo config's `overrides`; Alpa's
    plan looked up under `suite`); returns a JSON-able row."""
    sub = case_cluster(cluster, devices)
    pricer = Pricer(model, global_batch, sub, progress=progress, overrides=overrides)
    w = pricer.workload(micro_candidates(global_batch, 1, 1)[0])
    num_layers = len(w.layers)
    fields = dict(overrides)
    flops = zoo.flops_per_step(model, global_batch, fields)
    param_bytes = float(sum(w.value_bytes(v) for v in w.param_ids))
    row: dict = {"devices": devices, "model": model,
                 "params": zoo.param_count(model, fields),
                 "flops_per_step": flops, "layers": num_layers, "strategies": {},
                 "state_bytes_per_device_min": state_floor_bytes(
                     param_bytes, w.state_bytes_per_param_byte, devices)}
    layouts = baseline_layouts(devices, sub.devices_per_host, num_layers, global_batch)
    best_baseline: Evaluation | None = None
    for name in strategies:
        t0 = time.perf_counter()
        solves0 = pricer.solves
        extra: dict = {}
        if name in layouts:
            _, evals = best_fitting(pricer, layouts[name])
            extra["tried"] = len(evals)
            best = _fastest_fitting(evals)
            if best is not None and not best.oom and (
                    best_baseline is None or best.step_s < best_baseline.step_s):
                best_baseline = best
        elif name == "alpa":
            best, extra = _alpa(pricer, suite, devices, num_layers)
        else:
            best, extra = _autopar_tries(pricer, name, best_baseline, sub, global_batch)
        seconds = time.perf_counter() - t0
        entry = {"pricing_s": round(seconds, 2), "layer_solves": pricer.solves - solves0,
                 **extra}
        if best is not None:
            entry.update(best.to_json())
            entry["tflops_per_device"] = (flops / best.step_s / devices / 1e12
                                          if not best.oom else None)
        row["strategies"][name] = entry
        if progress:
            progress(f"{model}: {name} done")
    fitting = [row["strategies"][s]["step_s"] for s in BASELINES
               if s in row["strategies"] and not row["strategies"][s].get("oom", True)]
    row["best_baseline_s"] = min(fitting) if fitting else None
    auto = row["strategies"].get("autopar", {})
    auto_s = auto["step_s"] if "step_s" in auto and not auto["oom"] else None
    row["ratio"] = auto_s / row["best_baseline_s"] if auto_s and row["best_baseline_s"] else None
    alpa = row["strategies"].get("alpa", {})
    row["alpa_s"] = alpa["step_s"] if "step_s" in alpa and not alpa["oom"] else None
    row["ratio_alpa"] = auto_s / row["alpa_s"] if auto_s and row["alpa_s"] else None
    return row


def _fmt_cell(entry: dict) -> str:
    if "step_s" not in entry:
        return "—"
    if entry["oom"]:
        return f"OOM ({entry['memory_bytes'] / 2**30:.0f} GiB)"
    return f"{entry['step_s']:.2f} s · {entry['tflops_per_device']:.1f}"


def _ratio(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "—"


def _slower_notes(row: dict) -> list[str]:
    """One bullet per row autopar's plan does not beat (best baseline, Alpa's plan): both
    figures and both layouts."""
    st = row["strategies"]
    auto = st.get("autopar", {})
    out = []
    best = min((s for s in BASELINES if "step_s" in st.get(s, {}) and not st[s]["oom"]),
               key=lambda s: st[s]["step_s"], default=None)
    view = row.get("planner_view") or {}
    for ratio, other in ((row.get("ratio"), best), (row.get("ratio_alpa"), "alpa")):
        if not loses(ratio) or other is None:
            continue
        why = (f" Why: {view['reason']} ({view['verdict']}; `benchmarks.explain`)."
               if other == best and view.get("against") == best else "")
        out.append(f"- {row['devices']} x {row['model']}: autopar {auto['step_s']:.3f} s "
                   f"({_layout_cell('autopar', auto)}) against {LABELS[other]} "
                   f"{st[other]['step_s']:.3f} s ({_layout_cell(other, st[other])}): "
                   f"{100 * (ratio - 1):.2f}% slower.{why}")
    return out


def _layout_cell(name: str, e: dict) -> str:
    """A row's layout: stages (layers:logical mesh) or dp x tp x pp, micro-batches, whether
    the optimizer state is split, memory per device."""
    if "step_s" not in e:
        return "—"
    split = " state split" if e.get("zero_state") and name in ("3d", "alpa") else ""
    if name.startswith("autopar") or name == "alpa":
        shape = "; ".join(f"{x['layers'][0]}-{x['layers'][1]}:{list(x['mesh'])}"
                          for x in e["stages"])
    else:
        shape = f"{e['dp']}x{e['tp']}x{e['pp']}"
    return f"{shape} B={e['micro']}{split} {e['memory_bytes'] / 2**30:.1f} GiB"


def markdown(suite: str, cluster: ClusterSpec, rows: list[dict], wall_s: float,
             result: dict | None = None) -> str:
    """The results page; `result` (the JSON) adds its stamp and workload."""
    mem = cluster.memory_bytes / 2**30
    result = result or {}
    head = [f"# Suite `{suite}` on `{cluster.name}`", ""]
    if "meta" in result:
        head += [stamp_markdown(result["meta"]), ""]
    for key, what in (("audit_meta", "Audit (compiled programs)"),
                      ("explain_meta", "Why-notes (`benchmarks.explain`, the planner of this "
                                       "commit re-planning the layouts autopar lost to)")):
        if key in result:
            head += [f"{what}: " + stamp_markdown(result[key]), ""]
    if result.get("workload_source"):
        fields = ", ".join(f"{k}={v}" for k, v in result.get("overrides", {}).items())
        head += [f"Workload as Alpa's benchmark trains it ({result['workload_source']}): "
                 f"the zoo's models with {fields or 'their defaults'}, for every row.", ""]
    lines = head + [
             f"Predicted iteration time and model TFLOP/s per device (FLOPs: "
             f"`autopar.models.flops_per_step` — Narayanan et al. SC'21 eq. 3 for GPT, the same "
             f"counting for MoE and Wide-ResNet); OOM: over the {mem:.0f} GiB of a device. "
             f"—: autopar's search found no plan that fits memory (the JSON's `failed_tries` "
             f"says why), no hand-written plan fits, or Alpa published no plan for the case. "
             f"Every row's time and memory come from one layout; the hand-written rows and "
             f"Alpa's plan are priced by the suite's step model, autopar's rows are their "
             f"plans' own predictions (`benchmarks/suite.py`'s docstring: the fairness rules). "
             f"Alpa's plans were found for 8 x V100-16GB hosts (`benchmarks/alpa_plans.py`). "
             f"Step model and strategies: `benchmarks/layouts.py`, `benchmarks/suite.py`. "
             f"One run on a 2-core machine, {wall_s / 60:.1f} min in all.", "",
             "| devices | model | " + " | ".join(LABELS[s] for s in STRATEGIES)
             + " | autopar / best baseline | autopar / Alpa's plan |",
             "|---" * (len(STRATEGIES) + 4) + "|"]
    for r in rows:
        cells = [_fmt_cell(r["strategies"].get(s, {})) for s in STRATEGIES]
        lines.append(f"| {r['devices']} | {r['model']} | " + " | ".join(cells)
                     + f" | {_ratio(r['ratio'])} | {_ratio(r.get('ratio_alpa'))} |")
    for r in rows:
        floor = r.get("state_bytes_per_device_min", 0.0)
        if floor > cluster.memory_bytes:
            lines += ["", f"{r['model']} on {r['devices']} devices: no plan can fit. Its "
                      f"parameters, their gradients and the optimizer state take "
                      f"{floor * r['devices'] / 2**30:,.0f} GiB, at least "
                      f"{floor / 2**30:.1f} GiB per device even split over all "
                      f"{r['devices']}, over the {mem:.0f} GiB of one."]
    slower = [note for r in rows for note in _slower_notes(r)]
    if slower:
        lines += ["", "Cases where autopar's plan is predicted slower than a row it must beat "
                  "(autopar's row is its planner's own prediction, which prices each "
                  "parameter's update at every layer that reads it and the re-layouts between "
                  "a stage's layers; the step model of the other rows prices neither, so on "
                  "the same layout autopar's figure is the larger):", ""] + slower
    lines += ["", "Chosen layouts (dp x tp x pp, micro-batches) and memory per device:", "",
              "| devices | model | " + " | ".join(LABELS[s] for s in STRATEGIES) + " |",
              "|---" * (len(STRATEGIES) + 2) + "|"]
    for r in rows:
        cells = [_layout_cell(s, r["strategies"].get(s, {})) for s in STRATEGIES]
        lines.append(f"| {r['devices']} | {r['model']} | " + " | ".join(cells) + " |")
    lines += ["", "Search / pricing time (s; autopar: its own search by phase):", "",
              "| devices | model | hand-written pricing | autopar intra-op search | "
              "autopar search | autopar phases |", "|---|---|---|---|---|---|"]
    for r in rows:
        st = r["strategies"]
        hand = sum(st[s]["pricing_s"] for s in BASELINES if s in st)
        a = st.get("autopar", {})
        named = {k.removeprefix("trace + "): v for k, v in a.get("phases_s", {}).items()}
        if "search_s" in a:  # tracing the step, splitting F, and retries with more µb
            named["trace, retries"] = round(max(0.0, a["search_s"] - sum(named.values())), 2)
        phases = ", ".join(f"{k} {v}" for k, v in named.items())
        lines.append(f"| {r['devices']} | {r['model']} | {hand:.1f} | "
                     f"{st.get('autopar-shard', {}).get('search_s', '—')} | "
                     f"{a.get('search_s', '—')} | {phases} |")
    audited = [r for r in rows if r.get("audit")]
    if audited:
        lines += ["", "autopar's plans compiled on emulated CPU devices with the same mesh shapes "
                  "(`python -m benchmarks.audit`): collective bytes per device of one step "
                  "(every program the step runs, times its calls per step; collectives in "
                  "loops times their trip counts) and the compiled peak per device of the "
                  "largest stage (`PipelineCompiled.stage_memory_bytes`: the stage's "
                  "programs' memory_analysis, its 1F1B in-flight residuals and the optimizer "
                  "state its apply-grad holds), next to the planner's stage memory.  "
                  + _scheduler_note(audited) + ":", "",
                  "| devices | model | collective bytes (one step) | compiled memory / "
                  "device | planner stage memory / device | compile (s) |",
                  "|---|---|---|---|---|---|"]
        for r in audited:
            a = r["audit"]
            coll = ", ".join(f"{k} {v / 2**20:.1f} MiB"
                             for k, v in sorted(a["collective_bytes"].items())) or "none"
            planned = r["strategies"]["autopar"]["memory_bytes"]
            lines.append(f"| {r['devices']} | {r['model']} | {coll} | "
                         f"{a['compiled_memory_bytes'] / 2**30:.2f} GiB | "
                         f"{planned / 2**30:.2f} GiB | {a['compile_s']} |")
    return "\n".join(lines) + "\n"


def _scheduler_note(audited: list[dict]) -> str:
    """Which XLA:CPU scheduler the audit compiled with (audits before the flag: default)."""
    flags = {a["audit"].get("xla_flags", "") for a in audited}
    if all("concurrency_optimized_scheduler=false" in f for f in flags):
        return ("XLA:CPU scheduled for memory (`--xla_cpu_enable_concurrency_optimized_"
                "scheduler=false`; its default scheduler needs 1.7-1.9x as much on the "
                "V100 GPT cases)")
    return "XLA:CPU's default (concurrency-optimized) scheduler"


def chart(suite: str, cluster: ClusterSpec, rows: list[dict], path: pathlib.Path) -> None:
    """Throughput per strategy across scale (the Alpa paper's Figure 7 layout)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / len(STRATEGIES)
    xs = range(len(rows))
    for k, s in enumerate(STRATEGIES):
        vals = [(r["strategies"].get(s, {}).get("tflops_per_device") or 0.0) for r in rows]
        ax.bar([x + k * width for x in xs], vals, width, label=LABELS[s])
        for x, r in zip(xs, rows):
            if r["strategies"].get(s, {}).get("oom"):
                ax.text(x + k * width, 0, "×", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([x + 0.4 - width / 2 for x in xs])
    ax.set_xticklabels([f"{r['devices']}\n{r['model']}" for r in rows], fontsize=7)
    ax.set_ylabel("predicted model TFLOP/s per device")
    ax.set_title(f"{suite} weak scaling on {cluster.name} (× = out of memory)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(suite: str, cluster_name: str | ClusterSpec, *, out_dir: pathlib.Path = RESULTS,
        max_devices: int | None = None, progress: Callable[[str], None] | None = None,
        command: str | None = None) -> dict:
    """Runs a suite on a preset and writes <suite>-<cluster>.md/.json/.png, stamped with
    the commit, date, machine and `command` (default: this process's command line)."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; known: {sorted(SUITES)} (and 'toy')")
    cluster = ClusterSpec.preset(cluster_name) if isinstance(cluster_name, str) else cluster_name
    spec = SUITES[suite]
    batch = spec.global_batch
    meta = stamp(command)
    t0 = time.perf_counter()
    rows = []
    for devices, model in spec.cases:
        if devices > cluster.num_devices or (max_devices and devices > max_devices):
            continue
        t_case = time.perf_counter()
        row = run_case(devices, model, batch, cluster, progress=progress, suite=suite,
                       overrides=spec.overrides)
        row["case_s"] = round(time.perf_counter() - t_case, 1)
        rows.append(row)
        print(f"[{time.perf_counter() - t0:7.1f}s] {devices} x {model}: ratio "
              f"{row['ratio']}", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{suite}-{cluster.name}"
    result = {"meta": meta, "suite": suite, "cluster": cluster.to_json(),
              "global_batch": batch, "overrides": dict(spec.overrides),
              "workload_source": spec.source, "wall_s": round(wall, 1), "rows": rows}
    write_json_atomic(stem.with_suffix(".json"), result)
    print(write_markdown(stem.with_suffix(".json"), result))
    chart(suite, cluster, rows, stem.with_suffix(".png"))
    return result


def annotate(path: str | pathlib.Path, key: str, case: Callable[..., dict | None],
             meta_key: str, command: str | None = None) -> dict:
    """A post-pass over a suite's JSON (`benchmarks.audit`, `benchmarks.explain`): puts
    `case(row, cluster, global_batch, overrides)` into every row under `key` (a None drops
    the key), stamps the pass under `meta_key` (the suite's own stamp, "meta", says who
    priced the rows), and rewrites the JSON and its markdown; returns the data."""
    path = pathlib.Path(path)
    data = json.loads(path.read_text())
    cluster = ClusterSpec.from_json(data["cluster"])
    for row in data["rows"]:
        row.pop(key, None)
        result = case(row, cluster, data["global_batch"], data.get("overrides"))
        if result is not None:
            row[key] = result
            print(f"{row['devices']} x {row['model']}: {result}", file=sys.stderr, flush=True)
    data[meta_key] = stamp(command)
    write_json_atomic(path, data)
    write_markdown(path, data)
    return data


def write_markdown(json_path: pathlib.Path, result: dict) -> str:
    """Writes the results page of a suite's JSON `result` next to it (atomically: a
    temporary file renamed); returns its text."""
    cluster = ClusterSpec.from_json(result["cluster"])
    text = markdown(result["suite"], cluster, result["rows"], result["wall_s"], result)
    md = json_path.with_suffix(".md")
    tmp = md.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(md)
    return text
