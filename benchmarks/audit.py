"""Audits a suite's autopar plans against what XLA builds (issue 6, metric 4).

    python -m benchmarks.audit benchmarks/results/gpt-8x8xV100-16GB.json

For every case whose plan fits on this machine's devices (at most 8 emulated CPU devices:
the 1-, 2-, 4- and 8-device cases), the saved plan is replayed with abstract arguments, every
program of its step is compiled on the same mesh shapes, and the compiled HLO is read back
(`autopar.cost_model.hlo_audit`): collective bytes by kind over one step
(`PipelineCompiled.collective_bytes_per_step`: each program times its calls, loops times
their trip counts) and the largest stage's compiled peak per device
(`PipelineCompiled.stage_memory_bytes`), next to the planner's stage memory.  Compiling
needs no memory for the weights.
The results go into the suite's JSON (`rows[i]["audit"]`) and its markdown.

XLA:CPU schedules with its memory-minimizing scheduler here (SCHEDULER_FLAG): its default,
concurrency-optimized scheduler runs independent work early for parallelism and holds
far more at once (the 1-device GPT-350M step of the V100 suite: 48.4 GiB against 25.4 GiB
under the memory scheduler, 11.9 GiB planned).  GPU XLA schedules under a memory limit,
so the memory scheduler is the closer stand-in for the programs the plans were priced for.
"""

from __future__ import annotations

import os
import sys
import time

SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if SCHEDULER_FLAG.split("=")[0] not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + SCHEDULER_FLAG

import jax  # noqa: E402

import autopar  # noqa: E402
from autopar import models as zoo  # noqa: E402
from autopar.cost_model import ClusterSpec  # noqa: E402
from autopar.plan import Plan  # noqa: E402
from benchmarks import suite  # noqa: E402


def audit_case(row: dict, cluster: ClusterSpec, global_batch: int,
               overrides: dict | None = None) -> dict | None:
    """Compiles the case's autopar plan (the zoo model with the suite's config `overrides`)
    on emulated devices; None if it does not fit."""
    n = row["devices"]
    entry = row["strategies"].get("autopar", {})
    if "plan" not in entry or n > len(jax.devices()):
        return None
    plan = Plan.from_json(entry["plan"])
    sub = suite.case_cluster(cluster, n)
    step, args = zoo.train_step_and_args(row["model"], global_batch, overrides=overrides)
    t0 = time.perf_counter()
    par = autopar.parallelize(step, plan=plan, devices=jax.devices()[:n], cluster=sub)
    compiled = par.lower(*args).compile()
    by_kind = compiled.collective_bytes_per_step()
    memory = max(compiled.stage_memory_bytes())
    return {"collective_bytes": by_kind, "compiled_memory_bytes": memory,
            "compile_s": round(time.perf_counter() - t0, 1),
            "xla_flags": os.environ["XLA_FLAGS"]}


def run(path: str | os.PathLike) -> dict:
    """Audits every case of a suite's JSON that fits here; rewrites the JSON and markdown."""
    return suite.annotate(path, "audit", audit_case, "audit_meta")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        run(p)
