"""`autopar demo`: the whole path on 8 emulated CPU devices, checked against one device.

A tiny GPT (the zoo's `autopar.models.GPT_TINY`: vocab 64, sequence 16, hidden 32, 2 layers,
4 heads; batch 16) with a plain SGD train step that computes its gradients with
`autopar.value_and_grad`.  The demo searches an automatic plan (ShardParallel over the 8
devices), prints it, trains N steps under the plan, trains the same N steps with the
single-device `jax.jit` step, and compares the losses (rtol 1e-4; SGD keeps the
reduction-order noise ~1e-7).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

NUM_DEVICES = 8
BATCH = 16
LEARNING_RATE = 0.1
RTOL = 1e-4


def use_cpu_devices(n: int = NUM_DEVICES) -> None:
    """Asks JAX for `n` emulated CPU devices; must run before any JAX backend use."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # the backend already runs (e.g. demo called from Python): check below
    if len(jax.devices()) < n:
        raise RuntimeError(f"the demo needs {n} devices, JAX has {len(jax.devices())}: run "
                           f"`autopar demo` in a fresh process")


def make_model_and_step():
    """(model, train_step, init_state, batches): the demo's tiny GPT and its SGD step."""
    import jax
    import jax.numpy as jnp
    import optax

    from autopar.models import GPT_TINY, gpt_train_step

    cfg = GPT_TINY
    train_step, model, tx = gpt_train_step(cfg, tx=optax.sgd(LEARNING_RATE))
    params = model.init(jax.random.key(0), jnp.zeros((1, cfg.seq), jnp.int32))["params"]
    state = {"params": params, "opt_state": tx.init(params)}

    def batches(steps: int) -> list[dict]:
        # Learnable sequences: token t+1 = token t + stride (mod vocab), per-row stride.
        out = []
        for k in range(steps):
            key = jax.random.fold_in(jax.random.key(1), k)
            start = jax.random.randint(key, (BATCH, 1), 0, cfg.vocab)
            stride = 1 + jnp.arange(BATCH)[:, None] % 3
            seq = (start + stride * jnp.arange(cfg.seq + 1)[None, :]) % cfg.vocab
            out.append({"tokens": seq[:, :-1].astype(jnp.int32),
                        "labels": seq[:, 1:].astype(jnp.int32)})
        return out

    return model, train_step, state, batches


def _train(step: Callable, state, batches: list, progress=None, label: str = "") -> list[float]:
    losses = []
    for k, batch in enumerate(batches):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if progress is not None:
            progress.update(k + 1, len(batches), f"{label} step {k + 1}/{len(batches)} "
                                                 f"loss {losses[-1]:.4f}")
    return losses


def run(steps: int = 20, *, quiet: bool = False, out=None) -> int:
    """Runs the demo; returns the exit code (0 when the losses match).

    Args:
      steps: training steps of each run.
      quiet: no progress bar.
      out: text stream for the report (default stdout).
    """
    out = out if out is not None else sys.stdout
    if steps < 1:
        raise ValueError(f"autopar demo --steps must be a positive int, got {steps}")
    use_cpu_devices()
    import jax
    import numpy as np

    import autopar
    from autopar.models import GPT_TINY
    from autopar.progress import Progress

    t0 = time.perf_counter()
    _, train_step, state, make_batches = make_model_and_step()
    batches = make_batches(steps)
    cfg = GPT_TINY
    print(f"autopar demo: tiny GPT (vocab {cfg.vocab}, seq {cfg.seq}, hidden {cfg.hidden}, "
          f"{cfg.layers} layers, batch {BATCH}), SGD lr {LEARNING_RATE}, {steps} steps on "
          f"{NUM_DEVICES} emulated CPU devices", file=out, flush=True)

    # A 10 s limit per mesh shape keeps the demo quick; the solver returns its best plan.
    parallel = autopar.parallelize(train_step, batch_argnums=(1,),
                                   method=autopar.ShardParallel(time_limit_s=10.0))
    with Progress(enabled=not quiet) as bar:
        bar.update(None, None, "searching the plan (intra-op ILP per logical mesh)")
        plan = parallel.get_plan(state, batches[0])
    print(plan.summary(), file=out, flush=True)

    with Progress(enabled=not quiet) as bar:
        bar.update(0, steps, "compiling the parallel step")
        par_losses = _train(parallel, state, batches, bar, "parallel")
    with Progress(enabled=not quiet) as bar:
        bar.update(0, steps, "compiling the single-device step")
        with jax.default_device(jax.devices()[0]):
            ref_losses = _train(jax.jit(train_step), state, batches, bar, "single-device")

    par, ref = np.asarray(par_losses), np.asarray(ref_losses)
    ok = bool(np.allclose(par, ref, rtol=RTOL, atol=0.0))
    width = len(str(steps))
    print("step  " + " " * max(0, width - 4) + "parallel loss   single-device loss", file=out)
    for k in sorted({0, steps // 2, steps - 1}):
        print(f"{k + 1:>{max(4, width)}}  {par[k]:>13.6f}   {ref[k]:>18.6f}", file=out)
    worst = float(np.max(np.abs(par - ref) / np.maximum(np.abs(ref), 1e-30)))
    verdict = "match" if ok else "DO NOT match"
    print(f"losses {verdict} (max relative difference {worst:.2e}, rtol {RTOL:g}); "
          f"loss {ref[0]:.4f} -> {ref[-1]:.4f}; {time.perf_counter() - t0:.1f} s", file=out)
    if not ok:
        print(f"parallel:      {par.tolist()}\nsingle-device: {ref.tolist()}", file=out)
    return 0 if ok else 1
