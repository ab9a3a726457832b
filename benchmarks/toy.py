"""Toy suite: every strategy's plan runs for real on 8 emulated CPU devices and is checked
against the single-device `jax.jit` step (issue 6).

    autopar bench toy            # or: python -m benchmarks toy (both set up 8 CPU devices)

For each toy model (GPT, GShard MoE, Wide-ResNet at toy size) and strategy (the hand-written
ones as autopar methods: `DataParallel`, `Zero2Parallel`, `Zero3Parallel`, `MegatronTP`,
`Manual3DParallel(2, 2, 2)`; autopar's `ShardParallel` and `PipeshardParallel`) it runs two
optimizer steps and reports the largest difference from the reference (`jax.jit` of the same
step; for micro-batched plans the reference averages the gradients of the same strided
micro-batches, written without autopar), the plan's predicted step on `cpu-local`, the
measured CPU step time, and what XLA built: collective bytes and per-device memory of the
compiled program (every stage's forward and backward for pipelines).

Optimizer and learning rate: SGD with Nesterov momentum 0.9 (Alpa's Wide-ResNet optimizer;
`optimizer()`) at LR = 0.03 for every model.  The rate is picked so that the comparison can
see a missing update: the reference's two steps move every parameter leaf by at least
MIN_MOVE_OVER_TOL = 100 times that leaf's tolerance (below), and the suite checks it (the
movement check).  Measured smallest ratios at 0.03: gpt-toy 343 (a key kernel), moe-toy 332
(a LayerNorm scale, |x| = 1, move ~5e-4), wrn-toy 626 (a BatchNorm scale).  At 0.01 the
LayerNorm scales move only ~150-180 x their tolerance (little margin); at 0.1 wrn-toy is
past the rate where float32 rounding of the first step changes the second step's gradients by
up to 20% of a leaf (measured against a float64 run of the same reference): no plan could
match it.

Why not AdamW (the zoo's default; the suite ran 2 AdamW steps at lr 1e-4 before issue 41,
moving parameters ~2e-4 against an atol of 3e-4: a plan that never updated would have passed):
its update g / (sqrt(v) + eps) is normalized element by element, so an element whose gradient
is at rounding level moves by up to the learning rate in a direction set by rounding.  Such
elements exist: the attention key biases (true gradient 0: softmax is invariant to them;
float64 gradients ~1e-18, float32 ~1e-9), and elements of micro-batched BatchNorm gradients,
where float32 cancellation leaves errors up to 2.5e-4 of the leaf's largest gradient.  The
plan and the reference then differ by as much as the parameters move, at any learning rate.
SGD's update is linear in the gradient: a leaf's difference from the reference relative to
its movement is the relative error of the plan's gradients (<= 1e-6 for gpt-toy and moe-toy
against float64), and the momentum buffer is optimizer state the ZeRO plans split.

wrn-toy runs at batch 64 (BATCHES), the others at BATCH = 16: wrn-toy's last stage is 1x1
pixel, so a BatchNorm there normalizes over one value per image; over micro-batches of 4
images float32 rounding of the first step changed the second step's micro-batched gradients by
up to 11% of a leaf (against float64, at lr 0.01-0.1); 16 images per micro-batch keep them at
rounding level (err/tol 0.04 against float64 at lr 0.03).

Tolerances, per state leaf (parameters, momentum, BatchNorm statistics), from the leaf's
initial value x0 and the reference's final value x (`leaf_tolerance`):

    tol = ATOL + VALUE_RTOL * max|x| + MOVE_RTOL * max|x - x0|

MOVE_RTOL = 1e-3: the relative error of the plan's update (above; the plans measure
err/tol <= 0.05 on wrn-toy); VALUE_RTOL = 2^-20 (8 float32 ulps): adding the same update to
the same value may round differently in the two programs; ATOL = 1e-7: a floor for leaves that
stay ~0, the key biases' momentum, which holds their gradients' rounding noise (plans differ
from the reference there by up to 2.5e-9 on gpt-toy and moe-toy, 1.1e-8 on the tests' GPT).
Losses: rtol LOSS_RTOL = 1e-4.  A leaf that is not floating point must be equal.

Movement check (`movement`): max|x - x0| of every parameter leaf, divided by its tolerance,
must be at least 100, so a plan that drops a leaf's update (or 1% of it) differs by at least
100 tolerances.  Exempt: leaves the reference moves by at most NO_GRADIENT = 1e-6 of the
model's largest movement, i.e. whose gradient is 0 up to float32 rounding (in the zoo: the
attention key biases, moved ~1e-10 against ~1e-2): the loss does not depend on them, no
comparison can see their update, and dropping it is harmless.  They are named in the results
and still compared (a plan that corrupts them fails).  `compare` applies all of this; equal
is False with the reasons when any part fails.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

import autopar
from autopar import models as zoo
from autopar.cost_model import hlo_audit
from autopar.cost_model.jsonio import write_json_atomic
from benchmarks.baselines import MegatronTP, input_names
from benchmarks.stamp import stamp, stamp_markdown

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MODELS = ("gpt-toy", "moe-toy", "wrn-toy")
BATCH = 16
BATCHES = {"wrn-toy": 64}  # per-model exceptions to BATCH (module docstring)
MICRO = 4
STEPS = 2
LR = 0.03
MOMENTUM = 0.9
LOSS_RTOL = 1e-4
MOVE_RTOL = 1e-3
VALUE_RTOL = 2.0**-20
ATOL = 1e-7
MIN_MOVE_OVER_TOL = 100.0
NO_GRADIENT = 1e-6
_BATCH_KEYS = {"tokens", "images", "x"}


def optimizer() -> optax.GradientTransformation:
    """The toy suite's optimizer: SGD, Nesterov momentum MOMENTUM, learning rate LR."""
    return optax.sgd(LR, momentum=MOMENTUM, nesterov=True)


