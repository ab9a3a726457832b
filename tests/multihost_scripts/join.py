"""One process of a launcher test (started by `autopar launch`).

    python join.py ok            every rank joins, checks a sum over all devices, exits 0
    python join.py absent K      rank K exits 0 without joining (it never arrives)
    python join.py wait DIR      every rank joins, writes DIR/pid<k>, then waits 10 minutes
    python join.py raise K       every rank joins and sums over all devices again and again;
                                 rank K raises an exception at the third sum
"""

from __future__ import annotations

import os
import sys
import time

import autopar.distributed as dist


def main() -> int:
    mode = sys.argv[1]
    env = dist.LaunchEnv.from_env()
    if mode == "absent" and env.process_id == int(sys.argv[2]):
        print(f"rank {env.process_id}: not joining", flush=True)
        return 0
    dist.initialize()
    if mode == "wait":
        import pathlib

        (pathlib.Path(sys.argv[2]) / f"pid{env.process_id}").write_text(str(os.getpid()))
        time.sleep(600)
        return 1
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("x",))
    n = jax.device_count()
    rows = np.arange(n, dtype=np.float32)
    local = rows[jax.process_index() * jax.local_device_count():][:jax.local_device_count()]
    x = dist.global_batch(local, NamedSharding(mesh, PartitionSpec("x")), n)
    total_of = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))
    total = float(total_of(x))
    if mode == "raise":
        for i in range(1000):
            if i == 2 and jax.process_index() == int(sys.argv[2]):
                raise RuntimeError(f"rank {jax.process_index()}: a bug in the user's script")
            total = float(total_of(x))
            time.sleep(0.2)
    print(f"rank {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} "
          f"local devices of {n}, sum {total:g}", flush=True)
    return 0 if total == n * (n - 1) / 2 else 1


if __name__ == "__main__":
    sys.exit(main())
