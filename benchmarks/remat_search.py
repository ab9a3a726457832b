"""Rematerialization searched by autopar against hand-written plans with it all on and all off
(issue 47).

    python -m benchmarks.remat_search [--cases 8:gpt-2.6b,16:gpt-6.7b,64:gpt-39b]
                                      [--cluster 8x8xV100-16GB] [--output-dir DIR]

Per case of the GPT suite (Alpa's workload: AdamW, float16 parameters with a float32 master
copy, global batch 1,024; `benchmarks.suite.SUITES["gpt"]`), priced by the same step model
side by side in one run:

* **3-D, remat all-on**: the best hand-written 3-D plan (the suite's "Best manual 3-D" grid:
  every dp x tp x pp, micro-batch count and optimizer-state split) of the model with every
  block under `nn.remat` (Alpa's setting, and the suite's);
* **3-D, remat all-off**: the same grid for the model without remat;
* **autopar, remat searched**: the model without remat, planned by
  `PipeshardParallel(num_micro_batches="auto")` (the default `remat="auto"`: the stage search
  rematerializes layers where a stage's memory needs it), with the plan's own prediction
  (the suite's `_autopar_tries`, counts by hand if "auto" finds no plan that fits);

and the ratio of autopar's step to the better of the two hand-written rows, with how many
layers autopar's plan rematerializes.  Writes benchmarks/results/remat_search.{md,json}.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from autopar.cost_model import ClusterSpec
from autopar.cost_model.jsonio import write_json_atomic
from benchmarks.layouts import Evaluation, Pricer, best_fitting, micro_candidates
from benchmarks.stamp import stamp, stamp_markdown
from benchmarks.suite import SUITES, _autopar_tries, baseline_layouts, case_cluster

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
CASES = ((8, "gpt-2.6b"), (16, "gpt-6.7b"), (64, "gpt-39b"))
ROWS = ("3d-remat-on", "3d-remat-off", "autopar")
LABELS = {"3d-remat-on": "3-D, remat all-on", "3d-remat-off": "3-D, remat all-off",
          "autopar": "autopar, remat searched"}
# A ratio within this of 1 is a tie (the suite's `TIE`).
TIE = 1e-5


def _entry(best: Evaluation | None, seconds: float, **extra) -> dict:
    out = {"pricing_s": round(seconds, 2), **extra}
    if best is not None:
        out.update(best.to_json())
    return out


def _fits(entry: dict) -> bool:
    return "step_s" in entry and not entry.get("oom", True)


def _remat_layers(plan: dict) -> tuple[int, int]:
    """(rematerialized layers, layers) of a plan's JSON."""
    layers = [lp for st in plan.get("stages", []) for lp in st.get("layer_plans", [])]
    return sum(1 for lp in layers if lp.get("remat")), len(layers)


def run_case(devices: int, model: str, cluster: ClusterSpec, suite: str = "gpt") -> dict:
    spec = SUITES[suite]
    sub = case_cluster(cluster, devices)
    batch = spec.global_batch
    row: dict = {"devices": devices, "model": model, "rows": {}}
    best_hand: Evaluation | None = None
    for remat in (True, False):
        t0 = time.perf_counter()
        pricer = Pricer(model, batch, sub, overrides=spec.overrides + (("remat", remat),))
        layers = len(pricer.workload(micro_candidates(batch, 1, 1)[0]).layers)
        best, evals = best_fitting(
            pricer, baseline_layouts(devices, sub.devices_per_host, layers, batch)["3d"])
        row["layers"] = layers
        row["rows"][f"3d-remat-{'on' if remat else 'off'}"] = _entry(
            best, time.perf_counter() - t0, tried=len(evals))
        if best is not None and (best_hand is None or best.step_s < best_hand.step_s):
            best_hand = best
    t0 = time.perf_counter()
    pricer = Pricer(model, batch, sub, overrides=spec.overrides + (("remat", False),))
    ev, extra = _autopar_tries(pricer, "autopar", best_hand, sub, batch)
    entry = _entry(ev, time.perf_counter() - t0,
                   **{k: v for k, v in extra.items() if k != "plan"})
    if "plan" in extra:
        entry["remat_layers"], entry["plan_layers"] = _remat_layers(extra["plan"])
    row["rows"]["autopar"] = entry
    hand = [row["rows"][k]["step_s"] for k in ROWS[:2] if _fits(row["rows"][k])]
    row["best_hand_s"] = min(hand) if hand else None
    row["ratio"] = (entry["step_s"] / row["best_hand_s"]
                    if _fits(entry) and row["best_hand_s"] else None)
    return row


