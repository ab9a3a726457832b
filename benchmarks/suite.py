"""Weak-scaling suites: autopar against hand-written strategies on a cluster preset (issue 6).

    python -m benchmarks suite gpt --cluster 8x8xV100-16GB
    autopar bench gpt --cluster 4x8xH100-80GB

Per case (devices → model, the Alpa paper's automatic suites) the strategies are: data
parallel, ZeRO-2, ZeRO-3, Megatron-style tensor parallel within a host + data parallel
across, the best manual 3-D plan of a grid over (dp, tp, pp, micro-batches), autopar
intra-op only (one stage over all devices) and autopar PipeshardParallel.  Every strategy
is priced by the same step model (`benchmarks.layouts`); a hand-written strategy takes the
fastest micro-batch count that fits memory; autopar chooses its own with
`num_micro_batches="auto"`, falling back to the best hand-written plan's count and 4 times it
(`_autopar_tries`).

Writes benchmarks/results/<suite>-<cluster>.md, .json and a throughput chart .png.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sys
import time
from collections.abc import Callable

import autopar
from autopar import models as zoo
from autopar.cost_model import ClusterSpec
from autopar.cost_model.jsonio import write_json_atomic
from autopar.pipeline_planner import state_floor_bytes
from benchmarks.layouts import Evaluation, Layout, Pricer, best_fitting, grid_3d, micro_candidates

RESULTS = pathlib.Path(__file__).resolve().parent / "results"

SUITES: dict[str, tuple[int, list[tuple[int, str]]]] = {
    "gpt": (1024, [(1, "gpt-350m"), (2, "gpt-760m"), (4, "gpt-1.3b"), (8, "gpt-2.6b"),
                   (16, "gpt-6.7b"), (32, "gpt-15b"), (64, "gpt-39b")]),
    "moe": (1024, [(1, "moe-380m"), (2, "moe-690m"), (4, "moe-1.3b"), (8, "moe-2.4b"),
                   (16, "moe-10b"), (32, "moe-27b"), (64, "moe-70b")]),
    "wrn": (1536, [(1, "wrn-250m"), (2, "wrn-500m"), (4, "wrn-1b"), (8, "wrn-2b"),
                   (16, "wrn-4b"), (32, "wrn-6.8b")]),
}
STRATEGIES = ("dp", "zero2", "zero3", "megatron", "3d", "autopar-shard", "autopar")
LABELS = {"dp": "Data parallel", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
          "megatron": "Megatron TP+DP", "3d": "Best manual 3-D", "autopar-shard":
          "autopar intra-op", "autopar": "autopar (pipeshard)"}
# Micro-batch counts tried per hand-written (dp, tp, pp): powers of 4 keep the grid small.
MICRO_STEP = 4


def case_cluster(cluster: ClusterSpec, devices: int) -> ClusterSpec:
    """The first `devices` devices of `cluster`: part of one host, or whole hosts."""
    per = cluster.devices_per_host
    if devices <= per:
        return cluster.with_devices(1, devices)
    if devices % per or devices > cluster.num_devices:
        raise ValueError(f"{devices} devices do not fit {cluster.name} as whole hosts")
    return cluster.with_devices(devices // per, per)


def _micro(global_batch: int, dp: int, pp: int, max_micro: int) -> list[int]:
    cands = micro_candidates(global_batch, dp, pp, max_micro)
    return [b for b in cands if round(math.log(b, MICRO_STEP), 6).is_integer()
            or b == cands[0]]


def baseline_layouts(devices: int, devices_per_host: int, num_layers: int,
                     global_batch: int, max_micro: int = 1024) -> dict[str, list[Layout]]:
    """Candidate layouts of every hand-written strategy for one case."""
    n = devices
    tp = min(n, devices_per_host)
    out = {
        "dp": [Layout("dp", n, 1, 1, b, "replicated") for b in _micro(global_batch, n, 1,
                                                                       max_micro)],
        "zero2": [Layout("zero2", n, 1, 1, b, "replicated", zero_state=True, zero_gather=True)
                  for b in _micro(global_batch, n, 1, max_micro)],
        "zero3": [Layout("zero3", n, 1, 1, b, "zero3", zero_state=True)
                  for b in _micro(global_batch, n, 1, max_micro)],
        "megatron": [Layout("megatron", n // tp, tp, 1, b, "tensor")
                     for b in _micro(global_batch, n // tp, 1, max_micro)],
        "3d": [Layout("3d", dp, t, pp, b, "tensor")
               for dp, t, pp in grid_3d(n, devices_per_host, num_layers, global_batch,
                                        max_micro)
               for b in _micro(global_batch, dp, pp, max_micro)],
    }
    return out


def _autopar(pricer: Pricer, step, args, cluster: ClusterSpec, method,
             micro: int | None = None) -> tuple[Evaluation, dict]:
    """Plans with autopar, then prices the plan with the suite's step model (at the plan's
    micro-batch count when `micro` is None: the method chose it)."""
    t0 = time.perf_counter()
    plan = autopar.plan(step, *args, cluster=cluster, method=method)
    seconds = time.perf_counter() - t0
    micro = plan.num_micro_batches if micro is None else micro
    w = pricer.workload(micro)
    if plan.solver.get("layers") != len(w.layers):
        raise RuntimeError(f"{pricer.model}: autopar layered F into {plan.solver.get('layers')} "
                           f"layers, the suite's workload into {len(w.layers)}")
    stages = [(st.layers, st.mesh_shape) for st in plan.stages]
    # The update as the plan does it: its parameters and optimizer state where the plan
    # holds them (ZeRO-2 splits included, with their all-gathers back).
    held = [(dict(st.input_specs), dict(st.state_specs)) for st in plan.stages]
    ev = pricer.evaluate(Layout("autopar", 0, 0, len(stages), micro, "auto"), stages, held)
    # The step model re-solves each stage's layers with the optimizer state whole; the
    # plan's own stages (the same `stage_memory_bytes`) hold the state as the plan splits it
    # and its layers as solved (memory-lean where the fast ones did not fit): the memory is
    # the plan's.  The time stays the step model's, as for every strategy.
    memory = max((st.memory_bytes for st in plan.stages), default=plan.predicted.memory_bytes)
    ev = dataclasses.replace(ev, memory_bytes=memory, oom=memory > pricer.cluster.memory_bytes)
    phases = {k: round(v, 2) for k, v in plan.solver.get("phases_s", {}).items()}
    extra = {"search_s": round(seconds, 2), "phases_s": phases,
             "planner_step_s": plan.predicted.step_s, "plan": plan.to_json()}
    if "micro_batch_tries" in plan.solver:
        extra["micro_batch_tries"] = plan.solver["micro_batch_tries"]
    return ev, extra


def _autopar_tries(pricer: Pricer, name: str, best_baseline: Evaluation | None,
                   sub: ClusterSpec, global_batch: int) -> tuple[Evaluation | None, dict]:
    """autopar with `num_micro_batches="auto"` (the planner tries the counts itself; on a
    small case it is no slower than the two counts below, tests/test_search_speed.py); if
    that finds no plan, or its plan runs out of memory in the step model, the counts tried
    by hand: the best hand-written plan's micro-batch count B and MICRO_STEP x B, a count
    whose search finds no layout that fits, or whose plan runs out of memory in the step
    model, replaced by the next larger one."""
    step, args = zoo.train_step_and_args(pricer.model, global_batch)
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
    """The best hand-written plan's count B and MICRO_STEP x B (see `_autopar_tries`);
    keeps the faster plan; the search time is the sum over the tries."""
    counts = _micro(global_batch, 1, 1, 1024)
    first = best_baseline.layout.micro if best_baseline else counts[-1]
    tries = [b for b in counts if b >= first] or [first]
    step, args = zoo.train_step_and_args(pricer.model, global_batch)
    searched, failures, results = 0.0, [], []
    for micro in tries:
        method = _method(name, sub, micro)
        t0 = time.perf_counter()
        try:
            ev, extra = _autopar(pricer, step, args, sub, method, micro)
        except ValueError as err:  # no stage layout fits the memory
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


def run_case(devices: int, model: str, global_batch: int, cluster: ClusterSpec,
             strategies=STRATEGIES, progress: Callable[[str], None] | None = None) -> dict:
    """Every strategy on one case; returns a JSON-able row."""
    sub = case_cluster(cluster, devices)
    pricer = Pricer(model, global_batch, sub, progress=progress)
    w = pricer.workload(_micro(global_batch, 1, 1, 1024)[0])
    num_layers = len(w.layers)
    flops = zoo.flops_per_step(model, global_batch)
    param_bytes = float(sum(w.value_bytes(v) for v in w.param_ids))
    row: dict = {"devices": devices, "model": model, "params": zoo.param_count(model),
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
            best, evals = best_fitting(pricer, layouts[name])
            extra["tried"] = len(evals)
            if best is None and evals:
                best = min(evals, key=lambda e: e.memory_bytes)
            if best is not None and not best.oom and (
                    best_baseline is None or best.step_s < best_baseline.step_s):
                best_baseline = best
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
    fitting = [row["strategies"][s]["step_s"] for s in ("dp", "zero2", "zero3", "megatron", "3d")
               if s in row["strategies"] and not row["strategies"][s].get("oom", True)]
    row["best_baseline_s"] = min(fitting) if fitting else None
    auto = row["strategies"].get("autopar", {})
    row["ratio"] = (auto["step_s"] / row["best_baseline_s"]
                    if row["best_baseline_s"] and not auto.get("oom", True) else None)
    return row


def _fmt_cell(entry: dict) -> str:
    if "step_s" not in entry:
        return "—"
    if entry["oom"]:
        return f"OOM ({entry['memory_bytes'] / 2**30:.0f} GiB)"
    return f"{entry['step_s']:.2f} s · {entry['tflops_per_device']:.1f}"


def markdown(suite: str, cluster: ClusterSpec, rows: list[dict], wall_s: float) -> str:
    mem = cluster.memory_bytes / 2**30
    lines = [f"# Suite `{suite}` on `{cluster.name}`", "",
             f"Predicted iteration time and model TFLOP/s per device (FLOPs: "
             f"`autopar.models.flops_per_step` — Narayanan et al. SC'21 eq. 3 for GPT, the same "
             f"counting for MoE and Wide-ResNet); OOM: over the {mem:.0f} GiB of a device. "
             f"—: autopar's search found no plan that fits memory (the JSON's `failed_tries` "
             f"says why), or no hand-written plan fits (ratio). "
             f"Step model and strategies: `benchmarks/layouts.py`, `benchmarks/suite.py`. "
             f"One run on this 2-core machine, {wall_s / 60:.1f} min in all.", "",
             "| devices | model | " + " | ".join(LABELS[s] for s in STRATEGIES)
             + " | autopar / best baseline |",
             "|---" * (len(STRATEGIES) + 3) + "|"]
    for r in rows:
        cells = [_fmt_cell(r["strategies"].get(s, {})) for s in STRATEGIES]
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "—"
        lines.append(f"| {r['devices']} | {r['model']} | " + " | ".join(cells) + f" | {ratio} |")
    for r in rows:
        floor = r.get("state_bytes_per_device_min", 0.0)
        if floor > cluster.memory_bytes:
            lines += ["", f"{r['model']} on {r['devices']} devices: no plan can fit. Its "
                      f"parameters, their gradients and the optimizer state take "
                      f"{floor * r['devices'] / 2**30:,.0f} GiB, at least "
                      f"{floor / 2**30:.1f} GiB per device even split over all "
                      f"{r['devices']}, over the {mem:.0f} GiB of one."]
    lines += ["", "Chosen layouts (dp x tp x pp, micro-batches) and memory per device:", "",
              "| devices | model | " + " | ".join(LABELS[s] for s in STRATEGIES) + " |",
              "|---" * (len(STRATEGIES) + 2) + "|"]
    for r in rows:
        cells = []
        for s in STRATEGIES:
            e = r["strategies"].get(s, {})
            if "step_s" not in e:
                cells.append("—")
            elif s.startswith("autopar"):
                st = "; ".join(f"{x['layers'][0]}-{x['layers'][1]}:{x['mesh']}"
                               for x in e["stages"])
                cells.append(f"{st} B={e['micro']} {e['memory_bytes'] / 2**30:.1f} GiB")
            else:
                cells.append(f"{e['dp']}x{e['tp']}x{e['pp']} B={e['micro']} "
                             f"{e['memory_bytes'] / 2**30:.1f} GiB")
        lines.append(f"| {r['devices']} | {r['model']} | " + " | ".join(cells) + " |")
    lines += ["", "Search / pricing time (s; autopar: its own search by phase):", "",
              "| devices | model | hand-written pricing | autopar intra-op search | "
              "autopar search | autopar phases |", "|---|---|---|---|---|---|"]
    for r in rows:
        st = r["strategies"]
        hand = sum(st[s]["pricing_s"] for s in ("dp", "zero2", "zero3", "megatron", "3d")
                   if s in st)
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
        max_devices: int | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Runs a suite on a preset and writes <suite>-<cluster>.md/.json/.png."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; known: {sorted(SUITES)} (and 'toy')")
    cluster = ClusterSpec.preset(cluster_name) if isinstance(cluster_name, str) else cluster_name
    batch, cases = SUITES[suite]
    t0 = time.perf_counter()
    rows = []
    for devices, model in cases:
        if devices > cluster.num_devices or (max_devices and devices > max_devices):
            continue
        t_case = time.perf_counter()
        row = run_case(devices, model, batch, cluster, progress=progress)
        row["case_s"] = round(time.perf_counter() - t_case, 1)
        rows.append(row)
        print(f"[{time.perf_counter() - t0:7.1f}s] {devices} x {model}: ratio "
              f"{row['ratio']}", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{suite}-{cluster.name}"
    text = markdown(suite, cluster, rows, wall)
    result = {"suite": suite, "cluster": cluster.to_json(), "global_batch": batch,
              "wall_s": round(wall, 1), "rows": rows}
    write_json_atomic(stem.with_suffix(".json"), result)
    tmp = stem.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(stem.with_suffix(".md"))
    chart(suite, cluster, rows, stem.with_suffix(".png"))
    print(text)
    return result
