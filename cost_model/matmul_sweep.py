"""Matmul throughput by call size, measured without the per-call dispatch: the points of a
kernel efficiency curve (`efficiency.py`) for one device kind.

A jitted call of one matmul pays a dispatch and a host synchronization (0.1-0.2 ms on the
lent GPUs, benchmarks/results/gpu-*.json), the length of a whole 4096^3 bf16 matmul there,
while the matmuls of a training step run back to back inside one program.  So each shape
is timed as a chain inside one program: ``lax.fori_loop`` of ``trips`` iterations, each
two dependent matmuls ``(m, k) @ (k, n)`` then ``(m, n) @ (n, k)`` (the shapes of a
transformer MLP: ``m`` tokens, ``k`` hidden, ``n`` = 4 x hidden), at two trip counts; the
time of one matmul is the difference of the two medians over the difference of matmul
counts, which the fixed dispatch and loop set-up cancel out of.

Every device of the mesh runs its own chain at once (``shard_map``), as every device of a
stage runs its share of a step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Shape = tuple[int, int, int]
"""``(m, k, n)``: tokens, hidden, 4 x hidden of the chain's two matmuls."""

GPU_SHAPES: tuple[Shape, ...] = tuple(
    (m, h, 4 * h) for h in (1024, 2048, 4096) for m in (512, 2048, 8192, 32768))
"""The sweep `profile` runs on a GPU: hidden 1K-4K, 512-32K tokens per call (8.6 GFLOP to
4.4 TFLOP per matmul): the calls of GPT-125M to GPT-6.7B layers from one sequence of 512
tokens to a 32-sequence micro-batch of 1024."""
QUICK_SHAPES: tuple[Shape, ...] = ((64, 64, 128), (256, 128, 256))
"""Small shapes for CPU profiles and tests."""
TRIPS = (2, 6)
"""The two loop trip counts (each trip: 2 matmuls)."""


def _chain(mesh: Mesh, dtype: str, trips: int):
    spec = P(mesh.axis_names[0])

    def local(operands):
        x, w1, w2 = operands

        def body(_, y):
            h = jnp.dot(y, w1, preferred_element_type=dtype)
            return jnp.dot(h, w2, preferred_element_type=dtype)
        return jax.lax.fori_loop(0, trips, body, x)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=((spec, spec, spec),),
                                 out_specs=spec, check_vma=False))


def stacked_uniform(mesh: Mesh, key: int, dims: tuple[int, ...], dtype: str,
                    scale: float) -> jax.Array:
    """Uniform values in [-scale, scale) of shape ``(d * dims[0],) + dims[1:]``, one block
    of ``dims`` per device of the 1-D ``mesh`` (split along the first axis), made on the
    devices themselves."""
    full = (mesh.devices.size * dims[0],) + tuple(dims[1:])
    return jax.jit(lambda: jax.random.uniform(jax.random.key(key), full, dtype, -scale, scale),
                   out_shardings=NamedSharding(mesh, P(mesh.axis_names[0])))()


def _operands(mesh: Mesh, dtype: str, shape: Shape):
    """Random operands (GPUs multiply constant data faster), weights scaled by 1/sqrt(fan-in)
    so the chain's values stay of order one in half precision."""
    m, k, n = shape
    return (stacked_uniform(mesh, 0, (m, k), dtype, 1.0),
            stacked_uniform(mesh, 1, (k, n), dtype, 3.0**0.5 / k**0.5),
            stacked_uniform(mesh, 2, (n, k), dtype, 3.0**0.5 / n**0.5))


def time_shape(mesh: Mesh, dtype: str, shape: Shape, repeats: int,
               medians) -> dict[str, Any]:
    """One sample: seconds and FLOP/s of one ``(m, k, n)`` matmul on each device.

    Args:
      mesh: a 1-D mesh over the devices measured.
      dtype: operand and result dtype name.
      shape: ``(m, k, n)``.
      repeats: timed calls per trip count.
      medians: ``medians([(fn, arg), ...], repeats) -> [seconds, ...]`` (the profiler's
        interleaved timer), called with ``fn`` taking the tuple of operands.
    """
    m, k, n = shape
    args = _operands(mesh, dtype, shape)
    calls = [(_chain(mesh, dtype, t), args) for t in TRIPS]
    short, long = medians(calls, repeats)
    matmuls = 2 * (TRIPS[1] - TRIPS[0])
    # A difference under the timer's resolution (a shape far too small for the device)
    # is floored at 1 ns per matmul rather than read as an infinite rate.
    seconds = max((long - short) / matmuls, 1e-9)
    flops = 2.0 * m * k * n
    return {"op": "matmul-chain", "dtype": dtype, "shape": [m, k, n], "flops": flops,
            "nbytes": (m * k + k * n + m * n) * jnp.dtype(dtype).itemsize,
            "seconds": seconds, "flops_per_s": flops / seconds,
            "bytes_per_s": (m * k + k * n + m * n) * jnp.dtype(dtype).itemsize / seconds,
            "call_seconds": [short, long], "trips": list(TRIPS)}


def curves(samples: Sequence[Mapping[str, Any]],
           peaks: Mapping[str, float]) -> dict[str, tuple[tuple[float, float], ...]]:
    """Per dtype, the efficiency curve of the ``matmul-chain`` samples: points ``(FLOPs per
    call, FLOP/s / peaks[dtype])``, shapes of equal FLOPs averaged, fractions capped at 1.

    Dtypes without a peak in `peaks` are skipped.
    """
    return op_curves(samples, peaks, "matmul-chain")


def op_curves(samples: Sequence[Mapping[str, Any]], peaks: Mapping[str, float],
              op: str) -> dict[str, tuple[tuple[float, float], ...]]:
    """`curves` of the samples whose ``op`` is `op` (``matmul-chain``, ``conv-chain``)."""
    by_dtype: dict[str, dict[float, list[float]]] = {}
    for s in samples:
        if s["op"] == op and s["dtype"] in peaks:
            by_dtype.setdefault(s["dtype"], {}).setdefault(float(s["flops"]), []).append(
                s["flops_per_s"] / peaks[s["dtype"]])
    return {d: tuple(sorted((f, min(1.0, sum(v) / len(v))) for f, v in pts.items()))
            for d, pts in by_dtype.items()}
