"""autopar's intra-op plans against the hand-written plans Alpa's test suite expects.

`python -m benchmarks.intra_op_reference [--cases a,b] [--meshes 4,1x4,2x2]`

For each case of `benchmarks.alpa_cases` (Alpa's `tests/shard_parallel/` families at their
sizes) and each logical mesh of 4 emulated CPU devices, this plans and compiles the step
with `ShardParallel(mesh_shape=...)` under a communication-only cluster (Alpa's test
clusters: α = 0, β = 1 s/byte, free compute and memory traffic), and compiles every
hand-written reference plan that applies (data parallel; Megatron-style tensor parallel over
the whole mesh; on 2-D meshes data parallel over the first axis x tensor parallel over the
second; expert parallel for MoE) as a `jax.jit` program with those parameter, optimizer-state
and batch layouts.  Both start from the same inputs: the batch arrives split on dim 0 over
the mesh (`ShardParallel`'s input contract); a reference that wants it otherwise re-lays it
out inside its program, as autopar must.  Communication is read from the compiled HLO
(`cost_model.hlo_audit`) and priced by the same α-β model (XLA:CPU lowerings), so the ratio
autopar / best reference is bytes moved over bytes moved.  Each case is also run for 2 steps
with plain SGD under its ShardParallel plan and compared with the single-device `jax.jit`
step (`_check_equal`).

Writes benchmarks/results/intra_op_reference.md and .json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":  # before any JAX import: 8 emulated devices (4 used)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.cost_model import ClusterSpec, Link, hlo_audit
from autopar.methods import batch_input_spec
from autopar.passes.sharding_spec import MeshContext
from benchmarks import alpa_cases as ac
from benchmarks.stamp import stamp, stamp_markdown

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEVICES = 4
GOAL = 1.05
RTOL, ATOL = 2e-4, 2e-5
ORACLE_TX = optax.sgd(0.05)
MESHES = {"4": (4,), "1x4": (1, 4), "2x2": (2, 2)}
HUGE = 1e30


@dataclasses.dataclass(frozen=True)
class Case:
    """One of Alpa's intra-op test cases.

    Attributes:
      name: short name.
      family: the layer family (Alpa's test file).
      alpa_test: Alpa's test function it follows.
      expects: the plan Alpa's test asserts, in words.
      build: (tx=None) -> the case's step and arguments (`tx`: another optimizer).
      references: names of the hand-written plans to compile (see `_reference_layouts`).
      micro_batches: ShardParallel's `num_micro_batches` (the references run the whole batch
        at once: one gradient reduction per step is what they do).
    """

    name: str
    family: str
    alpa_test: str
    expects: str
    build: Callable[[], ac.Built]
    references: tuple[str, ...] = ("dp", "megatron", "dp x megatron")
    micro_batches: int = 1


CASES: tuple[Case, ...] = (
    Case("mlp-dp", "mlp", "test_n_layer_mlp_data_parallel", "one all-reduce of the gradients",
         lambda tx=None: ac.mlp(6, 256, 32, tx)),
    Case("mlp-mp", "mlp", "test_n_layer_mlp_model_parallel",
         "Megatron: 5 all-reduces of the activations", lambda tx=None: ac.mlp(6, 32, 256, tx)),
    Case("grad-acc", "gradient accumulation", "test_gradient_accumulation",
         "2 micro-batches, one all-reduce of the gradients per step",
         lambda tx=None: ac.mlp_momentum(2, 256, 16, tx), micro_batches=2),
    Case("conv-dp", "conv", "test_n_layer_conv_data_parallel",
         "one all-reduce of the gradients + BatchNorm's statistics",
         lambda tx=None: ac.conv(3, 16, 16, 4, tx)),
    Case("conv-mp", "conv", "test_n_layer_conv_model_parallel",
         "channel-parallel: 3 all-reduces of the activations",
         lambda tx=None: ac.conv(4, 8, 16, 256, tx)),
    Case("depthwise-mp", "conv", "test_n_layer_depthwise_conv_model_parallel",
         "channel-parallel: 1 all-reduce", lambda tx=None: ac.depthwise(4, 8, 256, tx),
         references=("dp", "depthwise megatron", "dp x depthwise megatron")),
    Case("bert-layer-dp", "bert", "test_bert_layer_data_parallel",
         "one all-reduce of the gradients", lambda tx=None: ac.bert_layers(64, 64, 2, 32, 8, tx)),
    Case("bert-layer-mp", "bert", "test_bert_layer_model_parallel",
         "Megatron: 7 all-reduces of the activations",
         lambda tx=None: ac.bert_layers(8, 8, 2, 128, 8, tx)),
    Case("bert-mlm-dp", "bert", "test_bert_mlm_data_parallel",
         "one all-reduce of the gradients", lambda tx=None: ac.bert_mlm(32, 32, 2, 16, 4, 128, tx)),
    Case("bert-mlm-2d", "bert", "test_bert_mlm_2d_mesh",
         "Megatron with a vocabulary-split embedding (x data parallel on 2-D)",
         lambda tx=None: ac.bert_mlm(4, 4, 2, 512, 4, 4096, tx)),
    Case("moe-layer", "moe", "test_moe_layer", "expert parallel: 4 all-to-alls, 1 all-reduce",
         lambda tx=None: ac.moe_layer(64, 16, 64, 16, 32, 16, tx),
         references=("dp", "experts", "megatron")),
    Case("moe-lm", "moe", "test_moe_lm", "expert parallel: 4 all-to-alls, <= 4 all-reduces",
         lambda tx=None: ac.moe_lm(64, 16, 2, 64, 16, 32, 32, 16, tx),
         references=("dp", "experts")),
)


def comm_only_cluster() -> ClusterSpec:
    """Alpa's test cluster on this machine's first 4 devices: α = 0, β = 1 s/byte on every
    link, compute and memory traffic free, so a step's seconds are its α-β bytes."""
    base = ClusterSpec.from_devices(jax.devices()[:DEVICES])
    return dataclasses.replace(base, name=f"{DEVICES}xCPU-bytes", intra_host=Link(0.0, 1.0),
                               inter_host=Link(0.0, 1.0), peak_flops={"float32": HUGE},
                               memory_bandwidth_bytes_per_s=HUGE)


