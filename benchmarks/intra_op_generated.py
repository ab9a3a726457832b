"""autopar's intra-op plans on generated models it was not tuned on, against data parallel.

`python -m benchmarks.intra_op_generated [--seeds 12] [--start 0] [--runs bytes:4,local:4,...]`

`benchmarks.intra_op_reference` holds ShardParallel to Alpa's hand-written plans on Alpa's own
test models; this checks the same claims on the seeded models of tests/generated.py (MLPs,
attention blocks, conv + BatchNorm, mixture-of-experts, tied embeddings, `nn.scan`; seed s
is family s % 6, everything else drawn from the seed).  Each case is planned and compiled
with `ShardParallel` on 4 emulated CPU devices, and so is its data-parallel plan
(parameters and optimizer state replicated, the batch split over every mesh axis) as a
`jax.jit` program from the same input layouts.  A run "<cluster>:<mesh>" plans under
cluster "bytes" (the communication-only cluster of `intra_op_reference`: α = 0, β = 1
s/byte, free compute) or "local" (this machine's cost model, `ClusterSpec.from_devices`:
compute and latency priced too) on mesh 4 = (4,) or 2x2 = (2, 2); "/mb2" adds 2
micro-batches, against the data-parallel step that accumulates the same 2 micro-batches.
Both compiled programs are priced by one model from their HLO (`cost_model.hlo_audit`:
collectives by the α-β model with XLA:CPU's lowerings, compute from XLA's FLOP and byte
counts); the ratio is autopar's step over data parallel's (communication only under
"bytes"; compute + communication under "local").  Data parallel is a valid plan for every
case, so a search that prices programs as compiled never needs more.  Per run it also
reports autopar's predicted communication over its compiled one (how well the plan is
priced), the fallbacks the trace reported, and whether 2 optimizer steps equal the
single-device `jax.jit` steps at tests/generated.py's tolerances.

Writes benchmarks/results/intra_op_generated.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # before any JAX import: 8 emulated devices (4 used)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("AUTOPAR_CACHE_DIR", "")  # plan afresh, write nothing into $HOME

import jax
import numpy as np

import autopar
from autopar.cost_model import ClusterSpec
from benchmarks import alpa_cases as ac
from benchmarks import intra_op_reference as ref
from benchmarks.stamp import stamp
from benchmarks.toy import micro_batched_value_and_grad, run_steps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import generated  # noqa: E402  (tests/generated.py: the seeded model generator)

RUNS = {"bytes:4": ("bytes", (4,), 1), "bytes:2x2": ("bytes", (2, 2), 1),
        "bytes:4/mb2": ("bytes", (4,), 2), "local:4": ("local", (4,), 1),
        "local:4/mb2": ("local", (4,), 2)}
STEPS = 2


def _ratio(a: float, b: float) -> float:
    """a / b, with 0 / 0 = 1."""
    return a / b if b > 0 else (1.0 if a == 0 else float("inf"))


def local_cluster() -> ClusterSpec:
    """This machine's cost model for its first 4 devices."""
    return ClusterSpec.from_devices(jax.devices()[:ref.DEVICES])


CLUSTERS = {"bytes": ref.comm_only_cluster, "local": local_cluster}


def run_one(case: generated.Case, run: str, time_limit_s: float) -> dict:
    """One case on one run of RUNS: the data-parallel reference and autopar, audited; autopar's
    `STEPS` steps against the single-device jitted ones."""
    cluster_name, shape, micro = RUNS[run]
    cluster = CLUSTERS[cluster_name]()
    mesh = ref.mesh_of(shape)
    grad = jax.value_and_grad if micro == 1 else micro_batched_value_and_grad(micro)
    state, batch = case.init(), case.batch(0)
    dp = ref.run_reference(ac.Built(case.make_step(grad), state, batch), "dp", mesh, cluster)
    method = autopar.ShardParallel(mesh_shape=shape, time_limit_s=time_limit_s,
                                   num_micro_batches=micro)
    par = autopar.parallelize(case.step, method=method, devices=jax.devices()[:ref.DEVICES],
                              cluster=cluster, donate_argnums=())
    t0 = time.perf_counter()
    plan = par.get_plan(state, batch)
    plan_s = time.perf_counter() - t0
    compiled = par.lower(state, batch).compile()
    mine = ref.audit_compiled(compiled, plan.mesh_shape, plan.mesh_axes, plan.device_ids, cluster)
    measure = "comm_bytes_s" if cluster_name == "bytes" else "total_s"
    got = run_steps(par, case.init(), [case.batch(i) for i in range(STEPS)])
    same = generated.compare(generated.reference(case, micro, STEPS),
                             (jax.device_get(got[0]), got[1]), **case.tol)
    fallbacks = getattr(par.trace(state, batch), "fallbacks", ())
    ratio = _ratio(mine[measure], dp[measure])
    priced = _ratio(plan.predicted.comm_s, mine["comm_bytes_s"])
    return {"case": case.name, "family": case.family, "seed": case.seed, "run": run,
            "measure": measure, "config": dict(case.config), "autopar": {**mine, "predicted_comm_s":
                                                     plan.predicted.comm_s, "plan_s": plan_s},
            "dp": dp, "ratio": ratio, "meets": ratio <= ref.GOAL,
            "predicted_over_compiled": priced, "equal": same["equal"],
            "err_over_tol": same["err_over_tol"], "fallbacks": [str(f) for f in fallbacks]}