def batch_size(model: str) -> int:
    """The global batch `model` runs at: BATCH, or its entry in BATCHES."""
    return BATCHES.get(model, BATCH)


def train_step(model: str, value_and_grad: Callable | None = None) -> Callable:
    """The zoo's train step of `model` with `optimizer()` (`value_and_grad` as in
    `autopar.models.make_train_step`)."""
    return zoo.make_train_step(zoo.config(model), value_and_grad, optimizer())[0]


def initial_state(model: str) -> dict:
    """The zoo's initial state of `model` with `optimizer()`'s state."""
    state = zoo.init_state(model)
    return {**state, "opt_state": optimizer().init(state["params"])}


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
        # Every leaf split (the default leaves the toy models' small leaves whole, and
        # these rows would be data parallel).
        "zero2": (autopar.Zero2Parallel(min_split_elements=0), 1),
        "zero3": (autopar.Zero3Parallel(min_split_elements=0), 1),
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


def _copy(tree):
    return jax.tree.map(lambda x: x.copy(), tree)


def time_interleaved(programs: dict[str, Callable], states: dict[str, Any], data: Any,
                     steps: int, warmup: int = 0) -> dict[str, float]:
    """Median seconds per step of each program (label -> `step(state, data) -> (state,
    out)`), after `warmup` steps of each: their `steps` steps taken in turns (one of each
    per round), so that a slow spell of a shared machine lands on every program alike.
    `states` (label -> that program's state) is updated in place."""
    for label, run in programs.items():
        for _ in range(warmup):
            states[label], _ = run(states[label], data)
        states[label] = jax.block_until_ready(states[label])
    times: dict[str, list[float]] = {label: [] for label in programs}
    for _ in range(steps):
        for label, run in programs.items():
            start = time.perf_counter()
            states[label], out = run(states[label], data)
            jax.block_until_ready((states[label], out))
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t) for label, t in times.items()}


def leaf_name(path) -> str:
    """A key path as "a/b/c"."""
    keys = []
    for k in path:
        keys.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return "/".join(keys)