def _cell(e: dict) -> str:
    if "step_s" not in e:
        return "no plan"
    zero = ", state split" if e.get("zero_state") else ""
    where = (f" (dp {e['dp']}, tp {e['tp']}, pp {e['pp']}, B {e['micro']}{zero})"
             if e.get("strategy") == "3d" else
             f" ({e['pp']} stages, B {e['micro']}, {e.get('remat_layers', '?')} of "
             f"{e.get('plan_layers', '?')} layers remat)")
    oom = " **OOM**" if e.get("oom") else ""
    return f"{e['step_s']:.2f} s, {e['memory_bytes'] / 2**30:.2f} GiB{oom}{where}"


def markdown(result: dict) -> str:
    lines = ["# Rematerialization searched vs hand-written all-on / all-off", "",
             stamp_markdown(result["meta"]), "",
             f"Cluster {result['cluster']}; the GPT suite's workload "
             f"({result['workload_source']}), global batch {result['global_batch']}.  "
             "Predicted step time and memory per device (the largest stage) of each row, "
             "priced by the same step model in one run; ratio = autopar / the better "
             "hand-written row that fits.", "",
             "| devices | model | " + " | ".join(LABELS[k] for k in ROWS) + " | ratio |",
             "|---|---|" + "---|" * (len(ROWS) + 1)]
    for row in result["rows"]:
        ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "-"
        lines.append(f"| {row['devices']} | {row['model']} | "
                     + " | ".join(_cell(row["rows"][k]) for k in ROWS) + f" | {ratio} |")
    ratios = [r["ratio"] for r in result["rows"] if r["ratio"] is not None]
    lines += ["", f"autopar not slower than the better hand-written plan on "
                  f"{sum(r <= 1 + TIE for r in ratios)} of {len(result['rows'])} cases, "
                  f"strictly faster on {sum(r < 1 - TIE for r in ratios)}; wall "
                  f"{result['wall_s']:.0f} s."]
    done = {f"{r['devices']}:{r['model']}" for r in result["rows"]}
    missing = [c for c in result.get("cases", []) if c not in done]
    if missing:
        lines += ["", f"Not run (the run stopped first): {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(f"{d}:{m}" for d, m in CASES),
                        help="devices:model pairs, comma-separated")
    parser.add_argument("--cluster", default="8x8xV100-16GB")
    parser.add_argument("--output-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    cases = []
    for item in args.cases.split(","):
        devices, _, model = item.partition(":")
        if not devices.isdigit() or not model:
            parser.error(f"--cases: {item!r} is not DEVICES:MODEL")
        cases.append((int(devices), model))
    cluster = ClusterSpec.preset(args.cluster)
    out = pathlib.Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = SUITES["gpt"]
    result = {"meta": stamp(), "cluster": cluster.name, "global_batch": spec.global_batch,
              "workload_source": spec.source, "wall_s": 0.0, "rows": [],
              "cases": [f"{d}:{m}" for d, m in cases]}
    t0 = time.perf_counter()
    for devices, model in cases:
        result["rows"].append(run_case(devices, model, cluster))
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"[{result['wall_s']:7.1f}s] {devices} x {model}: ratio "
              f"{result['rows'][-1]['ratio']}", file=sys.stderr, flush=True)
        # Written after every case (an interrupted run keeps the cases it finished; the
        # md says which are missing).
        write_json_atomic(out / "remat_search.json", result)
        (out / "remat_search.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