def _summary(rows: list[dict]) -> dict:
    ratios = [r["ratio"] for r in rows]
    priced = [r["predicted_over_compiled"] for r in rows
              if np.isfinite(r["predicted_over_compiled"])]
    return {"runs": len(rows), "meets": sum(r["meets"] for r in rows),
            "equal": sum(r["equal"] for r in rows),
            "fallbacks": sum(bool(r["fallbacks"]) for r in rows),
            "worst_ratio": max(ratios, default=float("nan")), "median_ratio": ref.median(ratios),
            "priced_low": min(priced, default=float("nan")),
            "priced_high": max(priced, default=float("nan")),
            "priced_median": ref.median(priced)}


def _family_table(rows: list[dict]) -> list[str]:
    lines = ["| family | runs | within goal | worst ratio | median ratio | predicted / compiled "
             "communication (median; lowest, highest) |", "|---|---|---|---|---|---|"]
    for fam in sorted({r["family"] for r in rows}):
        f = _summary([r for r in rows if r["family"] == fam])
        lines.append(f"| {fam} | {f['runs']} | {f['meets']} | {f['worst_ratio']:.3f} | "
                     f"{f['median_ratio']:.3f} | {f['priced_median']:.3f}; "
                     f"{f['priced_low']:.3f}, {f['priced_high']:.3f} |")
    return lines


def markdown(rows: list[dict], meta: dict, wall_s: float) -> str:
    s = _summary(rows)
    lines = [
        *ref.page_head("Intra-op plans on generated models against data parallel", meta,
                       __doc__),
        "",
        f"**{s['meets']} of {s['runs']} runs within {ref.GOAL:.2f}x of the data-parallel "
        f"plan** (worst {s['worst_ratio']:.3f}x, median {s['median_ratio']:.3f}x); "
        f"{s['equal']} of {s['runs']} equal to the single-device jax.jit steps; "
        f"{s['fallbacks']} with a reported fallback. {wall_s / 60:.1f} min in all.",
    ]
    for name in sorted({r["run"].split(":")[0] for r in rows}):
        part = [r for r in rows if r["run"].startswith(name + ":")]
        p = _summary(part)
        lines += ["", f"## Cluster {name}: {p['meets']} of {p['runs']} within the goal, worst "
                      f"{p['worst_ratio']:.3f}x, median {p['median_ratio']:.3f}x; predicted / "
                      f"compiled communication median {p['priced_median']:.3f} (lowest "
                      f"{p['priced_low']:.3f}, highest {p['priced_high']:.3f})", ""]
        lines += _family_table(part)
    lines += [
        "",
        "Over the goal: " + ("; ".join(f"{r['case']} on {r['run']} {r['ratio']:.3f}x"
                                        for r in rows if not r["meets"]) or "none") + ".",
        "",
        "Communication in α-β seconds (under bytes: bytes), step = compute + communication of "
        "the compiled program, both from `hlo_audit`.",
        "",
        "| case | run | autopar collectives | comm | step | data-parallel collectives | comm "
        "| step | ratio | predicted / compiled comm | equal | fallbacks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, d = r["autopar"], r["dp"]
        lines.append(
            f"| {r['case']} | {r['run']} | {ref.counts_text(a['counts'])} | "
            f"{a['comm_bytes_s']:.4g} | {a['total_s']:.4g} | {ref.counts_text(d['counts'])} | "
            f"{d['comm_bytes_s']:.4g} | {d['total_s']:.4g} | {r['ratio']:.3f} | "
            f"{r['predicted_over_compiled']:.3f} | {'yes' if r['equal'] else 'NO'} | "
            f"{len(r['fallbacks'])} |")
    lines += ["", "Configurations:", ""]
    lines += [f"- {generated.generate(seed).description}"
              for seed in sorted({r["seed"] for r in rows})]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=12, help="cases generate(start..start+n)")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--time-limit", type=float, default=10.0,
                        help="ShardParallel's solver limit per mesh, seconds")
    parser.add_argument("--out", type=Path, default=ref.RESULTS)
    args = parser.parse_args(argv)
    runs = args.runs.split(",")
    if set(runs) - set(RUNS):
        parser.error(f"unknown runs {sorted(set(runs) - set(RUNS))}; known: {list(RUNS)}")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: expected at least 1")
    if len(jax.devices()) < ref.DEVICES:
        parser.error(f"needs {ref.DEVICES} devices, {len(jax.devices())} found")
    rows, start = [], time.perf_counter()
    for seed in range(args.start, args.start + args.seeds):
        case = generated.generate(seed)
        for run in runs:
            if case.batch_size % (RUNS[run][2] * ref.DEVICES):
                continue
            row = run_one(case, run, args.time_limit)
            rows.append(row)
            a = row["autopar"]
            print(f"{case.name:16} {run:12} autopar comm {a['comm_bytes_s']:.4g} step "
                  f"{a['total_s']:.4g}  dp comm {row['dp']['comm_bytes_s']:.4g} step "
                  f"{row['dp']['total_s']:.4g}  ratio {row['ratio']:.3f}  priced "
                  f"{row['predicted_over_compiled']:.3f}  equal {row['equal']}  fallbacks "
                  f"{len(row['fallbacks'])}", flush=True)
        generated.clear_references()
    meta = stamp()
    wall = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "intra_op_generated.md").write_text(markdown(rows, meta, wall))
    (args.out / "intra_op_generated.json").write_text(json.dumps(
        {"meta": meta, "goal": ref.GOAL, "wall_s": wall, "summary": _summary(rows),
         "rows": rows}, indent=1) + "\n")
    return 0 if all(r["meets"] and r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