def named_leaves(tree) -> list[tuple[str, np.ndarray]]:
    """(path as "a/b/c", host array) of every leaf of `tree`."""
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    return [(leaf_name(path), np.asarray(x)) for path, x in flat]


def leaf_tolerance(init: np.ndarray, ref: np.ndarray) -> float:
    """ATOL + VALUE_RTOL * max|ref| + MOVE_RTOL * max|ref - init| (module docstring)."""
    if ref.size == 0:
        return ATOL
    ref64 = ref.astype(np.float64)
    return float(ATOL + VALUE_RTOL * np.max(np.abs(ref64))
                 + MOVE_RTOL * np.max(np.abs(ref64 - init.astype(np.float64))))


def movement(init_params, ref_params) -> dict:
    """How far the reference moves each parameter leaf, against the leaf's tolerance:
    {"min_move_over_tol", "min_move_leaf", "exempt": names of the leaves moved by at most
    NO_GRADIENT of the largest movement (not counted in the minimum), "leaves": count}."""
    moves = []
    for (name, x0), (_, x) in zip(named_leaves(init_params), named_leaves(ref_params)):
        move = float(np.max(np.abs(x.astype(np.float64) - x0))) if x.size else 0.0
        moves.append((name, move, leaf_tolerance(x0, x)))
    largest = max((m for _, m, _ in moves), default=0.0)
    exempt = [n for n, m, _ in moves if m <= NO_GRADIENT * largest]
    ratios = [(m / tol, n) for n, m, tol in moves if n not in exempt]
    low, leaf = min(ratios, default=(0.0, None))
    return {"min_move_over_tol": low, "min_move_leaf": leaf, "exempt": exempt,
            "leaves": len(moves)}


def compare(init_state, ref_state, ref_losses, state, losses) -> dict:
    """Compares a plan's final `state` and `losses` with the reference's, both run from
    `init_state` (module docstring: per-leaf tolerances, movement check).  Returns
    {"equal", "reason" (None when equal), "loss_rel_err", "state_abs_err" (largest
    difference of any state leaf), "err_over_tol" and "worst_leaf" (largest difference
    relative to its leaf's tolerance), and `movement`'s fields}."""
    out = {"loss_rel_err": max((abs(a - b) / max(abs(b), 1e-12)
                                for a, b in zip(losses, ref_losses)), default=0.0)}
    if len(losses) != len(ref_losses):
        out["loss_rel_err"] = float("inf")
    move = movement(init_state["params"], ref_state["params"])
    out.update({k: v for k, v in move.items() if k != "leaves"})
    init, ref, got = named_leaves(init_state), named_leaves(ref_state), named_leaves(state)
    reasons = []
    if [n for n, _ in got] != [n for n, _ in ref] or any(
            a.shape != b.shape for (_, a), (_, b) in zip(got, ref)):
        reasons.append("the state's leaves (names or shapes) differ from the reference's")
        out.update(state_abs_err=float("inf"), err_over_tol=float("inf"), worst_leaf=None)
    else:
        worst, worst_leaf, largest = 0.0, None, 0.0
        for (name, x0), (_, x), (_, y) in zip(init, ref, got):
            if x.size == 0:
                continue
            if not np.issubdtype(x.dtype, np.inexact):  # e.g. a step count: exactly equal
                err, tol = (0.0 if np.array_equal(x, y) else float("inf")), 0.0
            else:
                err = float(np.max(np.abs(y.astype(np.float64) - x)))
                err, tol = (err if np.isfinite(err) else float("inf")), leaf_tolerance(x0, x)
            ratio = err / tol if tol > 0 else (0.0 if err == 0 else float("inf"))
            largest = max(largest, err)
            if worst_leaf is None or ratio > worst:
                worst, worst_leaf = ratio, name
        out.update(state_abs_err=largest, err_over_tol=worst, worst_leaf=worst_leaf)
        if not worst <= 1:
            reasons.append(f"state leaf {worst_leaf} differs by {worst:.3g} x its tolerance")
    if not out["loss_rel_err"] <= LOSS_RTOL:  # NaN too
        reasons.append(f"losses differ by {out['loss_rel_err']:.2g} relative (tolerance "
                       f"{LOSS_RTOL:g})")
    if not move["min_move_over_tol"] >= MIN_MOVE_OVER_TOL:
        reasons.append(f"the reference moves parameter leaf {move['min_move_leaf']} by only "
                       f"{move['min_move_over_tol']:.3g} x its tolerance (at least "
                       f"{MIN_MOVE_OVER_TOL:g} needed: a dropped update could pass)")
    out["equal"] = not reasons
    out["reason"] = "; ".join(reasons) or None
    return out


