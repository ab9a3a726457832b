"""Multi-process pipelines over process counts x stages x batch shardings (issue 45): each
run is `tests/multihost_scripts/user_pipeline.py` under `autopar launch` (a 4-layer MLP
under PipeshardParallel, 3 Adam steps, the loss read with `float` on every process after
the last step), checked against the single-device `jax.jit` step.

    python -m benchmarks.multiprocess_fuzz [--runs 36] [--seed 0] [--timeout-s 240]
                                           [--output-dir DIR]

Run i draws, from `seed + i`: the layout (2 processes x 4 CPU devices or 4 x 2), the stage
count (1, 2 or 4), the batch's sharding (split over every device, replicated, one row block
per process), where the state comes from (`autopar.place` on `init_state()`, or a checkpoint
through `Checkpoints.restore_into`) and how the processes join (`autopar.distributed.
initialize` or `jax.distributed.initialize` directly); every combination of layout, stages
and batch comes once in every 18 runs.  Outcomes: equal (every process's losses and the
final parameters within tests/multihost.py's tolerance of the reference), differ, error (a
non-zero exit: the launcher's summary and the first error line of the rank that failed
first), hang (the launcher's wall-clock limit `--timeout-s` struck).

Prints the table and writes benchmarks/results/multiprocess_fuzz.md and .json (stamped
with the commit and the command).  Exit status 1 when any run differs, errors or hangs.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import pathlib
import random
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from benchmarks.stamp import stamp, stamp_markdown

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SCRIPT = ROOT / "tests" / "multihost_scripts" / "user_pipeline.py"
LAYOUTS = ((2, 4), (4, 2))          # (processes, CPU devices per process)
STAGES = (1, 2, 4)
BATCHES = ("split", "replicated", "rows")
STATES = ("place", "restore")
INITS = ("autopar", "jax")
TOL = {"rtol": 1e-3, "atol": 1e-4}  # tests/multihost.py TOL (reduction order differs)
STEPS = 3


def draws(runs: int, seed: int) -> list[dict]:
    """The runs' settings: layout x stages x batch cycled (shuffled by `seed`), state and
    init drawn per run."""
    grid = list(itertools.product(LAYOUTS, STAGES, BATCHES))
    rng = random.Random(seed)
    rng.shuffle(grid)
    out = []
    for i in range(runs):
        (processes, devices), stages, batch = grid[i % len(grid)]
        r = random.Random(seed + i)
        out.append({"run": i, "processes": processes, "devices": devices, "stages": stages,
                    "batch": batch, "state": r.choice(STATES), "init": r.choice(INITS)})
    return out


def reference() -> tuple[list[float], dict[str, np.ndarray]]:
    """The script's single-device jax.jit reference (`user_pipeline.reference`)."""
    spec = importlib.util.spec_from_file_location("user_pipeline", SCRIPT)
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    return user.reference(STEPS)


def run_one(cfg: dict, ref: tuple, timeout_s: float) -> dict:
    from autopar.launch import launch, python_command

    ref_losses, ref_params = ref
    with tempfile.TemporaryDirectory(prefix="autopar-mpfuzz-") as tmp:
        out = pathlib.Path(tmp)
        args = [str(out), "--stages", str(cfg["stages"]), "--batch", cfg["batch"],
                "--state", cfg["state"], "--init", cfg["init"], "--steps", str(STEPS)]
        t0 = time.perf_counter()
        result = launch(python_command(str(SCRIPT), args), cfg["processes"],
                        devices_per_process=cfg["devices"], timeout_s=timeout_s, cwd=ROOT)
        row = {**cfg, "wall_s": time.perf_counter() - t0}
        if result.returncode != 0:
            hung = result.timed_out
            first = result.failed_rank if result.failed_rank is not None else 0
            lines = [ln for ln in result.output(first).splitlines()
                     if "Error" in ln or "error" in ln]
            return {**row, "outcome": "hang" if hung else "error",
                    "detail": (lines[-1] if lines else result.summary().splitlines()[0])[:300]}
        infos = [json.loads((out / f"rank{k}.json").read_text())
                 for k in range(cfg["processes"])]
        result_npz = np.load(out / "result.npz", allow_pickle=False)
        try:
            for info in infos:
                np.testing.assert_allclose(info["losses"], ref_losses, **TOL)
            for name, value in ref_params.items():
                np.testing.assert_allclose(result_npz[name], value, err_msg=name, **TOL)
        except AssertionError as err:
            return {**row, "outcome": "differ", "detail": str(err).strip().splitlines()[0]}
        return {**row, "outcome": "equal", "detail": "",
                "plan_stages": infos[0]["stages"],
                "steps_s": max(i["steps_s"] for i in infos),
                "place_s": max(i["place_s"] for i in infos)}


def markdown(meta: dict, settings: dict, rows: list[dict], wall_s: float) -> str:
    counts = {o: sum(r["outcome"] == o for r in rows) for o in ("equal", "differ", "error",
                                                                 "hang")}
    walls = sorted(r["wall_s"] for r in rows)
    lines = [
        "# Multi-process pipelines: process counts x stages x batch shardings", "",
        stamp_markdown(meta), "",
        f"{len(rows)} runs ({settings}), {wall_s:.0f} s in all. "
        f"Tally: {', '.join(f'{k} {v}' for k, v in counts.items())}. "
        f"Wall time per run (launch to exit): median {walls[len(walls) // 2]:.1f} s, "
        f"worst {walls[-1]:.1f} s.", "",
        "| run | processes x devices | stages (plan) | batch | state | init | outcome | "
        "wall s | steps s | detail |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['processes']} x {r['devices']} | {r['stages']} "
            f"({r.get('plan_stages', '-')}) | {r['batch']} | {r['state']} | {r['init']} | "
            f"{r['outcome']} | {r['wall_s']:.1f} | "
            f"{r['steps_s']:.2f} | {r['detail']} |" if "steps_s" in r else
            f"| {r['run']} | {r['processes']} x {r['devices']} | {r['stages']} | "
            f"{r['batch']} | {r['state']} | {r['init']} | {r['outcome']} | "
            f"{r['wall_s']:.1f} | - | {r['detail']} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=36)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=240.0)
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.timeout_s <= 0:
        parser.error("--runs must be positive and --timeout-s > 0")
    ref = reference()
    rows = []
    t0 = time.perf_counter()
    for cfg in draws(args.runs, args.seed):
        row = run_one(cfg, ref, args.timeout_s)
        rows.append(row)
        print(f"run {row['run']}: {row['processes']}x{row['devices']} {row['stages']} stages "
              f"{row['batch']} {row['state']} {row['init']}: {row['outcome']} "
              f"{row['wall_s']:.1f} s {row['detail']}", flush=True)
    wall_s = time.perf_counter() - t0
    settings = {"runs": args.runs, "seed": args.seed, "timeout_s": args.timeout_s}
    meta = stamp()
    text = markdown(meta, settings, rows, wall_s)
    print(text)
    from autopar.cost_model.jsonio import write_json_atomic

    out_dir = pathlib.Path(args.output_dir) if args.output_dir else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / "multiprocess_fuzz.json",
                      {"meta": meta, "settings": settings, "wall_s": wall_s, "runs": rows})
    tmp = out_dir / "multiprocess_fuzz.md.tmp"
    tmp.write_text(text)
    tmp.replace(out_dir / "multiprocess_fuzz.md")
    return 1 if any(r["outcome"] != "equal" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
