"""One accelerator, measured: the figures the CPU-only machines cannot give.

    python -m benchmarks.gpu_check [--models gpt-125m:8,gpt-350m:8] [--steps 20] [--out DIR]

Runs on the first device of `jax.devices()` (meant for one GPU; on a CPU it runs the same
checks against ``cpu-local``, which is how its code is tested):

1. **Profile against the preset.**  `autopar.cost_model.profile` on that device (matmul
   FLOP/s per dtype on random operands, elementwise bandwidth; one device has no
   collectives) beside the figures of the device's row in `cost_model/devices.py`
   (`ClusterSpec.from_devices`), plus one float32 matmul at ``precision=HIGHEST`` (the
   profile's float32 matmul runs at XLA's default precision: TF32 on Ampere and later GPUs).
2. **Zoo models, one step each way.**  For each model at its batch: `jax.jit` of the step
   (plain `jax.value_and_grad`, state donated) against `autopar.parallelize` (ShardParallel,
   the cluster of the device), steps taken in turns, medians of ``--steps`` steps after
   two warm-ups; the first step's losses compared; compiled per-device memory
   (`memory_analysis()`: argument + output − alias + temp) of both programs against the
   plan's `predicted.memory_bytes`; the plan's predicted step time under the preset and
   under the profiled cluster (`autopar.plan`, offline) against the measured time; achieved
   FLOP/s (the zoo's analytic FLOPs per step over the measured time).
3. **Micro-batch series** (``--series NAME:BATCH``, ``--micro-batches 1,2,4,8``): the zoo
   model as a one-stage pipeline (``Manual3DParallel(1, 1, 1, k)``) at a fixed batch split
   into k micro-batches, so each series point runs the same layer stack on smaller calls.
   Per k: the measured step against the plan's prediction under the preset and under the
   profiled cluster, the first loss against the single-program `jax.jit` step, and each
   step's growth over k = 1 (measured and predicted): whether the model sees the smaller
   kernels' lower efficiency.

The profile's matmul efficiency sweep (`autopar.cost_model.matmul_sweep`: transformer-shaped
matmuls timed in chains inside one program) is reported per shape with its fraction of the
preset's dense peak: the rows the kernel efficiency table (cost_model/kernel_efficiency.json)
takes for this device kind; so is its convolution sweep (`autopar.cost_model.conv_sweep`:
training passes through two 3x3 convolutions, the table's ``conv`` rows).  ``--sweeps``
chooses which of the two run (``--sweeps conv``: only the convolutions).

Writes ``<out>/gpu-<device kind>[-<tag>].{md,json}`` (default benchmarks/results), the JSON after
every model, so a run cut short keeps what it measured.  A model that fails is reported
with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import re
import time
import traceback
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

import autopar
from autopar.cost_model import ClusterSpec, conv_sweep, hlo_audit, matmul_sweep
from autopar.cost_model.devices import DEVICE_KINDS
from autopar.cost_model.jsonio import write_json_atomic
from autopar.cost_model.profiler import _median_time, profile
from autopar.models import registry
from benchmarks.stamp import stamp, stamp_markdown
from benchmarks.toy import _copy, time_interleaved

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DEFAULT_MODELS = "gpt-125m:8,gpt-350m:8,moe-380m:8,wrn-250m:32"
MATMUL_SIZES = (2048, 4096, 8192)
ELEMENTWISE_BYTES = (2**28, 2**30)
DTYPES = ("float32", "bfloat16", "float16")


def parse_models(text: str) -> list[tuple[str, int]]:
    """"name:batch,name:batch" -> [(name, batch)]; ValueError naming a bad item."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, batch = item.partition(":")
        if name not in registry.CONFIGS or not batch.isdigit() or int(batch) < 1:
            raise ValueError(f"--models item {item!r}: want NAME:BATCH with NAME one of "
                             f"{registry.names()} and BATCH a positive integer")
        out.append((name, int(batch)))
    return out


