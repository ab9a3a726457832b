"""One process of a plan-exchange test (started by `autopar launch`): a tiny step whose plan
process 0 searches, with process 0's search slowed, wedged or failing.

    python plan_wait.py heartbeat SLOW_S
        plan 1: process 0's search sleeps SLOW_S seconds (longer than the heartbeat bound)
        while its heartbeat goes on: every process gets the plan and runs a step.
        plan 2: process 0's heartbeat stops after 2 beats and its search sleeps 300 s:
        process 1 gives up within the heartbeat bound with a PlanError naming process 0.
    python plan_wait.py search-error
        first a batch leaf on process 0's devices only, built by every process with
        `global_batch` (process 1 passes its `process_rows`, none) and gathered; then a step
        whose search fails on process 0 (memory_budget_bytes=1): every process reports
        process 0's MemoryBudgetError.
"""

from __future__ import annotations

import os
import sys
import time

os.environ["AUTOPAR_CACHE_DIR"] = ""  # no plan cache: process 0 searches

import autopar.distributed as dist


def main() -> int:
    mode = sys.argv[1]
    dist.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import autopar
    from autopar import kv_store, planner

    rank = jax.process_index()

    def step(w, batch):
        loss, g = autopar.value_and_grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w)
        return w - 0.1 * g, loss

    w = jnp.ones((8, 4), jnp.float32)
    x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 100
    mesh = Mesh(np.array(jax.devices()), ("all",))
    whole, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("all"))

    def run(method) -> float:
        par = autopar.parallelize(step, method=method)
        w0 = jax.device_put(w, whole)
        batch = dist.global_batch({"x": x[dist.process_rows(rows, x.shape)]}, rows, 16)
        _, loss = par(w0, batch)
        return float(dist.gather(loss))

    if mode == "heartbeat":
        slow_s = float(sys.argv[2])
        search = planner.search

        def slow_search(*args, **kwargs):
            if rank == 0:
                print(f"rank 0: searching slowly ({slow_s:g} s)", flush=True)
                time.sleep(slow_s)
            return search(*args, **kwargs)

        planner.search = slow_search
        t0 = time.monotonic()
        loss = run(autopar.ShardParallel(time_limit_s=1))
        print(f"rank {rank}: plan 1 after {time.monotonic() - t0:.1f} s, loss {loss:.6f}",
              flush=True)

        def wedged(self):   # two more beats, then silence (a search stuck without the GIL)
            for _ in range(2):
                if self._stop.wait(dist.PLAN_HEARTBEAT_S):
                    return
                self.beat()

        if rank == 0:
            kv_store.Heartbeat._run = wedged
        slow_s = 300.0
        t0 = time.monotonic()
        try:
            run(autopar.DataParallel(time_limit_s=1))
        finally:
            print(f"rank {rank}: plan 2 ended after {time.monotonic() - t0:.1f} s", flush=True)
        return 1   # not reached: process 1 gives up, process 0 is stopped

    if mode == "search-error":
        first = NamedSharding(Mesh(np.array(jax.local_devices(process_index=0)), ("x",)),
                              PartitionSpec("x"))
        mine = dist.process_rows(first, x.shape)
        held = dist.global_batch({"x": x[mine]}, first, 16)
        same = np.array_equal(dist.gather(held)["x"], x)
        print(f"rank {rank}: rows {mine.start}:{mine.stop} of a batch on process 0's devices, "
              f"{len(held['x'].addressable_shards)} shards here, gathered equal: {same}",
              flush=True)
        run(autopar.ShardParallel(memory_budget_bytes=1, time_limit_s=1))
        return 1   # not reached
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main())
