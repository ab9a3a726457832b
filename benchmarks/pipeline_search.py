"""Plan-search time of the pipeline planner (issue: inter-op pass and pipeline runtime).

    python -m benchmarks.pipeline_search [--skip-large]

Measures, in one run: PipeshardParallel search for the test suite's small GPT on 8 emulated
CPU devices (cost model `cpu-local`), and for a 24-layer GPT-1.3B (abstract shapes only) on
the `2x8xA100-80GB` preset.  Writes benchmarks/results/pipeline_search.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import autopar  # noqa: E402
from autopar import models as zoo  # noqa: E402
from benchmarks.stamp import stamp, stamp_markdown  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _case(name: str, cluster: str, batch: int, micro: int) -> dict:
    step, args = zoo.train_step_and_args(name, batch)
    t0 = time.perf_counter()
    plan = autopar.plan(step, *args, cluster=cluster,
                        method=autopar.PipeshardParallel(num_micro_batches=micro))
    seconds = time.perf_counter() - t0
    return {
        "model": name, "cluster": cluster, "batch": batch, "micro_batches": micro,
        "search_s": round(seconds, 2), "layers": plan.solver.get("layers"),
        "layer_solves": plan.solver.get("layer_solves"),
        "stages": [{"layers": list(st.layers), "devices": len(st.device_ids),
                    "mesh": list(st.mesh_shape), "ms": round(st.predicted_s * 1e3, 3)}
                   for st in plan.stages],
        "predicted_step_s": plan.predicted.step_s,
        "summary": plan.summary(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-large", action="store_true", help="only the small GPT")
    args = parser.parse_args(argv)
    assert len(jax.devices()) >= 8
    rows = [_case("gpt-toy", "cpu-local", 64, 4)]
    if not args.skip_large:
        rows.append(_case("gpt-1.3b", "2x8xA100-80GB", 1024, 64))
    meta = stamp()
    lines = ["# Pipeline plan search time", "", stamp_markdown(meta), "",
             "One run on this 2-core machine; search = layering + per-layer intra-op ILPs + "
             "stage DP + per-stage ILPs (abstract shapes, no devices of the target cluster).", "",
             "| model | cluster | batch | micro-batches | layers | layer ILPs | search (s) | "
             "stages (layers: devices, mesh) | predicted step (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        stages = "; ".join(f"{s['layers'][0]}-{s['layers'][1]}: {s['devices']} {tuple(s['mesh'])}"
                           for s in r["stages"])
        lines.append(f"| {r['model']} | {r['cluster']} | {r['batch']} | {r['micro_batches']} | "
                     f"{r['layers']} | {r['layer_solves']} | {r['search_s']} | {stages} | "
                     f"{r['predicted_step_s'] * 1e3:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline_search.md").write_text(text)
    (RESULTS / "pipeline_search.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
