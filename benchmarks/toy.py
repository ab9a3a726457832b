"""Toy suite: every strategy's plan runs for real on 8 emulated CPU devices and is checked
against the single-device `jax.jit` step (issue 6).

    autopar bench toy            # or: python -m benchmarks toy (both set up 8 CPU devices)

For each toy model (GPT, GShard MoE, Wide-ResNet at toy size) and strategy (the hand-written
ones as autopar methods: `DataParallel`, `Zero2Parallel`, `Zero3Parallel`, `MegatronTP`,
`Manual3DParallel(2, 2, 2)`; autopar's `ShardParallel` and `PipeshardParallel`) it runs two
AdamW steps and reports the largest difference from the reference (`jax.jit` of the same
step; for micro-batched plans the reference averages the gradients of the same strided
micro-batches, written without autopar), the plan's predicted step on `cpu-local`, the
measured CPU step time, and what XLA built: collective bytes and per-device memory of the
compiled program (every stage's forward and backward for pipelines).

Tolerances: losses rtol 1e-4; every state leaf (parameters, AdamW moments, BatchNorm
statistics) within atol 3e-4 + rtol 1e-3 x the leaf's largest magnitude.  AdamW's normalized
update can move a parameter whose gradient is at rounding level by up to its learning rate
(1e-4) per step; micro-batched BatchNorm gradients cancel heavily: wrn-toy's 3-D plan differs
from its reference by 8e-4 of the largest first moment in float32 and by under 1e-9 with
float64 (checked once by hand), i.e. by rounding.
"""

from __future__ import annotations

import pathlib
import sys
import time
from collections.abc import Callable

import jax
import numpy as np

import autopar
from autopar import models as zoo
from autopar.cost_model import hlo_audit
from autopar.cost_model.jsonio import write_json_atomic
from benchmarks.baselines import MegatronTP, input_names

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MODELS = ("gpt-toy", "moe-toy", "wrn-toy")
BATCH = 16
MICRO = 4
STEPS = 2
LOSS_RTOL = 1e-4
PARAM_ATOL = 3e-4
PARAM_RTOL = 1e-3
_BATCH_KEYS = {"tokens", "images", "x"}


