"""One process of a multi-process pipeline run written the way a user writes it (started by
`autopar launch`): a 4-layer MLP under PipeshardParallel, the state from `autopar.place`
on `init_state()`'s ordinary arrays (or from `Checkpoints.restore_into`), the batch built
with `jax.make_array_from_process_local_data` in one of three shardings, the loss read
only after the last step.

    python user_pipeline.py OUT_DIR [--init autopar|jax] [--stages 2] [--steps 3]
                            [--batch split|replicated|rows] [--state place|restore]
                            [--stop-rank K --stop-step I] [--misorder-rank K]

--batch: split = rows over every device of every process; replicated = the whole batch
on every device; rows = one row block per process (replicated over its devices).
--init jax: `jax.distributed.initialize` called directly (the settings `autopar launch`
passes read from its environment variables, as a user's own launcher would give them), with
JAX's defaults otherwise (asynchronous dispatch, no cross-host transfer socket).
--stop-rank K --stop-step I: rank K stops (SIGKILL) in the middle of step I.
--misorder-rank K: before the steps, two arrays move from process 0's devices to process
1's; rank K issues the two copies in the other order (a mis-ordered transfer).
Rank 0 writes OUT_DIR/result.npz (losses and the final parameters); every rank writes
OUT_DIR/rank<k>.json (seconds per phase).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import threading
import time

B, D, H, OUT = 32, 16, 32, 8   # global batch, input, hidden, output widths


def init_state(opt):
    import jax

    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(D, H), (H, H), (H, H), (H, OUT)]
    params = {f"w{i}": 0.3 * jax.random.normal(k, s) for i, (k, s) in enumerate(zip(keys, shapes))}
    return params, opt.init(params)


def make_train_step(opt):
    import jax.numpy as jnp
    import optax

    import autopar

    def train_step(state, batch):
        params, opt_state = state

        def loss_fn(p):
            h = batch["x"]
            for i in range(3):
                h = jnp.tanh(h @ p[f"w{i}"])
            return jnp.mean((h @ p["w3"] - batch["y"]) ** 2)

        loss, grads = autopar.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return train_step


def batch_for_step(i: int):
    import numpy as np

    rng = np.random.default_rng(100 + i)
    return {"x": rng.standard_normal((B, D), np.float32),
            "y": rng.standard_normal((B, OUT), np.float32)}


def reference(steps: int) -> tuple[list[float], dict]:
    """Losses and final parameters (numpy) of the single-device jax.jit step on the same
    model and batches (the loss is a mean over rows: the micro-batch average is the
    full-batch step)."""
    import jax
    import numpy as np
    import optax

    opt = optax.adam(1e-2)
    state = jax.device_put(init_state(opt), jax.devices()[0])
    step = jax.jit(make_train_step(opt))
    losses = []
    for i in range(steps):
        state, loss = step(state, batch_for_step(i))
        losses.append(float(loss))
    return losses, {k: np.asarray(v) for k, v in state[0].items()}


def misordered_copies(devices, reverse: bool) -> None:
    """Two arrays copied from 2 devices of process 0 to 2 of process 1, in the other order
    on the process with `reverse`."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from autopar import transfer

    src, dst = (NamedSharding(Mesh(devices[p][:2], ("c",)), PartitionSpec()) for p in (0, 1))
    values = [np.arange(64, dtype=np.float32), np.full((8, 8, 8), 2.0, np.float32)]
    arrays = [jax.make_array_from_callback(v.shape, src, lambda idx, v=v: v[idx],
                                           dtype=v.dtype) for v in values]
    order = [1, 0] if reverse else [0, 1]
    for k in order:
        y = transfer.arrived(transfer.move(arrays[k], dst), src,
                             "a test array")
        if y.addressable_shards:
            np.testing.assert_array_equal(np.asarray(y.addressable_data(0)), values[k])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--init", choices=("autopar", "jax"), default="autopar")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", choices=("split", "replicated", "rows"), default="split")
    parser.add_argument("--state", choices=("place", "restore"), default="place")
    parser.add_argument("--stop-rank", type=int, default=None)
    parser.add_argument("--stop-step", type=int, default=1)
    parser.add_argument("--misorder-rank", type=int, default=None)
    args = parser.parse_args()
    times: dict[str, float] = {}
    t0 = time.perf_counter()

    import jax

    if args.init == "autopar":
        import autopar.distributed as dist
        dist.initialize()
    else:   # what a user's own launcher does
        env = os.environ
        jax.config.update("jax_num_cpu_devices", int(env["AUTOPAR_DEVICES_PER_PROCESS"]))
        jax.distributed.initialize(env["AUTOPAR_COORDINATOR_ADDRESS"],
                                   int(env["AUTOPAR_NUM_PROCESSES"]),
                                   int(env["AUTOPAR_PROCESS_ID"]),
                                   initialization_timeout=60, heartbeat_timeout_seconds=10)
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import autopar
    import autopar.distributed as dist

    rank, nproc = jax.process_index(), jax.process_count()
    times["initialize_s"] = time.perf_counter() - t0
    opt = optax.adam(1e-2)
    step = autopar.parallelize(make_train_step(opt), method=autopar.PipeshardParallel(
        num_stages=args.stages, num_micro_batches=4))

    devices = np.array(jax.devices()).reshape(nproc, -1)   # process-major
    if args.batch == "split":
        sharding = NamedSharding(Mesh(devices.reshape(-1), ("d",)), PartitionSpec("d"))
    elif args.batch == "replicated":
        sharding = NamedSharding(Mesh(devices.reshape(-1), ("d",)), PartitionSpec())
    else:
        sharding = NamedSharding(Mesh(devices, ("proc", "local")), PartitionSpec("proc"))

    def global_batch(i: int):
        full = batch_for_step(i)
        rows = {k: v[dist.process_rows(sharding, v.shape)] for k, v in full.items()}
        return {k: jax.make_array_from_process_local_data(sharding, v, full[k].shape)
                for k, v in rows.items()}

    batch = global_batch(0)
    if args.misorder_rank is not None:
        misordered_copies(devices, reverse=args.misorder_rank == rank)
    t = time.perf_counter()
    state = autopar.place(step, init_state(opt), batch)[0]
    times["place_s"] = time.perf_counter() - t
    if args.state == "restore":
        with autopar.Checkpoints(args.out / "ckpt") as ckpt:
            ckpt.save(0, state, force=True)
            ckpt.wait_until_finished()
            state = ckpt.restore_into(step, init_state(opt), batch)

    losses = []
    t = time.perf_counter()
    for i in range(args.steps):
        if i == args.stop_step and rank == args.stop_rank:
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
        state, loss = step(state, batch if i == 0 else global_batch(i))
        losses.append(loss)
    values = [float(x) for x in losses]   # readable on every process
    plan = step.get_plan(state, batch)
    times["steps_s"] = time.perf_counter() - t
    params = dist.gather(state[0])
    if rank == 0:
        np.savez(args.out / "result.npz", losses=np.array(values),
                 **{k: np.asarray(v) for k, v in params.items()})
    record = {"losses": values, "stages": len(plan.stages), **times}
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    print(f"rank {rank} losses {values}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
