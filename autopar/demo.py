"""`autopar demo`: the whole path on 8 emulated CPU devices, checked against one device.

A tiny GPT (the zoo's `autopar.models.GPT_TINY`: vocab 64, sequence 16, hidden 32, 2 layers,
4 heads; batch 16) with a plain SGD train step that computes its gradients with
`autopar.value_and_grad`.  The demo searches an automatic plan (ShardParallel over the 8
devices), prints it, trains N steps under the plan, trains the same N steps with the
single-device `jax.jit` step, and compares the losses (rtol 1e-4; SGD keeps the
reduction-order noise ~1e-7).

`autopar demo --processes N` runs the same across N local processes of 8/N devices each
(`autopar launch`): process 0 searches the plan and every process runs it; the state is
created in the plan's shardings, each process passes its rows of every batch; process 0
trains the single-device reference and compares.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

NUM_DEVICES = 8
BATCH = 16
LEARNING_RATE = 0.1
RTOL = 1e-4
# A 10 s limit per mesh shape keeps the demo quick; the solver returns its best plan.
TIME_LIMIT_S = 10.0


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
    """(model, train_step, init, batches): the demo's tiny GPT, its SGD step, a function
    returning the initial state and one returning the first N batches."""
    import jax
    import jax.numpy as jnp
    import optax

    from autopar.models import GPT_TINY, gpt_train_step

    cfg = GPT_TINY
    train_step, model, tx = gpt_train_step(cfg, tx=optax.sgd(LEARNING_RATE))

    def init() -> dict:
        params = model.init(jax.random.key(0), jnp.zeros((1, cfg.seq), jnp.int32))["params"]
        return {"params": params, "opt_state": tx.init(params)}

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

    return model, train_step, init, batches


def _train(step: Callable, state, batches: list, progress=None, label: str = "") -> list[float]:
    losses = []
    for k, batch in enumerate(batches):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if progress is not None:
            progress.update(k + 1, len(batches), f"{label} step {k + 1}/{len(batches)} "
                                                 f"loss {losses[-1]:.4f}")
    return losses


def run(steps: int = 20, *, quiet: bool = False, out=None,
        time_limit_s: float = TIME_LIMIT_S) -> int:
    """Runs the demo; returns the exit code (0 when the losses match).

    Args:
      steps: training steps of each run.
      quiet: no progress bar.
      out: text stream for the report (default stdout).
      time_limit_s: the solver's limit per logical mesh, seconds.
    """
    out = out if out is not None else sys.stdout
    if steps < 1:
        raise ValueError(f"autopar demo --steps must be a positive int, got {steps}")
    use_cpu_devices()
    import jax

    from autopar.progress import Progress

    t0 = time.perf_counter()
    _, train_step, init, make_batches = make_model_and_step()
    state = init()
    batches = make_batches(steps)
    _headline(steps, f"{NUM_DEVICES} emulated CPU devices", out)
    parallel = _parallel(train_step, time_limit_s)
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

    return _compare(par_losses, ref_losses, t0, out)


def _headline(steps: int, where: str, out) -> None:
    from autopar.models import GPT_TINY as cfg

    print(f"autopar demo: tiny GPT (vocab {cfg.vocab}, seq {cfg.seq}, hidden {cfg.hidden}, "
          f"{cfg.layers} layers, batch {BATCH}), SGD lr {LEARNING_RATE}, {steps} steps on "
          f"{where}", file=out, flush=True)


def _parallel(train_step, time_limit_s: float):
    import autopar

    return autopar.parallelize(train_step, batch_argnums=(1,),
                               method=autopar.ShardParallel(time_limit_s=time_limit_s))


def _compare(par_losses: list[float], ref_losses: list[float], t0: float, out) -> int:
    """Prints the losses side by side; 0 when they match (rtol RTOL), else 1."""
    import numpy as np

    steps = len(ref_losses)
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


def run_processes(steps: int, processes: int, *, quiet: bool = False,
                  timeout_s: float | None = 3600.0, time_limit_s: float = TIME_LIMIT_S) -> int:
    """Runs the demo on `processes` local processes (`autopar launch`) of
    8 / `processes` emulated CPU devices each, within `timeout_s` seconds; returns the
    launch's exit status."""
    from autopar import launch

    if NUM_DEVICES % processes:
        raise ValueError(f"autopar demo --processes must divide {NUM_DEVICES} devices, got "
                         f"{processes}")
    args = ["demo", "--steps", str(steps), "--time-limit", str(time_limit_s)]
    args += ["--quiet"] if quiet else []
    result = launch.launch(launch.python_command(None, args, module="autopar"), processes,
                           devices_per_process=NUM_DEVICES // processes, timeout_s=timeout_s,
                           echo=sys.stdout)
    if result.returncode != 0:
        print(result.summary(), file=sys.stderr)
    return result.returncode


def run_process(steps: int, *, out=None, time_limit_s: float = TIME_LIMIT_S) -> int:
    """One process of `run_processes` (started by `autopar launch`): joins the job, runs
    process 0's plan over every process's devices; process 0 also trains the single-device
    reference and returns 1 when the losses differ."""
    from autopar import distributed

    distributed.initialize()
    import jax
    import numpy as np

    out = out if out is not None else sys.stdout
    t0 = time.perf_counter()
    rank = jax.process_index()
    _, train_step, init, make_batches = make_model_and_step()
    batches = [jax.tree.map(np.asarray, b) for b in make_batches(steps)]
    if rank == 0:
        _headline(steps, f"{jax.process_count()} processes x {jax.local_device_count()} "
                         f"emulated CPU devices", out)
    parallel = _parallel(train_step, time_limit_s)
    abstract = (jax.eval_shape(init),
                jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches[0]))
    plan = parallel.get_plan(*abstract)  # process 0 searches, the others receive its plan
    if rank == 0:
        print(plan.summary(), file=out, flush=True)
    state_sharding, batch_sharding = distributed.input_shardings(parallel, *abstract)
    state = jax.jit(init, out_shardings=state_sharding)()  # created in place, never gathered
    par_losses = []
    for batch in batches:
        rows = jax.tree.map(lambda x, s: x[distributed.process_rows(s, x.shape)], batch,
                            batch_sharding)
        state, metrics = parallel(state, distributed.global_batch(rows, batch_sharding, BATCH))
        par_losses.append(float(metrics["loss"]))
    if rank != 0:
        return 0
    with jax.default_device(jax.local_devices()[0]):
        ref_losses = _train(jax.jit(train_step), init(), batches)
    return _compare(par_losses, ref_losses, t0, out)