def mesh_of(shape: tuple[int, ...]) -> Mesh:
    names = ("x",) if len(shape) == 1 else ("a", "b")
    devices = np.array(jax.devices()[:DEVICES]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


def _forced_batch(batch: dict, mesh: Mesh, cluster: ClusterSpec) -> dict:
    """The batch layout ShardParallel's inputs arrive in (`methods.batch_input_spec`)."""
    ctx = MeshContext.build(tuple(mesh.devices.shape), cluster)
    names = dict(zip(ctx.axes, mesh.axis_names))

    def one(x):
        spec = batch_input_spec(np.shape(x), ctx)
        return NamedSharding(mesh, P(*(tuple(names[a] for a in e) or None for e in spec)))

    return jax.tree.map(one, batch)


def _reference_layouts(name: str, mesh: Mesh) -> tuple[tuple, tuple, tuple[str, ...]] | None:
    """(parameter rules, tensor-parallel axes, batch axes) of reference plan `name` on
    `mesh`, or None where it does not apply (a 2-D plan on a mesh with an axis of 1)."""
    every = tuple(mesh.axis_names)
    sized = [a for a in every if mesh.shape[a] > 1]
    megatron = ac.DEPTHWISE_MEGATRON if "depthwise" in name else ac.MEGATRON
    if name == "dp":
        return (), (), every
    if name == "experts":
        return ac.EXPERTS, every, every
    if name.startswith("dp x"):
        if len(sized) < 2:
            return None
        return megatron, (every[1],), (every[0],)
    return megatron, every, ()


def audit_compiled(compiled, mesh_shape, mesh_axes, device_ids, cluster) -> dict:
    found = hlo_audit.audit(compiled, mesh_shape, mesh_axes, device_ids)
    counts: dict[str, int] = {}
    for c in found.collectives:
        if c.nbytes > 8:  # scalar reductions (the loss) left out of the counts, as Alpa's
            counts[c.kind] = counts.get(c.kind, 0) + c.count
    priced = found.price(cluster)
    return {"comm_bytes_s": priced["communication_s"], "total_s": priced["total_s"],
            "counts": counts, "bytes_by_kind": found.bytes_by_kind()}


def run_reference(case_built: ac.Built, name: str, mesh: Mesh, cluster: ClusterSpec) -> dict:
    """Compiles reference plan `name` and audits it (None when it does not apply)."""
    spec = _reference_layouts(name, mesh)
    if spec is None:
        return None
    rules, tp, batch_axes = spec
    state_sh = ac.layout(case_built.state, rules, tp, mesh)
    inside = jax.tree.map(
        lambda x: NamedSharding(mesh, P(batch_axes if batch_axes and np.ndim(x) and
                                        np.shape(x)[0] % int(np.prod(
                                            [mesh.shape[a] for a in batch_axes])) == 0
                                        else None)), case_built.batch)

    def step(state, batch):
        return case_built.step(state, jax.lax.with_sharding_constraint(batch, inside))

    jitted = jax.jit(step, in_shardings=(state_sh, _forced_batch(case_built.batch, mesh, cluster)),
                     out_shardings=(state_sh, NamedSharding(mesh, P())))
    compiled = jitted.lower(case_built.state, case_built.batch).compile()
    ids = [d.id for d in mesh.devices.flat]
    return audit_compiled(compiled, tuple(mesh.devices.shape), tuple(mesh.axis_names), ids, cluster)


def _max_rel_error(got, want) -> float:
    worst = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.size:
            worst = max(worst, float(np.max(np.abs(g - w) / (ATOL + RTOL * np.abs(w)))))
    return worst


def _check_equal(case: Case, shape: tuple[int, ...], cluster: ClusterSpec,
                 time_limit_s: float) -> float:
    """The largest |got - want| / (ATOL + RTOL·|want|) over the loss and every state leaf
    after 2 steps of the case's model and loss with plain SGD (`ORACLE_TX`), autopar's
    ShardParallel plan on `shape` against the single-device `jax.jit` step: the partitioned
    forward and backward are checked on updates linear in the gradients.  (Adam and
    Adafactor move an element whose gradient is zero up to rounding, e.g. an attention key's
    bias, by ±lr whatever its sign noise, so their updated parameters cannot be compared
    elementwise.)"""
    built = case.build(ORACLE_TX)
    method = autopar.ShardParallel(mesh_shape=shape, time_limit_s=time_limit_s,
                                   num_micro_batches=case.micro_batches)
    par = autopar.parallelize(built.step, method=method, devices=jax.devices()[:DEVICES],
                              cluster=cluster, donate_argnums=())
    ref = jax.jit(built.step)
    got, want = (built.state, None), (built.state, None)
    worst = 0.0
    for _ in range(2):
        got, want = par(got[0], built.batch), ref(want[0], built.batch)
        worst = max(worst, _max_rel_error(got, want))
    return worst


def run_autopar(case: Case, built: ac.Built, mesh_shape: tuple[int, ...],
                cluster: ClusterSpec, time_limit_s: float) -> dict:
    """Plans, compiles, audits and runs ShardParallel; checks one step against jax.jit."""
    method = autopar.ShardParallel(mesh_shape=mesh_shape, time_limit_s=time_limit_s,
                                   num_micro_batches=case.micro_batches)
    par = autopar.parallelize(built.step, method=method, devices=jax.devices()[:DEVICES],
                              cluster=cluster, donate_argnums=())
    start = time.perf_counter()
    plan = par.get_plan(built.state, built.batch)
    plan_s = time.perf_counter() - start
    compiled = par.lower(built.state, built.batch).compile()
    out = audit_compiled(compiled, plan.mesh_shape, plan.mesh_axes, plan.device_ids, cluster)
    err = _check_equal(case, shape=mesh_shape, cluster=cluster, time_limit_s=time_limit_s)
    return {**out, "predicted_comm_s": plan.predicted.comm_s, "plan_s": plan_s,
            "error_over_tolerance": err, "equal": err <= 1.0,
            "fallbacks": len(getattr(par.trace(built.state, built.batch), "fallbacks", ()))}


def run_case(case: Case, mesh_name: str, cluster: ClusterSpec, time_limit_s: float) -> dict:
    shape = MESHES[mesh_name]
    built = case.build()
    mesh = mesh_of(shape)
    refs = {}
    for name in case.references:
        got = run_reference(built, name, mesh, cluster)
        if got is not None:
            refs[name] = got
    best = min(refs, key=lambda r: refs[r]["comm_bytes_s"])
    mine = run_autopar(case, built, shape, cluster, time_limit_s)
    ref_bytes = refs[best]["comm_bytes_s"]
    ratio = mine["comm_bytes_s"] / ref_bytes if ref_bytes > 0 else (
        1.0 if mine["comm_bytes_s"] == 0 else float("inf"))
    return {"case": case.name, "family": case.family, "alpa_test": case.alpa_test,
            "expects": case.expects, "mesh": mesh_name, "autopar": mine, "references": refs,
            "best_reference": best, "ratio": ratio, "meets": ratio <= GOAL}


def counts_text(counts: dict[str, int]) -> str:
    short = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS",
             "all-to-all": "A2A", "collective-permute": "CP"}
    return " ".join(f"{n} {short.get(k, k)}" for k, n in sorted(counts.items())) or "none"


