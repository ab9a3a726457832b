"""Convolution throughput by call size, measured without the per-call dispatch: the points of
a convolution efficiency curve (`efficiency.py`) for one device kind.

A training step's convolutions are of three kinds of one size each: the forward
convolution, the input gradient and the kernel gradient (each ``2 x N x H x W x kh x kw x
Cin x Cout`` FLOPs), and the time model prices each as one call of those FLOPs.  So one trip
of the timed chain is a training pass through two 3x3 "SAME" convolutions ``C -> w·C -> C``
(the Wide-ResNet bottleneck's widened convolution and its way back, NHWC): both forward
convolutions, then the vector-Jacobian product with the output as cotangent (two input
gradients, two kernel gradients), six calls of equal FLOPs; the carry is the output plus a
small multiple of the input gradient and the kernels minus a small multiple of their
gradients, so no call is loop-invariant.  As in `matmul_sweep`, each shape is timed at two
trip counts inside one program (``lax.fori_loop`` under ``shard_map``, every device at
once), and the time of one call is the difference of the medians over the difference of
call counts, which the dispatch and the loop set-up cancel out of.  The carry update's
elementwise passes (three over the images, 12 bytes per float32 element against the six
calls' 216·C FLOPs per element) are counted in the convolutions' time: about 5.7·f / C of
it at a fraction f of the peak on a GPU with the H200's FLOP-to-byte ratio (1% at 160
channels and f = 0.3, less at more channels).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .matmul_sweep import op_curves, stacked_uniform

Shape = tuple[int, int, int, int]
"""``(n, side, c, w)``: images per device, square spatial side, channels, width factor of
the chain's two 3x3 convolutions ``c -> w·c -> c``."""

GPU_SHAPES: tuple[Shape, ...] = (
    (2, 56, 160, 2), (8, 56, 160, 2), (32, 56, 160, 2),
    (8, 28, 640, 2), (32, 28, 640, 2), (32, 14, 640, 2))
"""The sweep `profile` runs on a GPU: the widened 3x3 convolutions of WRN-250M's first stage
(56x56, 160 channels) and of wider/deeper stages (28x28 and 14x14 at 640), 2-32 images per
device: 5.8 to 370 GFLOP per call."""
QUICK_SHAPES: tuple[Shape, ...] = ((1, 8, 8, 2), (2, 8, 16, 2))
"""Small shapes for CPU profiles and tests."""
TRIPS = (1, 3)
"""The two loop trip counts (each trip: 6 convolution calls)."""
CALLS_PER_TRIP = 6
STEP = 1e-3
"""Carry update's multiple of the gradients (keeps the values of order one)."""

_DIMS = ("NHWC", "HWIO", "NHWC")


def _conv(x, k):
    return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=_DIMS)


def _chain(mesh: Mesh, trips: int):
    spec = P(mesh.axis_names[0])

    def local(operands):
        def body(_, carry):
            x, k1, k2 = carry
            y, vjp = jax.vjp(lambda a, b, c: _conv(_conv(a, b), c), x, k1, k2)
            dx, dk1, dk2 = vjp(y)
            step = jnp.asarray(STEP, x.dtype)
            return y + step * dx, k1 - step * dk1, k2 - step * dk2
        return jax.lax.fori_loop(0, trips, body, operands)[0]

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=((spec, spec, spec),),
                                 out_specs=spec, check_vma=False))


def _operands(mesh: Mesh, dtype: str, shape: Shape):
    """Random images and kernels (GPUs multiply constant data faster), kernels scaled by
    1/sqrt(fan-in) so the chain's values stay of order one in half precision.  The kernels
    are stacked along their first axis, one pair per device."""
    n, side, c, w = shape
    return (stacked_uniform(mesh, 0, (n, side, side, c), dtype, 1.0),
            stacked_uniform(mesh, 1, (3, 3, c, w * c), dtype, 3.0**0.5 / (9 * c)**0.5),
            stacked_uniform(mesh, 2, (3, 3, w * c, c), dtype, 3.0**0.5 / (9 * w * c)**0.5))


def flops(shape: Shape) -> float:
    """FLOPs of one convolution call of the chain (a multiply-add counts 2)."""
    n, side, c, w = shape
    return 2.0 * n * side * side * 9 * c * (w * c)


def time_shape(mesh: Mesh, dtype: str, shape: Shape, repeats: int,
               medians) -> dict[str, Any]:
    """One sample: seconds and FLOP/s of one convolution call of `shape` on each device.

    Args:
      mesh: a 1-D mesh over the devices measured (each runs its own chain).
      dtype: operand and result dtype name.
      shape: ``(n, side, c, w)``.
      repeats: timed calls per trip count.
      medians: ``medians([(fn, arg), ...], repeats) -> [seconds, ...]`` (the profiler's
        interleaved timer), called with ``fn`` taking the tuple of operands.
    """
    args = _operands(mesh, dtype, shape)
    calls = [(_chain(mesh, t), args) for t in TRIPS]
    short, long = medians(calls, repeats)
    # A difference under the timer's resolution is floored at 1 ns per call.
    seconds = max((long - short) / (CALLS_PER_TRIP * (TRIPS[1] - TRIPS[0])), 1e-9)
    n, side, c, w = shape
    nbytes = (n * side * side * (c + w * c) + 9 * c * w * c) * jnp.dtype(dtype).itemsize
    return {"op": "conv-chain", "dtype": dtype, "shape": list(shape), "flops": flops(shape),
            "nbytes": nbytes, "seconds": seconds, "flops_per_s": flops(shape) / seconds,
            "bytes_per_s": nbytes / seconds, "call_seconds": [short, long],
            "trips": list(TRIPS)}


def curves(samples: Sequence[Mapping[str, Any]],
           peaks: Mapping[str, float]) -> dict[str, tuple[tuple[float, float], ...]]:
    """Per dtype, the efficiency curve of the ``conv-chain`` samples (as
    `matmul_sweep.curves` for matmul chains)."""
    return op_curves(samples, peaks, "conv-chain")