def run_model(model: str, strategies=None, cluster: str = "cpu-local") -> list[dict]:
    """Runs every strategy on `model` (toy size) and compares with the reference."""
    state = initial_state(model)
    batches = [zoo.example_batch(model, batch_size(model), seed=s)
               for s in range(1, STEPS + 1)]
    refs = {}
    for micro in (1, MICRO):
        grad = None if micro == 1 else micro_batched_value_and_grad(micro)
        refs[micro] = run_steps(jax.jit(train_step(model, grad)), state, batches)
    step_fn = train_step(model)
    rows = []
    for name, (method, micro) in methods(state, batches[0]).items():
        if strategies and name not in strategies:
            continue
        par = autopar.parallelize(step_fn, method=method, cluster=cluster)
        t0 = time.perf_counter()
        plan = par.get_plan(state, batches[0])
        search_s = time.perf_counter() - t0
        # Steps donate their state (autopar's default): each run gets its own copy.
        new_state, losses = run_steps(par, _copy(state), batches)
        # One untimed call on a fresh copy first: a single-mesh plan compiled again when
        # called on a fresh copy after run_steps (~4 s for gpt-toy): not a step's time.
        jax.block_until_ready(par(_copy(state), batches[0]))
        again = _copy(state)
        t0 = time.perf_counter()
        jax.block_until_ready(par(again, batches[0]))
        measured = time.perf_counter() - t0
        ref_state, ref_losses = refs[micro]
        check = compare(state, ref_state, ref_losses, new_state, losses)
        rows.append({
            "model": model, "strategy": name, "batch": batch_size(model), "micro_batches": micro,
            "stages": len(plan.stages) or 1, "mesh": list(plan.stages[0].mesh_shape
                                                          if plan.stages else plan.mesh_shape),
            "losses": losses, "ref_losses": ref_losses, **check,
            "predicted_step_s": plan.predicted.step_s, "measured_step_s": measured,
            "search_s": search_s, **_audit(par, plan, state, batches[0])})
        print(f"{model:8} {name:14} loss err {check['loss_rel_err']:.1e} err/tol "
              f"{check['err_over_tol']:.2g} move/tol {check['min_move_over_tol']:.0f} "
              f"{'ok' if check['equal'] else 'MISMATCH: ' + check['reason']}",
              file=sys.stderr, flush=True)
    return rows


def _short(leaf: str | None) -> str:
    """A leaf's path without the "params/" prefix and flax's "Checkpoint_" (remat) tag."""
    return (leaf or "—").removeprefix("params/").replace("Checkpoint_", "")