def median(xs) -> float:
    """The upper median of `xs` (nan when empty)."""
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def page_head(title: str, meta: dict, doc: str) -> list[str]:
    """A results page's first lines: its title, the run's stamp and the module docstring's
    third paragraph (what the page measures) on one line."""
    return [f"# {title}", "", stamp_markdown(meta), "",
            doc.split("\n\n")[2].replace("\n", " ").strip()]


def markdown(rows: list[dict], meta: dict, wall_s: float) -> str:
    met = sum(r["meets"] for r in rows)
    equal = sum(r["autopar"]["equal"] for r in rows)
    ratios = sorted(r["ratio"] for r in rows)
    lines = [
        *page_head("Intra-op plans against the hand-written plans of Alpa's tests", meta,
                   __doc__),
        "",
        f"**{met} of {len(rows)} runs within {GOAL:.2f}x of the best reference plan's "
        f"communication**; worst {ratios[-1]:.3f}x, median {median(ratios):.3f}x; "
        f"{equal} of {len(rows)} equal to the single-device jax.jit step (|got - ref| <= "
        f"{ATOL} + {RTOL}·|ref|, 2 SGD steps). {wall_s / 60:.1f} min in all.",
        "",
        "Over the goal: " + ("; ".join(
            f"{r['case']} on {r['mesh']} {r['ratio']:.3f}x (planned / compiled "
            f"{r['autopar']['predicted_comm_s'] / r['autopar']['comm_bytes_s']:.3f})"
            for r in rows if not r["meets"]) or "none") + ".",
        "",
        "Bytes are α-β seconds at β = 1 s/byte (`hlo_audit` sizes: an all-reduce counts its "
        "operand, an all-gather its result, an all-to-all its operand x group size), 2(n-1)/n "
        "of them for an all-reduce. Counts leave out scalar collectives (the loss).",
        "",
        "| case | mesh | Alpa expects | autopar collectives | autopar bytes | best reference "
        "| its collectives | its bytes | ratio | predicted / compiled | equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, ref = r["autopar"], r["references"][r["best_reference"]]
        pred = a["predicted_comm_s"] / a["comm_bytes_s"] if a["comm_bytes_s"] else float("nan")
        lines.append(
            f"| {r['case']} | {r['mesh']} | {r['expects']} | {counts_text(a['counts'])} | "
            f"{a['comm_bytes_s']:,.0f} | {r['best_reference']} | {counts_text(ref['counts'])} | "
            f"{ref['comm_bytes_s']:,.0f} | {r['ratio']:.3f} | {pred:.3f} | "
            f"{'yes' if a['equal'] else 'NO'} |")
    lines += ["", "Every reference compiled, bytes:", "",
              "| case | mesh | " + " | ".join(sorted({n for r in rows for n in r["references"]}))
              + " |"]
    names = sorted({n for r in rows for n in r["references"]})
    lines.append("|---|---|" + "---|" * len(names))
    for r in rows:
        cells = [f"{r['references'][n]['comm_bytes_s']:,.0f}" if n in r["references"] else "-"
                 for n in names]
        lines.append(f"| {r['case']} | {r['mesh']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--meshes", default=",".join(MESHES))
    parser.add_argument("--time-limit", type=float, default=30.0,
                        help="ShardParallel's solver limit per mesh, seconds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    wanted = args.cases.split(",")
    unknown = set(wanted) - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {[c.name for c in CASES]}")
    meshes = args.meshes.split(",")
    if set(meshes) - set(MESHES):
        parser.error(f"unknown meshes {sorted(set(meshes) - set(MESHES))}; known: {list(MESHES)}")
    if len(jax.devices()) < DEVICES:
        parser.error(f"needs {DEVICES} devices, {len(jax.devices())} found")
    cluster = comm_only_cluster()
    rows, start = [], time.perf_counter()
    for case in (c for c in CASES if c.name in wanted):
        for mesh_name in meshes:
            row = run_case(case, mesh_name, cluster, args.time_limit)
            rows.append(row)
            a = row["autopar"]
            print(f"{case.name:14} {mesh_name:4} autopar {a['comm_bytes_s']:>12,.0f} "
                  f"({counts_text(a['counts'])})  best ref {row['best_reference']:>24} "
                  f"{row['references'][row['best_reference']]['comm_bytes_s']:>12,.0f}  "
                  f"ratio {row['ratio']:.3f}  equal {a['equal']}", flush=True)
    meta = stamp()
    wall = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "intra_op_reference.md").write_text(markdown(rows, meta, wall))
    (args.out / "intra_op_reference.json").write_text(
        json.dumps({"meta": meta, "goal": GOAL, "wall_s": wall, "rows": rows}, indent=1) + "\n")
    return 0 if all(r["meets"] and r["autopar"]["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