def micro_batched_value_and_grad(num: int) -> Callable:
    """A reference `value_and_grad`: splits the batch argument (the dict holding "tokens",
    "images" or "x") into `num` strided micro-batches (rows m, m+num, ...), and averages
    loss, aux and gradients over them."""

    def value_and_grad(fun, argnums=0, has_aux=False):
        def run(*args):
            (pos,) = [i for i, a in enumerate(args) if isinstance(a, dict) and _BATCH_KEYS & set(a)]
            outs = []
            for m in range(num):
                part = jax.tree.map(
                    lambda x, m=m: x.reshape((x.shape[0] // num, num) + x.shape[1:])[:, m],
                    args[pos])
                outs.append(jax.value_and_grad(fun, argnums, has_aux)(
                    *args[:pos], part, *args[pos + 1:]))
            return jax.tree.map(lambda *xs: sum(xs) / num, *outs)

        return run

    return value_and_grad


def methods(state, batch) -> dict[str, tuple[object, int]]:
    """Strategy name → (autopar method, micro-batches)."""
    return {
        "dp": (autopar.DataParallel(), 1),
        "zero2": (autopar.Zero2Parallel(), 1),
        "zero3": (autopar.Zero3Parallel(), 1),
        "megatron": (MegatronTP(mesh_shape=(8,), input_names=input_names(state, batch)), 1),
        "3d": (autopar.Manual3DParallel(dp=2, tp=2, pp=2, num_micro_batches=MICRO), MICRO),
        "autopar-shard": (autopar.ShardParallel(time_limit_s=20.0), 1),
        "autopar": (autopar.PipeshardParallel(num_micro_batches=MICRO, time_limit_s=10.0),
                    MICRO),
    }


def run_steps(step, state, batches):
    """Runs `step` over `batches`; returns the final state and the losses."""
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return state, losses


def _audit(step, plan, state, batch) -> dict:
    """Collective bytes over one step and the largest per-device memory XLA reports."""
    compiled = step.lower(state, batch).compile()
    if plan.stages:
        by_kind = compiled.collective_bytes_per_step()
        memory = max(compiled.stage_memory_bytes())
    else:
        audit = hlo_audit.audit(compiled, plan.mesh_shape, plan.mesh_axes)
        by_kind = audit.bytes_by_kind()
        memory = audit.memory.total_bytes if audit.memory is not None else None
    return {"collective_bytes": by_kind, "memory_bytes": memory}


def run_model(model: str, strategies=None, cluster: str = "cpu-local") -> list[dict]:
    """Runs every strategy on `model` (toy size) and compares with the reference."""
    state = zoo.init_state(model)
    batches = [zoo.example_batch(model, BATCH, seed=s) for s in range(1, STEPS + 1)]
    refs = {}
    for micro in (1, MICRO):
        grad = None if micro == 1 else micro_batched_value_and_grad(micro)
        ref_step = zoo.train_step_and_args(model, BATCH, value_and_grad=grad)[0]
        refs[micro] = run_steps(jax.jit(ref_step), state, batches)
    step_fn = zoo.train_step_and_args(model, BATCH)[0]
    rows = []
    for name, (method, micro) in methods(state, batches[0]).items():
        if strategies and name not in strategies:
            continue
        par = autopar.parallelize(step_fn, method=method, cluster=cluster)
        t0 = time.perf_counter()
        plan = par.get_plan(state, batches[0])
        search_s = time.perf_counter() - t0
        new_state, losses = run_steps(par, state, batches)
        t0 = time.perf_counter()
        jax.block_until_ready(par(state, batches[0]))
        measured = time.perf_counter() - t0
        ref_state, ref_losses = refs[micro]
        loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
        leaves = [(np.asarray(a), np.asarray(b)) for a, b in
                  zip(jax.tree.leaves(new_state), jax.tree.leaves(ref_state))]
        param_err = max(float(np.max(np.abs(a - b))) for a, b in leaves)
        within = all(np.max(np.abs(a - b)) <= PARAM_ATOL + PARAM_RTOL * np.max(np.abs(b))
                     for a, b in leaves)
        rows.append({
            "model": model, "strategy": name, "micro_batches": micro,
            "stages": len(plan.stages) or 1, "mesh": list(plan.stages[0].mesh_shape
                                                          if plan.stages else plan.mesh_shape),
            "losses": losses, "loss_rel_err": loss_err, "param_abs_err": param_err,
            "equal": bool(loss_err <= LOSS_RTOL and within),
            "predicted_step_s": plan.predicted.step_s, "measured_step_s": measured,
            "search_s": search_s, **_audit(par, plan, state, batches[0])})
        print(f"{model:8} {name:14} loss err {loss_err:.1e} param err {param_err:.1e} "
              f"{'ok' if rows[-1]['equal'] else 'MISMATCH'}", file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict], wall_s: float) -> str:
    lines = ["# Toy suite: plans run on 8 emulated CPU devices", "",
             f"{STEPS} AdamW steps, batch {BATCH}, against the single-device `jax.jit` step "
             f"(micro-batched plans: the same micro-batches averaged). Equal = losses within "
             f"rtol {LOSS_RTOL:g} and every state leaf within atol {PARAM_ATOL:g} + rtol "
             f"{PARAM_RTOL:g} x its largest magnitude. Predicted: the "
             f"plan's step on `cpu-local`; measured: one step here (shared 2-core machine, "
             f"noisy). Collective bytes and memory per device: read from the compiled HLO. "
             f"{wall_s:.0f} s in all.", "",
             "| model | strategy | stages x mesh | µb | equal | loss rel err | state abs err "
             "| predicted (ms) | measured (ms) | collective bytes | memory/device |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        coll = ", ".join(f"{k} {v / 1e3:.0f} kB" for k, v in sorted(r["collective_bytes"].items()))
        mem = f"{r['memory_bytes'] / 1e6:.2f} MB" if r["memory_bytes"] is not None else "—"
        lines.append(f"| {r['model']} | {r['strategy']} | {r['stages']} x {tuple(r['mesh'])} | "
                     f"{r['micro_batches']} | {'yes' if r['equal'] else '**no**'} | "
                     f"{r['loss_rel_err']:.1e} | {r['param_abs_err']:.1e} | "
                     f"{r['predicted_step_s'] * 1e3:.2f} | {r['measured_step_s'] * 1e3:.1f} | "
                     f"{coll or 'none'} | {mem} |")
    return "\n".join(lines) + "\n"


def run(out_dir: pathlib.Path = RESULTS, models=MODELS, strategies=None) -> list[dict]:
    if len(jax.devices()) < 8:
        raise RuntimeError(f"the toy suite needs 8 devices, this process has "
                           f"{len(jax.devices())} (set XLA_FLAGS="
                           f"--xla_force_host_platform_device_count=8 before importing jax)")
    t0 = time.perf_counter()
    rows = [r for m in models for r in run_model(m, strategies)]
    text = markdown(rows, time.perf_counter() - t0)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / "toy-cpu-local.json", rows)
    tmp = out_dir / "toy-cpu-local.md.tmp"
    tmp.write_text(text)
    tmp.replace(out_dir / "toy-cpu-local.md")
    print(text)
    return rows