def markdown(rows: list[dict], wall_s: float, meta: dict | None = None) -> str:
    equal = sum(r["equal"] for r in rows)
    lines = ["# Toy suite: plans run on 8 emulated CPU devices", ""]
    if meta is not None:
        lines += [stamp_markdown(meta), ""]
    batches = ", ".join(f"{m} {b}" for m, b in BATCHES.items())
    lines += [
        f"**{equal}/{len(rows)} equal.** {STEPS} steps of SGD (Nesterov momentum {MOMENTUM:g}, "
        f"lr {LR:g}), batch {BATCH} ({batches}), against the single-device `jax.jit` step "
        f"(micro-batched "
        f"plans: the same micro-batches averaged). Equal = losses within rtol {LOSS_RTOL:g}, "
        f"every state leaf x within tol = {ATOL:g} + {VALUE_RTOL:.3g}·max|x| + "
        f"{MOVE_RTOL:g}·max|x − x0| of the reference's (x0 its initial value; err/tol: the "
        f"largest difference over its leaf's tol), and the reference moving every parameter "
        f"leaf by at least {MIN_MOVE_OVER_TOL:g} x its tol (move/tol: the smallest ratio, so a "
        f"plan that dropped a leaf's update would differ by that many tolerances). Exempt "
        f"from the movement check: leaves the reference moves by at most {NO_GRADIENT:g} of "
        f"the largest movement (gradient 0 up to rounding), listed below. Predicted: the "
        f"plan's step on `cpu-local`; measured: one step here (shared 2-core machine, "
        f"noisy). Collective bytes and memory per device: read from the compiled HLO. "
        f"{wall_s:.0f} s in all.", "",
        "| model | strategy | stages x mesh | µb | equal | loss rel err | err/tol "
        "| state abs err | move/tol | predicted (ms) | measured (ms) | collective bytes "
        "| memory/device |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        coll = ", ".join(f"{k} {v / 1e3:.0f} kB" for k, v in sorted(r["collective_bytes"].items()))
        mem = f"{r['memory_bytes'] / 1e6:.2f} MB" if r["memory_bytes"] is not None else "—"
        lines.append(f"| {r['model']} | {r['strategy']} | {r['stages']} x {tuple(r['mesh'])} | "
                     f"{r['micro_batches']} | {'yes' if r['equal'] else '**no**'} | "
                     f"{r['loss_rel_err']:.1e} | {r['err_over_tol']:.2g} | "
                     f"{r['state_abs_err']:.1e} | {r['min_move_over_tol']:.0f} | "
                     f"{r['predicted_step_s'] * 1e3:.2f} | {r['measured_step_s'] * 1e3:.1f} | "
                     f"{coll or 'none'} | {mem} |")
    lines += ["", "Movement check per reference (the smallest move/tol of a parameter leaf, "
              "that leaf, and the exempt leaves):", "",
              "| model | µb | min move/tol | at leaf | exempt leaves |", "|---|---|---|---|---|"]
    seen = set()
    for r in rows:
        key = (r["model"], r["micro_batches"])
        if key in seen:
            continue
        seen.add(key)
        exempt = ", ".join(_short(n) for n in r["exempt"]) or "none"
        lines.append(f"| {r['model']} | {r['micro_batches']} | {r['min_move_over_tol']:.0f} | "
                     f"{_short(r['min_move_leaf'])} | {exempt} |")
    bad = [r for r in rows if not r["equal"]]
    if bad:
        lines += ["", "Differences:", ""] + [
            f"- {r['model']} / {r['strategy']}: {r['reason']}" for r in bad]
    return "\n".join(lines) + "\n"


def run(out_dir: pathlib.Path = RESULTS, models=MODELS, strategies=None) -> list[dict]:
    if len(jax.devices()) < 8:
        raise RuntimeError(f"the toy suite needs 8 devices, this process has "
                           f"{len(jax.devices())} (set XLA_FLAGS="
                           f"--xla_force_host_platform_device_count=8 before importing jax)")
    t0 = time.perf_counter()
    rows = [r for m in models for r in run_model(m, strategies)]
    wall_s = time.perf_counter() - t0
    meta = stamp()
    text = markdown(rows, wall_s, meta)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / "toy-cpu-local.json", {"meta": meta, "wall_s": wall_s,
                                                       "rows": rows})
    tmp = out_dir / "toy-cpu-local.md.tmp"
    tmp.write_text(text)
    tmp.replace(out_dir / "toy-cpu-local.md")
    print(text)
    return rows