def parse_counts(text: str, batches: list[int]) -> list[int]:
    """"1,2,4" -> [1, 2, 4]; ValueError unless each is a positive integer dividing every
    batch in `batches`."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items or not all(s.isdigit() and int(s) >= 1 for s in items):
        raise ValueError(f"--micro-batches {text!r}: want positive integers, e.g. 1,2,4,8")
    counts = [int(s) for s in items]
    for b in batches:
        bad = [k for k in counts if b % k]
        if bad:
            raise ValueError(f"--micro-batches {bad} do not divide the series batch {b}")
    return counts


# --- 1. profile ---------------------------------------------------------------------------------


def _highest_f32_matmul(device, m: int, repeats: int) -> float:
    """FLOP/s of an (m, m) @ (m, m) float32 matmul at precision HIGHEST (no TF32)."""
    x = jax.device_put(jax.random.uniform(jax.random.key(1), (m, m), jnp.float32), device)
    fn = jax.jit(lambda a: jnp.dot(a, a, precision=jax.lax.Precision.HIGHEST))
    return 2.0 * m**3 / _median_time(fn, x, repeats)


SWEEPS = {"matmul": matmul_sweep, "conv": conv_sweep}
"""The efficiency sweeps `--sweeps` chooses from, by name."""


def profile_rows(device, preset: ClusterSpec, quick: bool,
                 sweeps: tuple[str, ...] = tuple(SWEEPS)) -> dict[str, Any]:
    """Measured peak FLOP/s per dtype and bandwidth beside the preset's figures, and the
    efficiency sweeps named in `sweeps` (their quick shapes when `quick`)."""
    sizes = (256,) if quick else MATMUL_SIZES
    stream = (2**22,) if quick else ELEMENTWISE_BYTES
    shapes = {name: ((mod.QUICK_SHAPES if quick else mod.GPU_SHAPES) if name in sweeps else ())
              for name, mod in SWEEPS.items()}
    result = profile([device], dtypes=DTYPES, matmul_sizes=sizes, elementwise_bytes=stream,
                     matmul_shapes=shapes["matmul"], conv_shapes=shapes["conv"],
                     repeats=5 if quick else 20)
    rows = []
    for dtype in DTYPES:
        for c in result.compute_samples:
            if c["dtype"] == dtype:
                rows.append({"op": c["op"], "dtype": dtype, "shape": c["shape"],
                             "seconds": c["seconds"], "flops_per_s": c["flops_per_s"],
                             "bytes_per_s": c["bytes_per_s"],
                             "fraction_of_datasheet": (c["flops_per_s"]
                                                       / _datasheet_peak(preset, dtype))})
    m = sizes[-1]
    highest = _highest_f32_matmul(device, m, 5 if quick else 20)
    rows.append({"op": "matmul HIGHEST", "dtype": "float32", "shape": [m, m, m],
                 "seconds": 2.0 * m**3 / highest, "flops_per_s": highest, "bytes_per_s": None})
    measured = result.cluster
    summary = [{"figure": f"{dtype} matmul FLOP/s", "preset": preset.peak_flops_per_s(dtype),
                "measured": measured.peak_flops_per_s(dtype)} for dtype in DTYPES]
    summary.append({"figure": "float32 matmul FLOP/s, precision HIGHEST",
                    "preset": preset.peak_flops_per_s("float32"), "measured": highest})
    summary.append({"figure": "memory bandwidth B/s (read + write)",
                    "preset": preset.memory_bandwidth_bytes_per_s,
                    "measured": measured.memory_bandwidth_bytes_per_s})
    return {"rows": rows, "summary": summary, "cluster": measured}


def _datasheet_peak(preset: ClusterSpec, dtype: str) -> float:
    """The dense datasheet FLOP/s at XLA's default precision of the preset's device kind
    (what kernel_efficiency.json's fractions are of); the preset's figure for kinds without
    a datasheet row (CPU)."""
    kind = DEVICE_KINDS.get(preset.device_kind)
    if kind is None:
        return preset.peak_flops_per_s(dtype)
    flops = kind.default_precision_flops()
    return flops.get(dtype, flops["float32"])


# --- 2. models ----------------------------------------------------------------------------------


def model_row(name: str, batch: int, device, preset: ClusterSpec, measured: ClusterSpec,
              steps: int) -> dict[str, Any]:
    """jax.jit against ShardParallel on `device` for zoo model `name` at `batch`."""
    row: dict[str, Any] = {"model": name, "batch": batch}
    t0 = time.perf_counter()
    step, (abstract_state, abstract_batch) = registry.train_step_and_args(name, batch)
    ref_step = registry.train_step_and_args(name, batch, value_and_grad=jax.value_and_grad)[0]
    with jax.default_device(device):
        state = registry.init_state(name)
        data = registry.example_batch(name, batch)
    row["params"] = registry.param_count(name)
    row["flops_per_step"] = registry.flops_per_step(name, batch)

    jit_step = jax.jit(ref_step, donate_argnums=0)
    jit_mem = hlo_audit.MemoryUsage.of(jit_step.lower(state, data).compile())
    par = autopar.parallelize(step, devices=[device], cluster=preset)
    traced = par.trace(state, data)
    plan = traced.plan
    par_mem = hlo_audit.MemoryUsage.of(traced.lower().compile())
    row["setup_s"] = time.perf_counter() - t0

    programs = {"jit": jit_step, "autopar": par}
    states = {label: _copy(state) for label in programs}
    losses = {}
    for label, run in programs.items():
        states[label], out = run(states[label], data)
        losses[label] = float(out["loss"])
    row["loss_jit"], row["loss_autopar"] = losses["jit"], losses["autopar"]
    row["loss_rel_diff"] = (abs(losses["autopar"] - losses["jit"])
                            / max(abs(losses["jit"]), 1e-30))
    medians = time_interleaved(programs, states, data, steps, warmup=1)   # 2nd warm-up
    jit_s, par_s = medians["jit"], medians["autopar"]
    offline = autopar.plan(step, abstract_state, abstract_batch, cluster=measured)
    stats = device.memory_stats() or {}
    row.update({
        "jit_step_s": jit_s, "autopar_step_s": par_s, "autopar_over_jit": par_s / jit_s,
        "achieved_flops_per_s": row["flops_per_step"] / par_s,
        "predicted_step_s_preset": plan.predicted.step_s,
        "predicted_compute_s_preset": plan.predicted.compute_s,
        "predicted_step_s_profiled": offline.predicted.step_s,
        "predicted_memory_bytes": plan.predicted.memory_bytes,
        "compiled_memory_autopar": _memory_terms(par_mem),
        "compiled_memory_jit": _memory_terms(jit_mem),
        # The allocator's peak over the whole process so far (the state lives three
        # times: the initial copy and each program's): not a per-program figure.
        "process_peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "search_s": plan.solver.get("search_s"),
    })
    return row


# --- 3. micro-batch series ----------------------------------------------------------------------


def series_rows(name: str, batch: int, counts: list[int], device, preset: ClusterSpec,
                measured: ClusterSpec, steps: int) -> Iterator[dict[str, Any]]:
    """One-stage pipelines of zoo model `name` at `batch`: yields one row per micro-batch
    count as it is measured."""
    step, (abstract_state, abstract_batch) = registry.train_step_and_args(name, batch)
    ref_step = registry.train_step_and_args(name, batch, value_and_grad=jax.value_and_grad)[0]
    with jax.default_device(device):
        state = registry.init_state(name)
        data = registry.example_batch(name, batch)
    jit_step = jax.jit(ref_step, donate_argnums=0)
    ref_state, ref_out = jit_step(_copy(state), data)
    ref_loss = float(ref_out["loss"])
    del ref_state
    for k in counts:
        t0 = time.perf_counter()
        row: dict[str, Any] = {"model": name, "batch": batch, "micro_batches": k}
        try:
            method = autopar.Manual3DParallel(dp=1, tp=1, pp=1, num_micro_batches=k)
            plan = autopar.plan(step, abstract_state, abstract_batch, cluster=preset,
                                method=method)
            profiled = autopar.plan(step, abstract_state, abstract_batch, cluster=measured,
                                    method=method)
            par = autopar.parallelize(step, plan=plan, devices=[device])
            programs = {"autopar": par}
            states = {"autopar": _copy(state)}
            states["autopar"], out = par(states["autopar"], data)
            loss = float(out["loss"])
            measured_s = time_interleaved(programs, states, data, steps,
                                          warmup=1)["autopar"]   # 2nd warm-up
            del states
            row.update({"step_s": measured_s, "predicted_step_s_preset": plan.predicted.step_s,
                        "predicted_step_s_profiled": profiled.predicted.step_s,
                        "loss": loss, "loss_jit": ref_loss,
                        "loss_rel_diff": abs(loss - ref_loss) / max(abs(ref_loss), 1e-30),
                        "stages": len(plan.stages)})
        except Exception as e:  # noqa: BLE001 - reported, and the next count runs
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        row["wall_s"] = time.perf_counter() - t0
        print(f"{name} batch {batch} x{k}: {row.get('error') or 'done'} "
              f"in {row['wall_s']:.1f} s", flush=True)
        yield row


def _memory_terms(mem: hlo_audit.MemoryUsage) -> dict[str, int]:
    return {"argument": mem.argument_bytes, "output": mem.output_bytes,
            "alias": mem.alias_bytes, "temp": mem.temp_bytes, "total": mem.total_bytes}


# --- report -------------------------------------------------------------------------------------


def _fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "—" if x is None else f"{x / scale:,.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"# One {env['device_kind']}: profile, step time and memory", "",
             f"`python -m benchmarks.gpu_check` on {env['device_kind']} "
             f"({env['platform']}), jax {env['jax']}, {env['date']}; "
             f"preset compared: `{env['preset']}` (cost_model/devices.py). ", ""]
    if "meta" in report:   # runs before stamps have none
        lines[1:1] = ["", stamp_markdown(report["meta"])]
    prof = report.get("profile")
    if prof:
        lines += ["## Profile against the preset", "",
                  "| figure | preset | measured | measured / preset |", "|---|---:|---:|---:|"]
        for s in prof["summary"]:
            unit = 1e12 if "FLOP" in s["figure"] else 1e9
            name = s["figure"].replace("FLOP/s", "TFLOP/s").replace("B/s", "GB/s")
            lines.append(f"| {name} | {_fmt(s['preset'], unit)} | {_fmt(s['measured'], unit)} "
                         f"| {s['measured'] / s['preset']:.2f} |")
        lines += ["", "Matmul rows: one jitted call each (dispatch and sync included); "
                  "matmul-chain rows: one matmul of a chain inside one program (difference of "
                  "two chain lengths, no dispatch), conv-chain rows: one convolution call of a "
                  "training pass through two 3x3 convolutions (shape: images, side, channels, "
                  "width), the rows of the efficiency table.", "",
                  "| op | dtype | shape | ms | TFLOP/s | GB/s | of datasheet peak |",
                  "|---|---|---|---:|---:|---:|---:|"]
        for r in prof["rows"]:
            frac = r.get("fraction_of_datasheet")
            lines.append(f"| {r['op']} | {r['dtype']} | {'x'.join(map(str, r['shape']))} | "
                         f"{r['seconds'] * 1e3:.3f} | {_fmt(r['flops_per_s'], 1e12, 2)} | "
                         f"{_fmt(r['bytes_per_s'], 1e9)} | "
                         f"{'—' if frac is None or r['op'] == 'elementwise' else f'{frac:.3f}'} |")
        lines.append("")
    models = report.get("models", [])
    if models:
        lines += ["## Train steps: jax.jit against ShardParallel, predictions against the run",
                  "",
                  "| model | batch | jax.jit ms | autopar ms | autopar / jit | loss rel. diff "
                  "| achieved TFLOP/s | predicted ms (preset) | predicted / measured | "
                  "predicted ms (profiled) | predicted / measured |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in models:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['batch']} | error: {r['error']} |")
                continue
            m = r["autopar_step_s"]
            lines.append(
                f"| {r['model']} | {r['batch']} | {r['jit_step_s'] * 1e3:.2f} | {m * 1e3:.2f} | "
                f"{r['autopar_over_jit']:.3f} | {r['loss_rel_diff']:.1e} | "
                f"{_fmt(r['achieved_flops_per_s'], 1e12)} | "
                f"{r['predicted_step_s_preset'] * 1e3:.2f} | "
                f"{r['predicted_step_s_preset'] / m:.2f} | "
                f"{r['predicted_step_s_profiled'] * 1e3:.2f} | "
                f"{r['predicted_step_s_profiled'] / m:.2f} |")
        lines += ["", "Per-device memory, GiB: the plan's prediction against the compiled "
                  "programs (argument + output − alias + temp).", "",
                  "| model | batch | predicted | autopar compiled | predicted / compiled | "
                  "jax.jit compiled |", "|---|---:|---:|---:|---:|---:|"]
        gib = 2.0**30
        for r in models:
            if "error" in r:
                continue
            comp = r["compiled_memory_autopar"]["total"]
            lines.append(
                f"| {r['model']} | {r['batch']} | {_fmt(r['predicted_memory_bytes'], gib, 2)} | "
                f"{_fmt(comp, gib, 2)} | {r['predicted_memory_bytes'] / comp:.2f} | "
                f"{_fmt(r['compiled_memory_jit']['total'], gib, 2)} |")
        lines.append("")
    lines += _series_markdown(report.get("series", []))
    if report.get("notes"):
        lines += ["## Reading the numbers", ""] + [f"- {n}" for n in report["notes"]] + [""]
    return "\n".join(lines)


def _series_markdown(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = ["## Micro-batch series: one-stage pipeline, same batch in k micro-batches", "",
             "Growth: step time over the same series' k = 1 step (measured, and each "
             "prediction over its own k = 1).", "",
             "| model | batch | k | measured ms | predicted ms (preset) | predicted / measured "
             "| predicted ms (profiled) | predicted / measured | growth measured | "
             "growth preset | growth profiled | loss rel. diff vs jit |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    first: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['micro_batches']} | "
                         f"error: {r['error']} |")
            continue
        base = first.setdefault((r["model"], r["batch"]), r)
        m, pre, pro = r["step_s"], r["predicted_step_s_preset"], r["predicted_step_s_profiled"]
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['micro_batches']} | {m * 1e3:.2f} | "
            f"{pre * 1e3:.2f} | {pre / m:.2f} | {pro * 1e3:.2f} | {pro / m:.2f} | "
            f"{m / base['step_s']:.3f} | {pre / base['predicted_step_s_preset']:.3f} | "
            f"{pro / base['predicted_step_s_profiled']:.3f} | {r['loss_rel_diff']:.1e} |")
    return lines + [""]


def write(report: dict[str, Any], out: pathlib.Path) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    stem = "gpu-" + re.sub(r"[^A-Za-z0-9.-]+", "-", report["environment"]["device_kind"]).strip("-")
    if report["environment"].get("tag"):
        stem += "-" + re.sub(r"[^A-Za-z0-9.-]+", "-", report["environment"]["tag"])
    write_json_atomic(out / f"{stem}.json", report)
    (out / f"{stem}.md").write_text(markdown(report))
    return out / f"{stem}.md"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=DEFAULT_MODELS,
                    help=f"NAME:BATCH,... zoo models (default {DEFAULT_MODELS})")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per program")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="results folder")
    ap.add_argument("--quick", action="store_true", help="small profile sizes (for tests)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profile section")
    ap.add_argument("--sweeps", default=",".join(SWEEPS),
                    help=f"efficiency sweeps of the profile, comma-separated from "
                         f"{list(SWEEPS)} (default all; empty: none)")
    ap.add_argument("--tag", default="",
                    help="suffix of the results files' name (default: the device kind only)")
    ap.add_argument("--series", default="",
                    help="NAME:BATCH,... zoo models for the micro-batch series (default none)")
    ap.add_argument("--micro-batches", default="1,2,4,8",
                    help="micro-batch counts of the series (each must divide the batch)")
    args = ap.parse_args(argv)
    models = parse_models(args.models)
    series = parse_models(args.series)
    counts = parse_counts(args.micro_batches, [b for _, b in series])
    sweeps = tuple(filter(None, (s.strip() for s in args.sweeps.split(","))))
    if set(sweeps) - set(SWEEPS):
        ap.error(f"--sweeps {args.sweeps!r}: choose from {list(SWEEPS)}")
    device = jax.devices()[0]
    preset = ClusterSpec.from_devices([device])
    report: dict[str, Any] = {"environment": {
        "device_kind": device.device_kind, "platform": device.platform, "jax": jax.__version__,
        "python": platform.python_version(), "preset": preset.name,
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "tag": args.tag},
        "meta": stamp(), "models": []}
    measured = preset
    if not args.no_profile:
        t0 = time.perf_counter()
        prof = profile_rows(device, preset, args.quick, sweeps)
        measured = prof.pop("cluster")
        # The profiled cluster as `ClusterSpec.load` reads it: plans can be re-priced on it.
        report["profile"] = {**prof, "cluster": measured.to_json(),
                             "wall_s": time.perf_counter() - t0}
        print(f"profile done in {time.perf_counter() - t0:.1f} s", flush=True)
    path = write(report, args.out)
    for name, batch in models:
        t0 = time.perf_counter()
        try:
            row = model_row(name, batch, device, preset, measured, args.steps)
        except Exception as e:  # noqa: BLE001 - reported, and the next model runs
            traceback.print_exc()
            row = {"model": name, "batch": batch,
                   "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        row["wall_s"] = time.perf_counter() - t0
        report["models"].append(row)
        print(f"{name} batch {batch}: {row.get('error') or 'done'} in {row['wall_s']:.1f} s",
              flush=True)
        path = write(report, args.out)
    for name, batch in series:
        for row in series_rows(name, batch, counts, device, preset, measured, args.steps):
            report.setdefault("series", []).append(row)
            path = write(report, args.out)
    print(path.read_text())
    return int(any("error" in r for r in report["models"] + report.get("series", [])))


if __name__ == "__main__":
    raise SystemExit(main())

