"""Cost-model accuracy: the planner's predictions against the compiled programs, over
distinct plans.

    python -m benchmarks.cost_model_accuracy [--quick] [--models mlp,gpt,moe,wrn]

Models (8 emulated CPU devices): the MLP and small GPT of tests/models.py, and the zoo's
moe-toy (GShard MoE) and wrn-toy (Wide-ResNet, convolutions) at batch 16.  Plans, all
searched for the ``8xA100-80GB`` preset and compiled for the CPU devices:

* data parallel and ZeRO-3 (1-D mesh of 8);
* Megatron-style tensor parallel (benchmarks/baselines.MegatronTP) and ShardParallel on
  the logical meshes 1x8, 2x4 and 8x1 (MLP and GPT);
* the planner's own choice, ShardParallel(), unconstrained and under memory budgets that
  force it to shard more: BUDGET_FRACTIONS of the unconstrained plan's predicted memory,
  down to what still fits (a budget below MIN_BUDGET_OVER_FLOOR x the smallest plan the
  search can find is not tried), on the
  logical mesh the unconstrained plan chose (a budgeted search of every mesh, each
  checked against its compiled peak, takes minutes per model on 2 cores);
* pipelines: PipeshardParallel(num_stages=2) and (not for the MoE, to keep the run short)
  Manual3DParallel(dp=2, tp=2, pp=2), MICRO micro-batches each.

For every plan, the compiled program is audited (cost_model/hlo_audit) against the plan:

* communication volume: the plan's own layout re-priced on a cluster whose links are α=0,
  β=1 s/byte and whose compute is free, against the audit priced on that cluster — both
  are Σ over collectives of the α-β byte term (e.g. 2(n−1)/n·S for an all-reduce), one
  definition on both sides.  Single mesh: `intra_op.price_specs`.  Pipelines: every
  layer's solution re-priced as the stage search priced it (`pipeline_search.price_stage`
  with the plan's layout in place of a search: gradient reductions once per step,
  resharding between layers, the ZeRO-2 all-gathers after the update), per step, against
  `PipelineCompiled`'s programs times their calls; moves between stages are `device_put`s,
  not collectives, and are left out on both sides;
* per-device memory, compiled under both XLA:CPU schedulers: the default
  (concurrency-optimized) one and `--xla_cpu_enable_concurrency_optimized_scheduler=false`
  (benchmarks/audit.py's).  XLA reads XLA_FLAGS once per process, so the second is a
  subprocess of this script that compiles the same plans (saved as JSON, replayed with
  `parallelize(plan=...)`) and reports their memory.  Single mesh: `memory_analysis()`'s
  argument + output − alias + temp; pipelines: every stage's
  `PipelineCompiled.stage_memory_bytes()`.  The prediction is the plan's layout under the
  rules of the backend that compiles it (XLA:CPU's fusion and buffer rules, the plan
  cluster with device_kind "cpu"); the plan's own figure (GPU rules, searched under) is
  reported beside it;
* step time: the plan's predicted step against the audit priced on 8xA100-80GB (pipelines:
  the planner's step formula Σ t_s + (B − 1)·max t_s over the audited stage programs, with
  the plan's priced copies between stages added, as HLO has none: the re-layouts around a
  copy run inside the stage programs and are audited there).

Distinct plans: two plans of a model count once when their layouts are the same (the
plan's specs with mesh axes named by their place in the device order, so 1x8, 8x1 and 8
name one layout) or when their audits are (collectives, FLOPs and memory terms of every
compiled program): the summary counts within-tolerance figures over distinct plans and
lists which cases collapsed into which.

Part 2 (MLP and GPT): plans searched for ``cpu-local`` run, predicted step time against
the median of timed steps (the machine's load average is recorded: other jobs make it
noisy).

Writes benchmarks/results/cost_model_accuracy.{md,json,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
import jax  # noqa: E402
import numpy as np  # noqa: E402

import autopar  # noqa: E402
from autopar import models as zoo  # noqa: E402
from autopar import pipeline, pipeline_search  # noqa: E402
from autopar.cost_model import ClusterSpec, Link, compile_log, hlo_audit  # noqa: E402
from autopar.passes import intra_op, primitives  # noqa: E402
from autopar.passes.sharding_spec import MeshContext  # noqa: E402
from autopar.plan import Plan  # noqa: E402
from benchmarks.baselines import MegatronTP, input_names  # noqa: E402
from benchmarks.stamp import stamp, stamp_markdown  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))
import models  # noqa: E402

PLAN_CLUSTER = "8xA100-80GB"
MESHES = ((1, 8), (2, 4), (8, 1))
TIME_LIMIT_S = 20.0
BUDGET_TIME_LIMIT_S = 5.0   # per solve; --quick: QUICK_BUDGET_TIME_LIMIT_S
QUICK_BUDGET_TIME_LIMIT_S = 2.0
PIPELINE_TIME_LIMIT_S = 5.0
MICRO = 4
BUDGET_FRACTIONS = (0.75, 0.5)
MIN_BUDGET_OVER_FLOOR = 1.1
MODELS = ("mlp", "gpt", "moe", "wrn")
QUICK_MODELS = ("mlp", "gpt")
TOLERANCES = {"memory": 0.10, "bytes": 0.15, "time": 0.25}

SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
_SCHEDULER_OPTION = re.compile(r"--xla_cpu_enable_concurrency_optimized_scheduler=(\S*)")
SCHEDULERS = ("concurrency", "memory")
SCHEDULER_NAMES = {"concurrency": "default (concurrency-optimized)",
                   "memory": "`--xla_cpu_enable_concurrency_optimized_scheduler=false`"}
REPLAY_TIMEOUT_S = 1200.0


def scheduler_of(xla_flags: str) -> str:
    """The XLA:CPU scheduler `xla_flags` selects: "memory" where the concurrency-optimized
    one is turned off, else "concurrency" (XLA:CPU's default)."""
    found = _SCHEDULER_OPTION.findall(xla_flags)
    return "memory" if found and found[-1].lower() in ("false", "0") else "concurrency"


def flags_for(scheduler: str, xla_flags: str) -> str:
    """`xla_flags` changed to select `scheduler`."""
    base = _SCHEDULER_OPTION.sub("", xla_flags).split()
    return " ".join(base + ([SCHEDULER_FLAG] if scheduler == "memory" else []))


def cpu_backend(base: ClusterSpec) -> ClusterSpec:
    """`base` compiled by XLA:CPU: the same figures, XLA:CPU's fusion and memory rules."""
    return dataclasses.replace(base, name=f"{base.name}-xla-cpu", device_kind="cpu")


def byte_cluster(base: ClusterSpec) -> ClusterSpec:
    """α = 0, β = 1 s/byte on every link, free compute: seconds = α-β byte volume."""
    return _comm_only(base, "bytes", Link(0.0, 1.0), Link(0.0, 1.0))


def latency_cluster(base: ClusterSpec) -> ClusterSpec:
    """`base`'s latencies (α), β = 0, free compute: seconds = the collectives' α terms."""
    return _comm_only(base, "latency", Link(base.intra_host.alpha_s, 0.0),
                      Link(base.inter_host.alpha_s, 0.0))


def _comm_only(base: ClusterSpec, tag: str, intra: Link, inter: Link) -> ClusterSpec:
    huge = 1e30
    return dataclasses.replace(
        base, name=f"{base.name}-{tag}", intra_host=intra, inter_host=inter,
        peak_flops={k: huge for k in base.peak_flops}, memory_bandwidth_bytes_per_s=huge)


# --- models and plans ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Model:
    """A train step and its arguments: `args()` gives (state, batch), concrete arrays where
    `runs` (timed in part 2), else `jax.ShapeDtypeStruct`s (planned and compiled only)."""

    name: str
    step: Callable
    args: Callable[[], tuple]
    describe: str
    runs: bool


def _test_model(name: str, builder: Callable, **kw) -> Model:
    case = builder(**kw)
    described = f"tests/models.{builder.__name__}({', '.join(f'{k}={v}' for k, v in kw.items())})"
    return Model(name, case.step, case.init, described, True)


def _zoo_model(name: str, zoo_name: str, batch: int) -> Model:
    step, args = zoo.train_step_and_args(zoo_name, batch)
    return Model(name, step, lambda: args, f"zoo `{zoo_name}` at batch {batch}", False)


def make_models(quick: bool, names: Sequence[str]) -> dict[str, Model]:
    builders = {
        "mlp": lambda: _test_model("mlp", models.mlp_case, **(
            dict(batch=64, hidden=128, layers=2) if quick
            else dict(batch=256, hidden=512, layers=2))),
        "gpt": lambda: _test_model("gpt", models.gpt_case, **(
            dict(batch=8, seq=16, hidden=64, heads=8, vocab=128) if quick
            else dict(batch=16, seq=32, hidden=128, heads=8, vocab=256))),
        "moe": lambda: _zoo_model("moe", "moe-toy", 16),
        "wrn": lambda: _zoo_model("wrn", "wrn-toy", 16),
    }
    unknown = [n for n in names if n not in builders]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known: {', '.join(builders)}")
    return {n: builders[n]() for n in names}


def methods(model: str, names: tuple[str, ...], quick: bool) -> list[tuple[str, object]]:
    """(label, method) of the fixed plans of `model`; the budgeted plans follow "auto"."""
    out: list[tuple[str, object]] = [("dp", autopar.DataParallel(time_limit_s=TIME_LIMIT_S))]
    if not quick:
        out.append(("zero3", autopar.Zero3Parallel(time_limit_s=TIME_LIMIT_S)))
    if model in ("mlp", "gpt"):
        for shape in MESHES[:1] if quick else MESHES:
            tag = f"{shape[0]}x{shape[1]}"
            out.append((f"tp {tag}", MegatronTP(mesh_shape=shape, input_names=names,
                                                time_limit_s=TIME_LIMIT_S)))
            out.append((f"auto {tag}", autopar.ShardParallel(mesh_shape=shape,
                                                             time_limit_s=TIME_LIMIT_S)))
    out.append(("auto", autopar.ShardParallel(time_limit_s=TIME_LIMIT_S)))
    if model != "mlp" or not quick:
        out.append((f"pipeshard 2 stages B={MICRO}", autopar.PipeshardParallel(
            num_stages=2, num_micro_batches=MICRO, time_limit_s=PIPELINE_TIME_LIMIT_S)))
    if not quick and model != "moe":
        out.append((f"3d 2x2x2 B={MICRO}", autopar.Manual3DParallel(
            dp=2, tp=2, pp=2, num_micro_batches=MICRO, time_limit_s=PIPELINE_TIME_LIMIT_S)))
    return out


def _ratio(pred: float, actual: float) -> float:
    if actual == 0:
        return 1.0 if pred == 0 else math.inf
    return pred / actual


def plan_and_compile(step_fn, method, cluster, args, logged: bool = True):
    step = autopar.parallelize(step_fn, method=method, cluster=cluster, donate_argnums=(0,))
    t0 = time.perf_counter()
    plan = step.get_plan(*args)
    search_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if logged and not plan.stages:
        compiled, log = compile_log.compile_logged(step.lower(*args))
    else:
        compiled, log = step.lower(*args).compile(), None
    return step, plan, compiled, search_s, time.perf_counter() - t0, log


# --- re-pricing a plan's own layout -------------------------------------------------------


def replay_prices(step, method, plan, args, clusters: list[ClusterSpec]):
    """intra_op.price_specs of the plan's own layout under each cluster."""
    program = step.trace(*args).program  # the traced program the plan was made for
    graph = program.graph
    meshes = [MeshContext.build(plan.mesh_shape, c) for c in clusters]
    assert meshes[0].axes == tuple(plan.mesh_axes)
    forced_pos = method.forced_specs(program.in_shapes, program.roles, meshes[0])
    forced = {graph.invars[p]: s for p, s in forced_pos.items()}
    ties = [(o, graph.invars[i]) for o, i in program.ties]
    specs = {v: s for v, s in zip(graph.invars, plan.in_specs)}
    specs.update(dict(plan.value_specs))
    return intra_op.price_specs(graph, specs, meshes, forced=forced, ties=ties,
                                batch_size=program.batch_size, solver=method.solver,
                                time_limit_s=TIME_LIMIT_S)


@contextlib.contextmanager
def _replaced(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _fixed_layer_start(layer_plan, plan_cluster: ClusterSpec):
    """A stand-in for `intra_op.start` as `pipeline_search.start_price_stage` calls it,
    which prices `layer_plan`'s layout instead of searching one: `intra_op.price_specs`
    with the extras the layer search prices (the gradient reductions' `comm_scale`, the
    accumulators' `traffic`, the updates' `value_costs`), its strategies chosen where a
    layout leaves a choice as under the plan's cluster (`price_specs`' first mesh)."""
    specs = dict(layer_plan.value_specs)
    build = intra_op._built

    def start(graph, mesh, *, forced=None, batch_size=None, comm_scale=None, traffic=None,
              value_costs=None, solver=intra_op.DEFAULT_BACKEND, time_limit_s=60.0, **_):
        def built(g, m, forced_, ties, size, _scale=None, buffers=None):
            builder = build(g, m, forced_, ties, size, comm_scale, buffers)
            builder.add_traffic(traffic or {})
            builder.add_value_costs(value_costs or {})
            return builder

        ref = MeshContext.build(mesh.shape, plan_cluster.with_devices(
            mesh.cluster.num_hosts, mesh.cluster.devices_per_host))
        with _replaced(intra_op, "_built", built):
            price = intra_op.price_specs(graph, specs, [ref, mesh], forced=forced,
                                         batch_size=batch_size, solver=solver,
                                         time_limit_s=time_limit_s)[-1]
        result = types.SimpleNamespace(cost_s=price.cost_s, memory_bytes=price.memory_bytes,
                                       value_specs=specs,
                                       operand_specs=layer_plan.operand_specs)
        return types.SimpleNamespace(result=lambda: result)

    return start


def _submesh(devices: int, cluster: ClusterSpec) -> tuple[int, int]:
    per = cluster.devices_per_host
    return (1, devices) if devices <= per else (devices // per, per)


def _state_modes(method) -> list[str]:
    """The StateSplit modes the stage search tries (pipeline_search.search)."""
    if not getattr(method, "shard_optimizer_state", False):
        return ["none"]
    fixed = method.stage_layout(8, 8).fixed_state_split
    return ["all"] if fixed else ["paying", "all"]


def replay_pipeline(step, method, plan, args, clusters: list[ClusterSpec]) -> list[dict]:
    """Every stage of a pipeline plan re-priced with its own layout under each cluster, as
    the stage search prices a stage: per stage, "step_s" (seconds per micro-batch:
    layers, resharding between them, updates; transfers not included) and "memory_bytes"
    (`pipeline_search.stage_memory_bytes`); "state_mode", the optimizer-state split that
    reproduces the plan's state layouts."""
    traced = step.trace(*args)
    split = traced.split
    graph = split.forward_graph()
    diff = pipeline_search.diff_values(split, graph)
    params = {graph.invars[j] for j in split.diff_inputs}
    program = traced.program
    roles = dict(zip(program.graph.invars, program.roles))
    totals = {r: sum(program.graph.values[v].nbytes for v, x in roles.items() if x == r)
              for r in ("param", "state")}
    per_param = totals["state"] / totals["param"] if totals["param"] else 0.0
    micro = plan.num_micro_batches
    batch = program.batch_size // micro if program.batch_size else None
    modes = _state_modes(method)
    plan_cluster = clusters[0]
    out = []
    for s, st in enumerate(plan.stages):
        progs = [pipeline.program_for_range(graph, *lp.eqn_range) for lp in st.layer_plans]
        submesh = _submesh(len(st.device_ids), plan_cluster)
        per_cluster = []
        chosen = None
        for cluster in clusters:
            splits = {m: pipeline_search.StateSplit(m, per_param, cluster) for m in modes}
            priced = []
            for lp, prog in zip(st.layer_plans, progs):
                with _replaced(intra_op, "start", _fixed_layer_start(lp, plan_cluster)):
                    priced.append(pipeline_search.price_stage(
                        graph, prog, diff, cluster, submesh, solver=method.solver,
                        time_limit_s=TIME_LIMIT_S, batch_size=batch, shapes=[st.mesh_shape],
                        remat=split.remat, num_micro_batches=micro,
                        update=splits[modes[0]])[tuple(st.mesh_shape)])
            if chosen is None:   # the mode whose state layouts are the plan's
                wanted = dict(st.state_specs)
                inputs = dict(st.input_specs)
                chosen = next((m for m in modes if {
                    v: spec for v, (spec, _) in pipeline_search.state_layouts(
                        priced, progs, params, graph, splits[m]).items()
                    if spec != inputs.get(v)} == wanted), modes[0])
            layers_s = (sum(p.cost_s for p in priced)
                        + pipeline_search.internal_reshard_s(priced, progs, graph)
                        - sum(pipeline_search.updates_s([p], [prog], params, graph,
                                                         splits[modes[0]], micro,
                                                         per_layer=True)
                              for p, prog in zip(priced, progs))
                        + pipeline_search.updates_s(priced, progs, params, graph,
                                                     splits[chosen], micro))
            memory = pipeline_search.stage_memory_bytes(
                priced, progs, params, graph, micro, len(plan.stages) - s, per_param,
                splits[chosen], whole_step=len(plan.stages) == 1)
            per_cluster.append({"step_s": layers_s, "memory_bytes": memory})
        out.append({"clusters": per_cluster, "state_mode": chosen})
    return out


_FUSIBLE = frozenset(primitives.spellings(lambda p: p.elementwise)) | {
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims"}


def memory_what_if(program, plan, mesh: MeshContext) -> dict[str, float]:
    """Per-value peak bytes per device of the plan's layout (not the ILP's per-group bound):
    as is; with each tied output sharing its (donated) input's buffer; and, in addition,
    with elementwise values that only feed elementwise ops treated as fused (never
    materialized, as XLA's loop fusion does)."""
    graph = program.graph
    specs = {v: s for v, s in zip(graph.invars, plan.in_specs)}
    specs.update(dict(plan.value_specs))
    live = graph.liveness().copy()
    outputs = {op for op in graph.outvars if isinstance(op, int)}

    def size(v: int) -> float:
        spec = specs.get(v)
        return graph.values[v].nbytes / (mesh.shards(spec) if spec else 1)

    tied_out = {graph.outvars[o]: graph.invars[i] for o, i in program.ties
                if isinstance(graph.outvars[o], int)}

    def fused(v: int) -> bool:
        val = graph.values[v]
        if val.producer is None or v in outputs:
            return False
        if graph.eqns[val.producer].name not in _FUSIBLE:
            return False
        return all(graph.eqns[e].name in _FUSIBLE for e in graph.consumers[v])

    def peak(skip) -> float:
        horizon = int(live[:, 1].max()) + 2
        usage = np.zeros(horizon + 1)
        for val in graph.values:
            if val.const_index is not None or skip(val.id):
                continue
            s, e = live[val.id]
            usage[s] += size(val.id)
            usage[max(e, s + 1)] -= size(val.id)
        return float(np.cumsum(usage).max())

    return {"per_value": peak(lambda v: False),
            "aliased": peak(lambda v: v in tied_out),
            "aliased_fused": peak(lambda v: v in tied_out or fused(v))}


# --- fingerprints: which plans are the same -----------------------------------------------


def _canonical_spec(spec, shape: Sequence[int], axes: Sequence[str]) -> tuple:
    """`spec` with each mesh axis named by (size, stride) in the device order, axes of size
    1 dropped and adjacent axes merged: on 8 devices, a dim split over "y" of a 1x8 mesh,
    "x" of 8x1 or 8, or ("x", "y") of 2x4 all read ((8, 1),)."""
    strides = {a: math.prod(shape[i + 1:]) for i, a in enumerate(axes)}
    sizes = dict(zip(axes, shape))
    out = []
    for dim in spec:
        parts: list[tuple[int, int]] = []
        for a in dim:
            if sizes[a] == 1:
                continue
            size, stride = sizes[a], strides[a]
            if parts and parts[-1][1] == size * stride:
                parts[-1] = (parts[-1][0] * size, stride)
            else:
                parts.append((size, stride))
        out.append(tuple(parts))
    return tuple(out)


def layout_fingerprint(plan: Plan) -> str:
    """A hash of what the plan lays out where (not what it predicts)."""
    def canon(spec, shape=plan.mesh_shape, axes=plan.mesh_axes):
        return _canonical_spec(spec, shape, axes)

    if plan.stages:
        key = [plan.num_micro_batches, plan.schedule]
        for st in plan.stages:
            c = lambda sp, st=st: canon(sp, st.mesh_shape, st.mesh_axes)
            key.append((st.device_ids, st.eqn_range,
                        [(v, c(sp)) for v, sp in st.input_specs],
                        [(v, c(sp)) for v, sp in st.state_specs],
                        [(lp.eqn_range, [(v, c(sp)) for v, sp in lp.value_specs],
                          [(e, k, c(sp)) for e, k, sp in lp.operand_specs])
                         for lp in st.layer_plans]))
    else:
        key = [plan.device_ids, plan.num_micro_batches,
               [canon(s) for s in plan.in_specs], [canon(s) for s in plan.out_specs],
               [(v, canon(s)) for v, s in plan.value_specs],
               [(e, k, canon(s)) for e, k, s in plan.operand_specs]]
    return hashlib.sha256(repr(key).encode()).hexdigest()[:16]


def audit_signature(audits: Sequence[hlo_audit.Audit]) -> str:
    """A hash of what XLA built: every program's collectives (kind, bytes, group size,
    runs), FLOPs, bytes accessed and memory terms."""
    key = [(sorted((c.kind, c.nbytes, c.group_size, c.count) for c in a.collectives),
            a.flops, a.bytes_accessed,
            dataclasses.astuple(a.memory) if a.memory is not None else None) for a in audits]
    return hashlib.sha256(repr(key).encode()).hexdigest()[:16]


def dedupe(rows: Sequence[dict]) -> list[dict]:
    """Groups of rows (of one model) that are one plan: the same layout fingerprint or the
    same audit signature (transitively).  Each group: {"model", "representative" (the
    first case run), "cases" (labels, in run order), "rows" (indices), "why" (per collapsed
    case: "layout", "audit" or "layout+audit")}."""
    parent = list(range(len(rows)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for key in ("layout", "signature"):
        first: dict[tuple, int] = {}
        for i, r in enumerate(rows):
            k = (r["model"], r[key])
            if k in first:
                a, b = find(first[k]), find(i)
                parent[max(a, b)] = min(a, b)
            else:
                first[k] = i
    groups: dict[int, list[int]] = {}
    for i in range(len(rows)):
        groups.setdefault(find(i), []).append(i)
    out = []
    for members in sorted(groups.values()):
        rep = rows[members[0]]
        why = {}
        for i in members[1:]:
            r = rows[i]
            same = [name for key, name in (("layout", "layout"), ("signature", "audit"))
                    if r[key] == rep[key]]
            why[r["plan"]] = "+".join(same) or "via another case"
        out.append({"model": rep["model"], "representative": rep["plan"],
                    "cases": [rows[i]["plan"] for i in members], "rows": members, "why": why})
    return out


# --- part 1: audited plans ----------------------------------------------------------------



def _copies_s(plan) -> list[float]:
    """Per stage, the seconds per micro-batch of its transfers that no audited program
    holds: the copies of the activations it receives and of the cotangents it sends back,
    and its all-gathers of the values that reach it in their wire layout (a program of its
    own, `transfer.wire_sharding`); the re-layouts before a copy run inside the stages'
    forward and backward programs, which the audit prices already.  Plans without transfer
    records: the stages' whole `transfer_s`."""
    records = plan.solver.get("transfers") if isinstance(plan.solver, dict) else None
    if not records:
        return [st.transfer_s for st in plan.stages]
    out = [0.0] * len(plan.stages)
    for r in records:
        if r["what"] == "activation":
            out[r["to_stage"]] += r["copy_s"]
        elif r["what"] == "cotangent":
            out[r["from_stage"]] += r["copy_s"]
        else:
            continue
        out[r["to_stage"]] += r.get("gather_s", 0.0)   # runs where the value arrives
    return out


class Auditor:
    """Searches, compiles and audits plans; keeps each plan (JSON) for the replay under the
    other scheduler."""

    def __init__(self, scheduler: str):
        self.plan_cluster = ClusterSpec.preset(PLAN_CLUSTER)
        self.bytes_cluster = byte_cluster(self.plan_cluster)
        self.latency_cluster = latency_cluster(self.plan_cluster)
        self.scheduler = scheduler
        self.plans: list[dict] = []

    def run(self, models_: dict[str, Model], quick: bool) -> tuple[list[dict], list[dict]]:
        """(rows, budget ladder records)."""
        rows, ladder = [], []
        for name, model in models_.items():
            args = model.args()
            names = input_names(*args)
            for label, method in methods(name, names, quick):
                row = self.case(model, label, method, args)
                rows.append(row)
                if label == "auto":
                    found, steps = self.budgets(model, method, args, row, quick)
                    rows += found
                    ladder.append({"model": name, "steps": steps})
        return rows, ladder

    def case(self, model: Model, label: str, method, args) -> dict:
        step, plan, compiled, search_s, compile_s, log = plan_and_compile(
            model.step, method, self.plan_cluster, args)
        base = {"model": model.name, "plan": label, "method": plan.method,
                "kind": "pipeline" if plan.stages else "single",
                "search_s": search_s, "compile_s": compile_s,
                "layout": layout_fingerprint(plan),
                "memory_budget_bytes": getattr(method, "memory_budget_bytes", None)}
        base["plan_id"] = len(self.plans)
        self.plans.append({"id": base["plan_id"], "model": model.name, "plan": label,
                           "json": plan.to_json()})
        if plan.stages:
            row = {**base, **self.pipeline_row(step, method, plan, compiled, args)}
        else:
            row = {**base, **self.single_row(step, method, plan, compiled, args, log)}
        row["bytes_ratio"] = _ratio(row["pred_comm_volume_bytes"], row["audit_comm_volume_bytes"])
        row["time_ratio"] = _ratio(row["pred_step_s"], row["audit_step_s"])
        row["audit_memory_by_scheduler"] = {self.scheduler: row["audit_memory_bytes"]}
        row["memory_ratio_by_scheduler"] = {
            self.scheduler: memory_ratio(row["pred_memory_bytes"], row["audit_memory_bytes"])}
        print(f"  {model.name:4} {label:22} bytes {row['pred_comm_volume_bytes']:.3g}/"
              f"{row['audit_comm_volume_bytes']:.3g}  mem "
              f"{_fmt_list(row['pred_memory_bytes'])}/{_fmt_list(row['audit_memory_bytes'])}  "
              f"time {row['pred_step_s']:.3g}/{row['audit_step_s']:.3g}  "
              f"({search_s:.0f} s + {compile_s:.0f} s)", flush=True)
        return row

    def single_row(self, step, method, plan, compiled, args, log) -> dict:
        c = self.plan_cluster
        whatif = memory_what_if(step.trace(*args).program, plan,
                                MeshContext.build(plan.mesh_shape, c))
        own, vol, on_cpu = replay_prices(step, method, plan, args,
                                         [c, self.bytes_cluster, cpu_backend(c)])
        audit = hlo_audit.audit(compiled, plan.mesh_shape, plan.mesh_axes, compile_log=log)
        priced = audit.price(c)
        return {
            "mesh": list(plan.mesh_shape), "solver_status": plan.solver.get("solver_status"),
            "pred_step_s": plan.predicted.step_s, "pred_compute_s": plan.predicted.compute_s,
            "pred_comm_s": plan.predicted.comm_s,
            "pred_memory_bytes": [on_cpu.memory_bytes],
            "pred_memory_gpu_rules_bytes": [plan.predicted.memory_bytes],
            "pred_flops_total": plan.predicted.flops,
            "replay_step_s": own.step_s, "replay_rel_diff": own.step_s / plan.predicted.step_s - 1,
            "pred_comm_volume_bytes": vol.comm_s,
            "audit_comm_volume_bytes": audit.price(self.bytes_cluster)["communication_s"],
            "audit_latency_s": audit.price(self.latency_cluster)["communication_s"],
            "audit_collectives": sum(c.count for c in audit.collectives),
            "memory_what_if": whatif,
            "audit_memory": [dataclasses.asdict(audit.memory)],
            "audit_memory_bytes": [audit.memory.total_bytes],
            "involuntary_rematerializations": audit.involuntary_rematerializations,
            "audit_step_s": priced["total_s"], "audit_compute_s": priced["compute_s"],
            "audit_comm_s": priced["communication_s"],
            "audit_flops_per_device": audit.flops,
            "audit_bytes_by_kind": audit.bytes_by_kind(),
            "audit_count_by_kind": _count_by_kind([(audit, 1)]),
            "signature": audit_signature([audit]),
        }

    def pipeline_row(self, step, method, plan, compiled, args) -> dict:
        c = self.plan_cluster
        replay = replay_pipeline(step, method, plan, args,
                                 [c, self.bytes_cluster, cpu_backend(c)])
        micro = plan.num_micro_batches
        audits = compiled.audits()
        # Per stage: its forward + backward per micro-batch, and what runs once per step
        # (zeros, finalize, apply), priced on the plan cluster; bytes over one step.
        per_micro = [0.0] * len(plan.stages)
        once = [0.0] * len(plan.stages)
        by_program: dict[str, float] = {}
        latency = 0.0
        for name, s, audit, calls in audits:
            seconds = audit.price(c)["total_s"]
            if name in ("forward", "backward"):
                per_micro[s] += seconds
            else:
                once[s] += seconds * calls
            by_program[name] = (by_program.get(name, 0.0)
                                + audit.price(self.bytes_cluster)["communication_s"] * calls)
            latency += audit.price(self.latency_cluster)["communication_s"] * calls
        stage_s = [per_micro[s] + once[s] / micro + t
                   for s, t in enumerate(_copies_s(plan))]
        audit_step = (sum(stage_s) + (micro - 1) * max(stage_s)
                      + plan.solver.get("per_step_transfer_s", 0.0))
        replay_s = [r["clusters"][0]["step_s"] + st.transfer_s
                    for r, st in zip(replay, plan.stages)]
        memories = [float(m) for m in compiled.stage_memory_bytes()]
        return {
            "mesh": [list(st.mesh_shape) for st in plan.stages],
            "stages": [{"layers": list(st.layers), "devices": len(st.device_ids),
                        "mesh": list(st.mesh_shape), "predicted_s": st.predicted_s,
                        "transfer_s": st.transfer_s, "state_mode": r["state_mode"],
                        "audit_s": a} for st, r, a in zip(plan.stages, replay, stage_s)],
            "num_micro_batches": micro,
            "pred_step_s": plan.predicted.step_s,
            "pred_memory_bytes": [r["clusters"][2]["memory_bytes"] for r in replay],
            "pred_memory_gpu_rules_bytes": [st.memory_bytes for st in plan.stages],
            "replay_memory_gpu_rules_bytes": [r["clusters"][0]["memory_bytes"] for r in replay],
            "replay_stage_s": replay_s,
            "replay_rel_diff": max(abs(r / st.predicted_s - 1)
                                   for r, st in zip(replay_s, plan.stages)),
            "pred_comm_volume_bytes": micro * sum(r["clusters"][1]["step_s"] for r in replay),
            "audit_comm_volume_bytes": sum(by_program.values()),
            "audit_comm_by_program": by_program,
            "audit_latency_s": latency,
            "audit_collectives": sum(c.count * calls for _, _, a, calls in audits
                                     for c in a.collectives),
            "audit_memory_bytes": memories,
            "involuntary_rematerializations": None,
            "audit_step_s": audit_step,
            "audit_bytes_by_kind": compiled.collective_bytes_per_step(),
            "audit_count_by_kind": _count_by_kind([(a, calls) for _, _, a, calls in audits]),
            "signature": audit_signature([a for _, _, a, _ in audits]),
        }

    def budgets(self, model: Model, method, args, unconstrained: dict, quick: bool
                ) -> tuple[list[dict], list[dict]]:
        """The planner's plans under BUDGET_FRACTIONS of the unconstrained plan's predicted
        memory (GPU rules, as searched), down to what fits, on the unconstrained plan's
        mesh; (rows, ladder steps)."""
        top = unconstrained["pred_memory_gpu_rules_bytes"][0]
        method = dataclasses.replace(method, mesh_shape=tuple(unconstrained["mesh"]))
        limit = QUICK_BUDGET_TIME_LIMIT_S if quick else BUDGET_TIME_LIMIT_S
        t0 = time.perf_counter()
        try:
            plan_and_compile(model.step, dataclasses.replace(
                method, memory_budget_bytes=1.0, time_limit_s=limit),
                self.plan_cluster, args, logged=False)
            floor = 0.0
        except autopar.MemoryBudgetError as err:
            floor = err.smallest_bytes
        steps = [{"fraction": 0.0, "budget_bytes": 1.0, "outcome": "floor probe",
                  "smallest_bytes": floor, "seconds": time.perf_counter() - t0}]
        print(f"  {model.name:4} smallest plan the search finds: {floor / 2**20:.3f} MiB "
              f"(unconstrained {top / 2**20:.3f} MiB)", flush=True)
        rows = []
        for f in BUDGET_FRACTIONS[-1:] if quick else BUDGET_FRACTIONS:
            budget = f * top
            step = {"fraction": f, "budget_bytes": budget}
            steps.append(step)
            if budget < MIN_BUDGET_OVER_FLOOR * floor:
                step["outcome"] = "below the floor: not tried"
                continue
            t0 = time.perf_counter()
            try:
                row = self.case(model, f"auto ≤{f:.2f}", dataclasses.replace(
                    method, memory_budget_bytes=budget, time_limit_s=limit),
                    args)
            except autopar.MemoryBudgetError as err:
                # Not the end of the ladder: a search that cannot fit one budget may fit a
                # smaller one (it re-searches under caps tightened by its own overshoot).
                step.update(outcome="no plan fits", smallest_bytes=err.smallest_bytes,
                            seconds=time.perf_counter() - t0)
                continue
            step.update(outcome="plan", seconds=time.perf_counter() - t0)
            rows.append(row)
        return rows, steps


def memory_ratio(pred: Sequence[float], audited: Sequence[float]) -> float:
    """The ratio predicted / audited farthest from 1 over a plan's stages (one for a single
    mesh)."""
    ratios = [_ratio(p, a) for p, a in zip(pred, audited)]
    return max(ratios, key=lambda r: abs(math.log(r)) if 0 < r < math.inf else math.inf)


def _fmt_list(xs: Sequence[float]) -> str:
    return "[" + ", ".join(f"{x:.3g}" for x in xs) + "]" if len(xs) > 1 else f"{xs[0]:.3g}"


def _count_by_kind(audits) -> dict[str, int]:
    out: dict[str, int] = {}
    for audit, calls in audits:
        for c in audit.collectives:
            out[c.kind] = out.get(c.kind, 0) + calls
    return out


# --- the other scheduler: a subprocess that compiles the same plans -----------------------


def replay_memory(plans_path: pathlib.Path, out_path: pathlib.Path, quick: bool) -> None:
    """Compiles every plan of `plans_path` (written by `other_scheduler`) under this
    process's XLA_FLAGS and writes its per-device memory (per stage for pipelines)."""
    entries = json.loads(plans_path.read_text())
    names = list(dict.fromkeys(e["model"] for e in entries))
    built = make_models(quick, names)
    cluster = ClusterSpec.preset(PLAN_CLUSTER)
    out = {"xla_flags": os.environ.get("XLA_FLAGS", ""),
           "scheduler": scheduler_of(os.environ.get("XLA_FLAGS", "")), "plans": {}}
    for e in entries:
        model = built[e["model"]]
        args = model.args()
        plan = Plan.from_json(e["json"])
        t0 = time.perf_counter()
        step = autopar.parallelize(model.step, plan=plan, cluster=cluster,
                                   devices=jax.devices()[:len(plan.device_ids)],
                                   donate_argnums=(0,))
        compiled = step.lower(*args).compile()
        if plan.stages:
            memory = [float(m) for m in compiled.stage_memory_bytes()]
        else:
            memory = [float(hlo_audit.MemoryUsage.of(compiled).total_bytes)]
        out["plans"][str(e["id"])] = {"memory_bytes": memory,
                                      "compile_s": time.perf_counter() - t0}
        print(f"  {e['model']:4} {e['plan']:22} {_fmt_list(memory)}", flush=True)
        out_path.write_text(json.dumps(out))   # what is done survives a timeout


def other_scheduler(auditor: Auditor, rows: list[dict], quick: bool,
                    timeout_s: float) -> dict:
    """Runs `replay_memory` in a subprocess under the other XLA:CPU scheduler and merges
    its memory into `rows`; returns {"scheduler", "xla_flags", "seconds", "error"}.  Only
    the first case of each distinct plan (`dedupe`) is compiled again: a case that is the
    same plan (same layout or the same compiled programs) takes its figures."""
    groups = dedupe(rows)
    first = {rows[i]["plan_id"]: rows[g["rows"][0]]["plan_id"] for g in groups for i in g["rows"]}
    other = next(s for s in SCHEDULERS if s != auditor.scheduler)
    env = dict(os.environ)
    env["XLA_FLAGS"] = flags_for(other, os.environ.get("XLA_FLAGS", ""))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    info = {"scheduler": other, "xla_flags": env["XLA_FLAGS"], "error": None}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        plans_path, out_path = pathlib.Path(tmp, "plans.json"), pathlib.Path(tmp, "out.json")
        plans_path.write_text(json.dumps([p for p in auditor.plans
                                          if first.get(p["id"]) == p["id"]]))
        cmd = [sys.executable, "-m", "benchmarks.cost_model_accuracy", "--replay-memory",
               str(plans_path), str(out_path)] + (["--quick"] if quick else [])
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout_s,
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                info["error"] = f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"
            sys.stdout.write(proc.stdout)
        except subprocess.TimeoutExpired:
            info["error"] = f"timed out after {timeout_s:.0f} s"
        found = json.loads(out_path.read_text()) if out_path.exists() else {"plans": {}}
    info["seconds"] = time.perf_counter() - t0
    for row in rows:
        got = found["plans"].get(str(first[row["plan_id"]]))
        if got is not None:
            row["audit_memory_by_scheduler"][other] = got["memory_bytes"]
            row["memory_ratio_by_scheduler"][other] = memory_ratio(row["pred_memory_bytes"],
                                                                   got["memory_bytes"])
    return info


# --- part 2: measured -------------------------------------------------------------------


def measured_part(models_: dict[str, Model], quick: bool, steps: int) -> list[dict]:
    cluster = ClusterSpec.preset("cpu-local")
    rows = []
    for name, model in models_.items():
        if not model.runs:
            continue
        state0, batch = model.args()
        names = input_names(state0, batch)
        for label, method in methods(name, names, quick):
            if getattr(method, "pipelined", False) or label == "auto":
                continue
            step, plan, compiled, _, _, _ = plan_and_compile(model.step, method, cluster,
                                                             (state0, batch), logged=False)
            audit = hlo_audit.audit(compiled, plan.mesh_shape, plan.mesh_axes)
            state = jax.tree.map(lambda x: x.copy(), state0)  # donated below
            for _ in range(2):  # warm-up (compile, first transfers)
                state, out = step(state, batch)
            jax.block_until_ready((state, out))
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                state, out = step(state, batch)
                jax.block_until_ready((state, out))
                times.append(time.perf_counter() - t0)
            row = {"model": name, "plan": label, "method": plan.method,
                   "mesh": list(plan.mesh_shape), "pred_step_s": plan.predicted.step_s,
                   "pred_compute_s": plan.predicted.compute_s,
                   "pred_comm_s": plan.predicted.comm_s,
                   "audit_step_s": audit.price(cluster)["total_s"],
                   "measured_s": float(np.median(times)), "measured_min_s": float(min(times)),
                   "samples_s": times}
            row["time_ratio"] = _ratio(row["pred_step_s"], row["measured_s"])
            rows.append(row)
            print(f"  {name:4} {label:9} predicted {row['pred_step_s'] * 1e3:8.3f} ms  "
                  f"audit {row['audit_step_s'] * 1e3:8.3f} ms  measured "
                  f"{row['measured_s'] * 1e3:8.3f} ms", flush=True)
    return rows


# --- summary ------------------------------------------------------------------------------


def spearman(a, b) -> float:
    def ranks(x):
        x = np.asarray(x, dtype=float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):  # average ties
            r[x == v] = r[x == v].mean()
        return r

    if len(a) < 2:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _order(rows, key) -> list[str]:
    return [r["plan"] for r in sorted(rows, key=lambda r: r[key])]


def ranking(rows, pred_key: str, actual_key: str) -> list[dict]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        sub = [r for r in rows if r["model"] == model]
        pairs = [(i, j) for i in range(len(sub)) for j in range(i + 1, len(sub))]
        concordant = sum(
            (sub[i][pred_key] - sub[j][pred_key]) * (sub[i][actual_key] - sub[j][actual_key]) > 0
            for i, j in pairs)
        pred_order, actual_order = _order(sub, pred_key), _order(sub, actual_key)
        out.append({"model": model, "spearman": spearman([r[pred_key] for r in sub],
                                                         [r[actual_key] for r in sub]),
                    "concordant_pairs": int(concordant), "pairs": len(pairs),
                    "same_order": pred_order == actual_order,
                    "predicted_order": pred_order, "actual_order": actual_order,
                    "same_best": pred_order[0] == actual_order[0]})
    return out


def metric_summary(rows: Sequence[dict], ratio_of: Callable[[dict], float | None],
                   tol: float) -> dict:
    """Within-tolerance count, median and worst ratio (farthest from 1) over `rows` (one per
    distinct plan; rows without the figure are left out)."""
    pairs = [(r, ratio_of(r)) for r in rows]
    pairs = [(r, x) for r, x in pairs if x is not None]
    if not pairs:
        return {"within": 0, "plans": 0, "median": None, "worst": None, "worst_case": None,
                "outside": []}
    dist = lambda x: abs(math.log(x)) if 0 < x < math.inf else math.inf
    worst_row, worst = max(pairs, key=lambda p: dist(p[1]))
    ok = [abs(x - 1.0) <= tol for _, x in pairs]
    return {"within": int(sum(ok)), "plans": len(pairs),
            "median": float(np.median([x for _, x in pairs])), "worst": worst,
            "worst_case": f"{worst_row['model']} {worst_row['plan']}",
            "outside": [f"{r['model']} {r['plan']} {_fmt_ratio(x)}"
                        for (r, x), good in zip(pairs, ok) if not good]}


def _what_if_within(rows: Sequence[dict], key: str, tol: float) -> str:
    ok = sum(abs(r["memory_what_if"][key] / r["audit_memory_bytes"][0] - 1) <= tol for r in rows)
    return f"{ok}/{len(rows)}"


def summarize(audit_rows: list[dict], measured_rows: list[dict],
              schedulers: Sequence[str]) -> dict:
    groups = dedupe(audit_rows)
    distinct = [audit_rows[g["rows"][0]] for g in groups]
    single = [r for r in distinct if r["kind"] == "single"]
    summary = {
        "cases": len(audit_rows),
        "distinct_plans": len(distinct),
        "distinct_by_model": {m: sum(g["model"] == m for g in groups)
                              for m in dict.fromkeys(r["model"] for r in audit_rows)},
        "groups": [{k: g[k] for k in ("model", "representative", "cases", "why")}
                   for g in groups],
        "memory": {s: metric_summary(distinct, lambda r, s=s: r["memory_ratio_by_scheduler"]
                                     .get(s), TOLERANCES["memory"]) for s in schedulers},
        "memory_gpu_rules": {s: metric_summary(distinct, lambda r, s=s: memory_ratio(
            r["pred_memory_gpu_rules_bytes"], r["audit_memory_by_scheduler"][s])
            if s in r["audit_memory_by_scheduler"] else None, TOLERANCES["memory"])
            for s in schedulers},
        "bytes": metric_summary(distinct, lambda r: r["bytes_ratio"], TOLERANCES["bytes"]),
        "time": metric_summary(distinct, lambda r: r["time_ratio"], TOLERANCES["time"]),
        "memory_what_if_within_10pct": {k: _what_if_within(single, k, TOLERANCES["memory"])
                                        for k in ("per_value", "aliased", "aliased_fused")}
        if single else {},
        "involuntary_rematerializations": int(sum(r["involuntary_rematerializations"] or 0
                                                  for r in distinct)),
        "ranking_predicted_vs_audited": ranking(distinct, "pred_step_s", "audit_step_s"),
        "ranking_predicted_vs_measured": ranking(measured_rows, "pred_step_s", "measured_s")
        if measured_rows else [],
        "replay_max_rel_diff": max(abs(r["replay_rel_diff"]) for r in audit_rows),
        "replay_memory_max_rel_diff": max(
            (abs(a / b - 1) for r in audit_rows if r["kind"] == "pipeline"
             for a, b in zip(r["replay_memory_gpu_rules_bytes"],
                             r["pred_memory_gpu_rules_bytes"])), default=0.0),
    }
    ranks = [r["spearman"] for r in summary["ranking_predicted_vs_audited"]
             if not math.isnan(r["spearman"])]
    summary["spearman_mean"] = float(np.mean(ranks)) if ranks else float("nan")
    return summary


# --- output -------------------------------------------------------------------------------


def _mib(x: float) -> str:
    return f"{x / 2**20:.3f}"


def _mibs(xs: Sequence[float]) -> str:
    return " / ".join(_mib(x) for x in xs)


def _fmt_ratio(x: float | None) -> str:
    if x is None:
        return "–"
    return "∞" if math.isinf(x) else f"{x:.2f}"


def _yn(b: bool) -> str:
    return "yes" if b else "no"


def _shape(r) -> str:
    if r["kind"] == "pipeline":
        return " + ".join("×".join(str(n) for n in m) for m in r["mesh"])
    return "×".join(str(n) for n in r["mesh"])


def _rep_mark(r, reps: set[int]) -> str:
    return "" if r["row_id"] in reps else " ⁼"


def tables(audit_rows, measured_rows, summary, schedulers, ladder) -> list[str]:
    reps = {g["rows"][0] for g in dedupe(audit_rows)}
    lines = ["Cases marked ⁼ are the same plan as an earlier case (see \"Distinct plans\") "
             "and are not counted in the summary.", "",
             "## Communication volume (α-β byte term, per device per step, MiB)", "",
             "| model | plan | mesh | predicted | audited | ratio | audited collectives "
             "(per step) |", "|---|---|---|---:|---:|---:|---|"]
    for r in audit_rows:
        kinds = ", ".join(f"{k} ×{n}" for k, n in sorted(r["audit_count_by_kind"].items()))
        lines.append(f"| {r['model']} | {r['plan']}{_rep_mark(r, reps)} | {_shape(r)} | "
                     f"{_mib(r['pred_comm_volume_bytes'])} | "
                     f"{_mib(r['audit_comm_volume_bytes'])} | {_fmt_ratio(r['bytes_ratio'])} | "
                     f"{kinds or '—'} |")
    sched_cols = " | ".join(f"audited, {s} | ratio" for s in schedulers)
    lines += ["", "## Per-device memory (MiB; pipelines: per stage)", "",
              "Predicted: the plan's layout under XLA:CPU's rules (the backend that compiled "
              "it); GPU rules: the plan's own figure (`plan.predicted`, or each "
              "`StagePlan.memory_bytes`), the rules it was searched under.  Audited under "
              "each XLA:CPU scheduler: " + "; ".join(
                  f"{s}: {SCHEDULER_NAMES[s]}" for s in schedulers) + " (a ⁼ case under the "
              "second takes its plan's first case's compile).", "",
              f"| model | plan | mesh | predicted | GPU rules | {sched_cols} |",
              "|---|---|---|---:|---:|" + "---:|---:|" * len(schedulers)]
    for r in audit_rows:
        cells = []
        for s in schedulers:
            got = r["audit_memory_by_scheduler"].get(s)
            cells += [_mibs(got) if got else "–",
                      _fmt_ratio(r["memory_ratio_by_scheduler"].get(s))]
        lines.append(f"| {r['model']} | {r['plan']}{_rep_mark(r, reps)} | {_shape(r)} | "
                     f"{_mibs(r['pred_memory_bytes'])} | "
                     f"{_mibs(r['pred_memory_gpu_rules_bytes'])} | " + " | ".join(cells) + " |")
    single = [r for r in audit_rows if r["kind"] == "single"]
    if single:
        lines += ["", f"### Single-mesh memory terms ({schedulers[0]} scheduler) and the "
                  "per-value what-if", "",
                  "| model | plan | audited (arg + out − alias + temp) | what-if: per value "
                  "| + tied outputs aliased | + elementwise fused |",
                  "|---|---|---:|---:|---:|---:|"]
        for r in single:
            m = r["audit_memory"][0]
            total = r["audit_memory_bytes"][0]
            lines.append(f"| {r['model']} | {r['plan']}{_rep_mark(r, reps)} | {_mib(total)} "
                         f"({_mib(m['argument_bytes'])} + {_mib(m['output_bytes'])} − "
                         f"{_mib(m['alias_bytes'])} + {_mib(m['temp_bytes'])}) | " + " | ".join(
                             _fmt_ratio(r["memory_what_if"][k] / total)
                             for k in ("per_value", "aliased", "aliased_fused")) + " |")
    lines += ["", f"## Predicted step time on {PLAN_CLUSTER} (µs)", "",
              "Single mesh: compute + comm.  Pipelines: the planner's step formula, with the "
              "audited stage programs in place of the predicted stages on the audited side.",
              "", "| model | plan | mesh | predicted | audited | ratio |",
              "|---|---|---|---:|---:|---:|"]
    for r in audit_rows:
        if r["kind"] == "single":
            pred = (f"{r['pred_step_s'] * 1e6:.2f} ({r['pred_compute_s'] * 1e6:.2f} + "
                    f"{r['pred_comm_s'] * 1e6:.2f})")
            aud = (f"{r['audit_step_s'] * 1e6:.2f} ({r['audit_compute_s'] * 1e6:.2f} + "
                   f"{r['audit_comm_s'] * 1e6:.2f})")
        else:
            pred, aud = f"{r['pred_step_s'] * 1e6:.2f}", f"{r['audit_step_s'] * 1e6:.2f}"
        lines.append(f"| {r['model']} | {r['plan']}{_rep_mark(r, reps)} | {_shape(r)} | "
                     f"{pred} | {aud} | {_fmt_ratio(r['time_ratio'])} |")
    pipes = [r for r in audit_rows if r["kind"] == "pipeline"]
    if pipes:
        lines += ["", "### Pipeline stages", "",
                  "| model | plan | stage | layers | mesh | optimizer state | predicted µs/mb "
                  "(transfers) | audited µs/mb |", "|---|---|---:|---|---|---|---:|---:|"]
        for r in pipes:
            for k, st in enumerate(r["stages"]):
                lines.append(f"| {r['model']} | {r['plan']} | {k} | {st['layers'][0]}–"
                             f"{st['layers'][1]} | {'×'.join(map(str, st['mesh']))} | "
                             f"{st['state_mode']} | {st['predicted_s'] * 1e6:.2f} "
                             f"({st['transfer_s'] * 1e6:.2f}) | {st['audit_s'] * 1e6:.2f} |")
    lines += ["", "## Memory budgets", "",
              "The planner's plan (`ShardParallel(mesh_shape=...)`, on the mesh of the "
              "unconstrained plan) under budgets of a fraction of the unconstrained plan's "
              "predicted memory (GPU rules); the floor is the smallest plan the search finds "
              "(a 1-byte budget's `MemoryBudgetError`).", "",
              "| model | fraction | budget MiB | outcome |", "|---|---:|---:|---|"]
    for entry in ladder:
        for st in entry["steps"]:
            what = st["outcome"]
            if "smallest_bytes" in st:
                what += f" (smallest {_mib(st['smallest_bytes'])} MiB)"
            lines.append(f"| {entry['model']} | {st['fraction']:.2f} | "
                         f"{_mib(st['budget_bytes'])} | {what} |")
    lines += ["", "## Distinct plans", "",
              f"{summary['distinct_plans']} distinct plans among {summary['cases']} cases ("
              + ", ".join(f"{m} {n}" for m, n in summary["distinct_by_model"].items())
              + ").  Collapsed (same layout fingerprint and/or same audit of every compiled "
              "program):", ""]
    collapsed = [g for g in summary["groups"] if len(g["cases"]) > 1]
    for g in collapsed:
        lines.append(f"- {g['model']}: {g['representative']} ← " + ", ".join(
            f"{c} ({w})" for c, w in g["why"].items()))
    if not collapsed:
        lines.append("- none")
    if measured_rows:
        lines += ["", "## cpu-local: predicted vs measured step time (ms, median)", "",
                  "| model | plan | mesh | predicted (compute + comm) | audit priced | "
                  "measured median (min) | predicted / measured |",
                  "|---|---|---|---:|---:|---:|---:|"]
        for r in measured_rows:
            lines.append(f"| {r['model']} | {r['plan']} | {'×'.join(map(str, r['mesh']))} | "
                         f"{r['pred_step_s'] * 1e3:.3f} ({r['pred_compute_s'] * 1e3:.3f} + "
                         f"{r['pred_comm_s'] * 1e3:.3f}) | {r['audit_step_s'] * 1e3:.3f} | "
                         f"{r['measured_s'] * 1e3:.3f} ({r['measured_min_s'] * 1e3:.3f}) | "
                         f"{_fmt_ratio(r['time_ratio'])} |")
    lines += ["", "## Ranking (distinct plans)", "",
              "| model | predicted vs | Spearman | concordant pairs | same order | same best "
              "| predicted order | actual order |", "|---|---|---:|---:|---|---|---|---|"]
    for what, key in (("audited", "ranking_predicted_vs_audited"),
                      ("measured (cpu-local)", "ranking_predicted_vs_measured")):
        for r in summary[key]:
            lines.append(f"| {r['model']} | {what} | {r['spearman']:.2f} | "
                         f"{r['concordant_pairs']}/{r['pairs']} | {_yn(r['same_order'])} | "
                         f"{_yn(r['same_best'])} | {', '.join(r['predicted_order'])} | "
                         f"{', '.join(r['actual_order'])} |")
    return lines


def _within(m: dict) -> str:
    return f"{m['within']}/{m['plans']}"


def _spread(m: dict) -> str:
    if not m["plans"]:
        return "no figures"
    return (f"median {_fmt_ratio(m['median'])}, worst {_fmt_ratio(m['worst'])} "
            f"({m['worst_case']})")


def summary_lines(summary: dict, schedulers: Sequence[str]) -> list[str]:
    s = summary
    lines = ["## Summary (over distinct plans)", "",
             f"- distinct plans measured: {s['distinct_plans']} of {s['cases']} cases"]
    for sched in schedulers:
        m = s["memory"][sched]
        lines.append(f"- memory within ±10%, {sched} scheduler: {_within(m)} ({_spread(m)}); "
                     f"with the GPU-rules figure: {_within(s['memory_gpu_rules'][sched])}")
    lines += [f"- communication bytes within ±15%: {_within(s['bytes'])} ({_spread(s['bytes'])})",
              f"- {PLAN_CLUSTER} step time within ±25% of the audit: {_within(s['time'])} "
              f"({_spread(s['time'])})",
              "- Spearman, predicted vs audited step time: " + ", ".join(
                  f"{r['model']} {r['spearman']:.2f}"
                  for r in s["ranking_predicted_vs_audited"])
              + f" (mean {s['spearman_mean']:.2f})"]
    if s["memory_what_if_within_10pct"]:
        lines.append("- single-mesh memory what-if within ±10% (per value / + aliased / + "
                     "fused): " + " / ".join(s["memory_what_if_within_10pct"].values()))
    lines += ["- XLA's involuntary full rematerializations (reshards done by replicating the "
              f"whole tensor), distinct single-mesh plans: {s['involuntary_rematerializations']}",
              f"- the replayed layouts reproduce the plans' objectives within "
              f"{s['replay_max_rel_diff']:.1%} (pipeline stage memory within "
              f"{s['replay_memory_max_rel_diff']:.1%})"]
    return lines


def _misordered(rank: dict) -> list[str]:
    """The pairs the prediction orders one way and the actual figures the other."""
    pred, actual = rank["predicted_order"], rank["actual_order"]
    pos = {plan: i for i, plan in enumerate(actual)}
    return [f"{a} / {b}" for i, a in enumerate(pred) for b in pred[i + 1:] if pos[a] > pos[b]]


def analysis(audit_rows, measured_rows, summary, schedulers, other_info) -> list[str]:
    """What the tables say, computed from this run's rows (no figure written by hand)."""
    s = summary
    reps = [audit_rows[i] for i in (g["rows"][0] for g in dedupe(audit_rows))]
    pipes = [r for r in reps if r["kind"] == "pipeline"]
    lines = ["## What the figures say", "",
             f"Of {s['cases']} cases, {s['distinct_plans']} are distinct plans; each is counted "
             "once (its first case).  Re-pricing a plan's own layout on its own cluster "
             f"reproduces the search's objective within {s['replay_max_rel_diff']:.1%}, so "
             "the figures compare the plan that was emitted.", ""]
    mem_parts = []
    for sched in schedulers:
        m = s["memory"][sched]
        mem_parts.append(f"{sched} scheduler {_within(m)}, {_spread(m)}"
                         + (f"; outside: {', '.join(m['outside'])}" if m["outside"] else ""))
    gap = []
    if len(schedulers) == 2:
        a, b = schedulers
        ratios = [max(r["audit_memory_by_scheduler"][a]) / max(r["audit_memory_by_scheduler"][b])
                  for r in reps if b in r["audit_memory_by_scheduler"]]
        if ratios:
            gap.append(f"The {a} scheduler's compiled peak is {min(ratios):.2f}–"
                       f"{max(ratios):.2f}x the {b} scheduler's (largest stage).")
    lines.append("1. **Memory within ±10%: " + "; ".join(mem_parts) + ".**  "
                 + " ".join(gap) + "  The prediction is the layout under XLA:CPU's memory rules"
                 " (`memory.analyze(cpu=True)`); the plans were searched under the GPU rules ("
                 + ", ".join(f"{sched}: {_within(s['memory_gpu_rules'][sched])} within ±10%"
                             for sched in schedulers) + ")." + _memory_note(reps, schedulers[0]))
    if other_info and other_info.get("error"):
        lines.append(f"   The {other_info['scheduler']} scheduler's compile did not finish: "
                     f"{other_info['error'][:300]}")
    b = s["bytes"]
    zero3 = [o for o in b["outside"] if " zero3 " in f" {o} "]
    lines.append(f"2. **Communication bytes within ±15%: {_within(b)} ({_spread(b)}).**  "
                 + (f"Outside: {', '.join(b['outside'])}." if b["outside"] else "None outside.")
                 + (" ZeRO-3: on CPU XLA lowers each reduce-scatter to an all-reduce + "
                    "dynamic-slice (JAX-NOTES), about doubling its bytes." if zero3 else "")
                 + _pipeline_bytes_note(pipes))
    ranks = []
    for r in s["ranking_predicted_vs_audited"]:
        wrong = _misordered(r)
        ranks.append(f"{r['model']}: Spearman {r['spearman']:.2f}, "
                     f"{r['concordant_pairs']}/{r['pairs']} pairs concordant, best plan "
                     f"({r['actual_order'][0]}) {'predicted' if r['same_best'] else 'missed'}"
                     + (f", misordered: {'; '.join(wrong[:6])}"
                        + (f" (+{len(wrong) - 6} more)" if len(wrong) > 6 else "")
                        if wrong else ""))
    t = s["time"]
    lines.append(f"3. **Step time on {PLAN_CLUSTER}: {_within(t)} within ±25% of the audit "
                 f"({_spread(t)}).**{_latency_note(reps, t)}  Ranking by predicted against "
                 f"audited time over the distinct plans: {'; '.join(ranks)}.")
    if pipes:
        mem = [memory_ratio(r["pred_memory_bytes"], r["audit_memory_by_scheduler"][sch])
               for r in pipes for sch in schedulers if sch in r["audit_memory_by_scheduler"]]
        lines.append(f"4. **Pipelines ({len(pipes)} distinct): stage memory predicted / audited "
                     f"{_range_of(mem)} (worst stage per plan and scheduler), communication "
                     f"bytes {_range_of(r['bytes_ratio'] for r in pipes)}, step time "
                     f"{_range_of(r['time_ratio'] for r in pipes)}.**  The stages' replayed "
                     f"memory under GPU rules matches the planner's within "
                     f"{s['replay_memory_max_rel_diff']:.1%}.")
    lines.append(f"5. **XLA's involuntary full rematerializations: "
                 f"{s['involuntary_rematerializations']} on the distinct single-mesh plans** "
                 "(counted from the compile's log, `autopar.cost_model.compile_log`).")
    if measured_rows:
        ranks = []
        for r in s["ranking_predicted_vs_measured"]:
            times = [m["measured_s"] * 1e3 for m in measured_rows if m["model"] == r["model"]]
            ranks.append(f"{r['model']}: Spearman {r['spearman']:.2f}, best plan "
                         f"({r['actual_order'][0]}) "
                         f"{'predicted' if r['same_best'] else 'missed'}, measured "
                         f"{min(times):.1f}–{max(times):.1f} ms")
        lines.append(
            "6. **cpu-local: predictions are "
            f"{_range_of(r['time_ratio'] for r in measured_rows)} of the measured medians.**  "
            f"{'; '.join(ranks)}.")
    return lines


def _memory_note(reps: Sequence[dict], scheduler: str) -> str:
    """The worst single-mesh memory case, by its compiled terms."""
    single = [r for r in reps if r["kind"] == "single"
              and scheduler in r["memory_ratio_by_scheduler"]]
    if not single:
        return ""
    r = max(single, key=lambda r: abs(math.log(r["memory_ratio_by_scheduler"][scheduler])))
    m = r["audit_memory"][0]
    return (f"  Worst single-mesh plan, {r['model']} {r['plan']}: predicted "
            f"{_mib(r['pred_memory_bytes'][0])} MiB, compiled {_mib(r['audit_memory_bytes'][0])} "
            f"MiB, of which temporaries {_mib(m['temp_bytes'])} MiB (arguments "
            f"{_mib(m['argument_bytes'])} MiB).")


def _pipeline_bytes_note(pipes: Sequence[dict]) -> str:
    """How much of the pipelines' audited bytes run once per step (finalize, apply)."""
    if not pipes:
        return ""
    once = [(r, sum(v for k, v in r["audit_comm_by_program"].items()
                    if k not in ("forward", "backward"))) for r in pipes]
    return (f"  Pipelines: {_range_of(o / r['audit_comm_volume_bytes'] for r, o in once)} of "
            "the audited bytes are in the programs a stage runs once per step (finalize: "
            "the accumulated gradients reduced into the optimizer state's layout; apply: the "
            "update), which alone come to "
            f"{_range_of(o / max(r['pred_comm_volume_bytes'], 1.0) for r, o in once)}x the "
            "predicted bytes of the whole step.")


def _latency_note(reps: Sequence[dict], t: dict) -> str:
    """The worst time case's collectives and their latency."""
    worst = next((r for r in reps if f"{r['model']} {r['plan']}" == t["worst_case"]), None)
    if worst is None or not t["worst"] < 1.0:
        return ""
    return (f"  {t['worst_case']}: the audit runs {worst['audit_collectives']} collectives "
            f"per step, whose latency (α) alone is {worst['audit_latency_s'] * 1e6:.1f} µs of "
            f"its {worst['audit_step_s'] * 1e6:.1f} µs (predicted "
            f"{worst['pred_step_s'] * 1e6:.1f} µs): the audit prices every collective with its "
            "full α, the model pro-rates α over a combined bucket.")


def _range_of(values) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "–"
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}"


_COLORS = {"dp": "C0", "zero3": "C1", "tp": "C2", "shard": "C3", "pipeshard": "C4",
           "3d": "C5"}
_MARKERS = {"mlp": "o", "gpt": "^", "moe": "s", "wrn": "D"}


def plot(audit_rows, measured_rows, schedulers, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    reps = [audit_rows[g["rows"][0]] for g in dedupe(audit_rows)]

    def points(rows, pk, ak):
        return [(r[pk], r[ak], r) for r in rows]

    def memory_points(sched):
        return [(p, a, r) for r in reps if sched in r["audit_memory_by_scheduler"]
                for p, a in zip(r["pred_memory_bytes"], r["audit_memory_by_scheduler"][sched])]

    panels = [("communication volume (bytes/step)",
               points(reps, "pred_comm_volume_bytes", "audit_comm_volume_bytes"), "audited")]
    panels += [(f"per-device memory, {s} scheduler", memory_points(s), "compiled")
               for s in schedulers]
    panels.append((f"step time on {PLAN_CLUSTER} (s)",
                   points(reps, "pred_step_s", "audit_step_s"), "audit priced"))
    if measured_rows:
        panels.append(("cpu-local step time (s)",
                       points(measured_rows, "pred_step_s", "measured_s"), "measured"))
    fig, axs = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.6))
    for ax, (title, pts, xlabel) in zip(np.atleast_1d(axs), panels):
        pts = [(p, a, r) for p, a, r in pts if p > 0 and a > 0]
        for p, a, r in pts:
            ax.scatter(a, p, c=_COLORS.get(r["method"], "k"),
                       marker=_MARKERS.get(r["model"], "x"), s=36, alpha=0.85)
        if pts:
            lo = min(min(p, a) for p, a, _ in pts) / 2
            hi = max(max(p, a) for p, a, _ in pts) * 2
            ax.plot([lo, hi], [lo, hi], "k--", lw=1)
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel("predicted")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=m)
               for m, c in _COLORS.items()]
    handles += [plt.Line2D([], [], color="gray", marker=mk, ls="", label=m)
                for m, mk in _MARKERS.items()]
    handles.append(plt.Line2D([], [], color="k", ls="--", label="y = x"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smaller MLP and GPT, fewer plans, 3 timed steps")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated subset of {','.join(MODELS)} (default: all; "
                             f"--quick: {','.join(QUICK_MODELS)})")
    parser.add_argument("--skip-measured", action="store_true",
                        help="skip the cpu-local timing part")
    parser.add_argument("--one-scheduler", action="store_true",
                        help="audit memory under this process's XLA:CPU scheduler only")
    parser.add_argument("--replay-timeout", type=float, default=REPLAY_TIMEOUT_S,
                        help="seconds the other scheduler's subprocess may take")
    parser.add_argument("--out-dir", default=str(RESULTS), help="where the results go")
    parser.add_argument("--replay-memory", nargs=2, metavar=("PLANS", "OUT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if len(jax.devices()) < 8:
        raise SystemExit(f"needs 8 devices, got {len(jax.devices())} (XLA_FLAGS={_FLAG})")
    # Every plan is searched (a plan cache hit would time nothing); AUTOPAR_CACHE_DIR set by
    # the caller wins.
    os.environ.setdefault("AUTOPAR_CACHE_DIR", "")
    if args.replay_memory:
        replay_memory(pathlib.Path(args.replay_memory[0]), pathlib.Path(args.replay_memory[1]),
                      args.quick)
        return 0
    t0 = time.perf_counter()
    names = (args.models.split(",") if args.models
             else list(QUICK_MODELS if args.quick else MODELS))
    built = make_models(args.quick, names)
    here = scheduler_of(os.environ.get("XLA_FLAGS", ""))
    auditor = Auditor(here)
    print(f"part 1: plans for {PLAN_CLUSTER}, compiled on 8 CPU devices ({here} scheduler), "
          "audited", flush=True)
    audit_rows, ladder = auditor.run(built, args.quick)
    for i, r in enumerate(audit_rows):
        r["row_id"] = i
    schedulers = [here]
    other_info = None
    if not args.one_scheduler:
        print("part 1b: the same plans compiled under the other XLA:CPU scheduler", flush=True)
        other_info = other_scheduler(auditor, audit_rows, args.quick, args.replay_timeout)
        schedulers = [s for s in SCHEDULERS if s in (here, other_info["scheduler"])]
    load = [os.getloadavg()[0]]
    measured_rows = []
    if not args.skip_measured:
        print("part 2: plans for cpu-local, timed", flush=True)
        measured_rows = measured_part(built, args.quick, 3 if args.quick else 5)
        load.append(os.getloadavg()[0])
    summary = summarize(audit_rows, measured_rows, schedulers)
    lines = tables(audit_rows, measured_rows, summary, schedulers, ladder)
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / "cost_model_accuracy"
    seconds = time.perf_counter() - t0
    config = {"quick": args.quick, "plan_cluster": PLAN_CLUSTER, "jax": jax.__version__,
              "seconds": seconds, "models": {n: m.describe for n, m in built.items()},
              "micro_batches": MICRO, "budget_fractions": list(BUDGET_FRACTIONS),
              "schedulers": {here: os.environ.get("XLA_FLAGS", ""),
                             **({other_info["scheduler"]: other_info["xla_flags"]}
                                if other_info else {})},
              "other_scheduler": other_info, "load_average_1min": load,
              "cpus": os.cpu_count(), "tolerances": TOLERANCES}
    meta = stamp()
    stem.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "config": config, "audit": audit_rows, "budgets": ladder,
         "measured": measured_rows, "summary": summary}, indent=1, default=float))
    load_note = ("1-minute load average " + " → ".join(f"{x:.1f}" for x in load)
                 + f" on {os.cpu_count()} CPUs (before → after the timed part): other jobs "
                 "share the machine, so measured times are noisy; the audited figures are not "
                 "timed.")
    header = ["# Cost-model accuracy", "", stamp_markdown(meta), "",
              f"`python -m benchmarks.cost_model_accuracy{' --quick' if args.quick else ''}"
              f"{' --models ' + args.models if args.models else ''}` ({seconds:.0f} s, jax "
              f"{jax.__version__}, 8 emulated CPU devices; {load_note}).  Models: "
              + "; ".join(f"{n}: {m.describe}" for n, m in built.items())
              + ".  Plans: dp / zero3 (1-D mesh of 8), tp = benchmarks/baselines.MegatronTP, "
              "auto = ShardParallel (mesh given, or chosen by the planner), auto ≤f = "
              "ShardParallel under a memory budget of f × the unconstrained plan's predicted "
              f"memory, pipeshard = PipeshardParallel(num_stages=2), 3d = "
              f"Manual3DParallel(2, 2, 2), {MICRO} micro-batches.  Ratios are predicted / "
              "audited (or measured).", ""]
    body = (header + summary_lines(summary, schedulers) + [""] + lines + [""]
            + analysis(audit_rows, measured_rows, summary, schedulers, other_info))
    stem.with_suffix(".md").write_text("\n".join(body) + "\n")
    plot(audit_rows, measured_rows, schedulers, stem.with_suffix(".png"))
    print("\n".join(summary_lines(summary, schedulers)))
    print(f"wrote {stem}.{{md,json,png}} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
