"""One process of a multi-process run (started by `autopar launch`): a test model's train
step under an autopar method (shard, dp, zero2, zero3; pipeshard with --micro-batches and
--stages), on devices of every process.

    python train.py CASE OUT_DIR [--methods shard[,zero3,...]] [--time-limit S]
                    [--micro-batches 4 --stages 2] [--steps 3] [--kill-rank K --kill-step I]
                    [--wrong-batch-rank K]

The state is created directly in `dist.input_shardings` (`jax.jit(init, out_shardings=...)`;
pipeline plans: replicated over all devices), each process passes its own rows of every
global batch (`autopar.distributed.global_batch`),
and `--methods` gives each rank its method (rank k takes entry k mod the list's length: a
search that differs between processes).  Rank 0 writes OUT_DIR/result.npz (losses and the
final state gathered) and every rank writes OUT_DIR/rank<k>.json (the plan it ran, its rows).
`--kill-rank K --kill-step I`: rank K kills itself (SIGKILL) while step I is in flight.
`--wrong-batch-rank K`: rank K plans with its local rows as the batch (a user's mistake).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import time

import autopar
import autopar.distributed as dist

METHODS = {"shard": autopar.ShardParallel, "dp": autopar.DataParallel,
           "zero2": autopar.Zero2Parallel, "zero3": autopar.Zero3Parallel,
           "pipeshard": autopar.PipeshardParallel}


def make_method(name: str, args):
    options = {} if args.time_limit is None else {"time_limit_s": args.time_limit}
    if name == "pipeshard":
        options.update(num_micro_batches=args.micro_batches, num_stages=args.stages)
    if name in ("zero2", "zero3"):
        options["min_split_elements"] = 0  # the test models' leaves are all small
    return METHODS[name](**options)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("case")
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--methods", default="shard")
    parser.add_argument("--time-limit", type=float, default=None)
    parser.add_argument("--micro-batches", type=lambda v: v if v == "auto" else int(v),
                        default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-step", type=int, default=1)
    parser.add_argument("--wrong-batch-rank", type=int, default=None)
    args = parser.parse_args()

    t0 = time.perf_counter()
    dist.initialize()  # every setting comes from `autopar launch`
    import jax
    import numpy as np

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/
    from models import make_case

    rank = jax.process_index()
    names = args.methods.split(",")
    method = make_method(names[rank % len(names)], args)
    case = make_case(args.case, "adamw")
    step = autopar.parallelize(case.step, method=method, batch_argnums=(1,))

    # Abstract arguments: the plan, then the state created in its shardings on every process.
    state_abs = jax.eval_shape(lambda: case.init()[0])
    first = jax.tree.map(np.asarray, case.batch_for_step(0))
    if rank == args.wrong_batch_rank:  # its local rows, as if they were the global batch
        first = jax.tree.map(lambda x: x[:len(x) // jax.process_count()], first)
    batch_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), first)
    print(f"started in {time.perf_counter() - t0:.1f} s", flush=True)
    plan = step.get_plan(state_abs, batch_abs)
    print(f"planned at {time.perf_counter() - t0:.1f} s", flush=True)
    state_sharding, batch_sharding = dist.input_shardings(step, state_abs, batch_abs)
    state = jax.jit(lambda: case.init()[0], out_shardings=state_sharding)()
    batch_size = jax.tree.leaves(first)[0].shape[0]
    jax.block_until_ready(state)
    print(f"state created at {time.perf_counter() - t0:.1f} s", flush=True)

    rows = {}
    losses = []
    for i in range(args.steps):
        full = jax.tree.map(np.asarray, case.batch_for_step(i))  # every process can build it
        local = jax.tree.map(lambda x, s: x[dist.process_rows(s, x.shape)], full, batch_sharding)
        rows = jax.tree.map(lambda x, s: list(dist.process_rows(s, x.shape).indices(len(x))[:2]),
                            full, batch_sharding)
        batch = dist.global_batch(local, batch_sharding, batch_size)
        state, metrics = step(state, batch)
        if rank == args.kill_rank and i == args.kill_step:
            print(f"rank {rank}: killing myself while step {i} is in flight", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        losses.append(float(dist.gather(metrics["loss"])))  # the last stage's, for pipelines
        print(f"step {i}: loss {losses[-1]:.6f} at {time.perf_counter() - t0:.1f} s", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"rank{rank}.json", "w") as f:
        json.dump({"fingerprint": plan.fingerprint, "plan": dist.plan_hash(plan),
                   "method": plan.method, "mesh_shape": list(plan.mesh_shape),
                   "num_micro_batches": plan.num_micro_batches,
                   "micro_batch_tries": len(plan.solver.get("micro_batch_tries", [])),
                   "losses": losses, "rows": rows,
                   "local_devices": [d.id for d in jax.local_devices()],
                   # state leaves of which this process holds only a part (kept sharded)
                   "split_state_leaves": sum(
                       bool(x.addressable_shards) and x.addressable_shards[0].data.shape
                       != x.shape for x in jax.tree.leaves(state)),
                   # state leaves that live on other processes' devices only (a stage's)
                   "remote_state_leaves": sum(not x.addressable_shards
                                              for x in jax.tree.leaves(state)),
                   "stage_processes": [sorted({d.process_index for d in jax.devices()
                                               if d.id in st.device_ids})
                                       for st in plan.stages]}, f)
    final = dist.gather(state)  # every process takes part; rank 0 writes
    if rank == 0:
        leaves = {f"leaf{k}": x for k, x in enumerate(jax.tree.leaves(final))}
        np.savez(args.out / "result.npz", losses=np.asarray(losses), **leaves)
    print(f"done at {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
