"""Roofline compute time of one operation on one device (DESIGN §6), with the matmul
efficiency by size of the cluster's device kind (`efficiency.py`)."""

from __future__ import annotations

from typing import Any

from . import efficiency
from .cluster import ClusterSpec, _dtype_name

KERNEL_CURVES: dict[str, tuple[str, ...]] = {
    "matmul": ("matmul_efficiency",),
    "conv": ("conv_efficiency", "matmul_efficiency"),
}
"""Kind of call -> the ClusterSpec curve fields it is priced on, first found for the dtype."""

PRIMITIVE_KERNELS: dict[str, str] = {"conv_general_dilated": "conv"}
"""Primitive name -> kind of call; every other primitive is priced as ``"matmul"``."""


def kernel_of(primitive: str) -> str:
    """The kind of call (a `KERNEL_CURVES` key) of a jaxpr primitive."""
    return PRIMITIVE_KERNELS.get(primitive, "matmul")


def flop_fraction(flops: float, dtype: Any, cluster: ClusterSpec,
                  kernel: str = "matmul") -> float:
    """The fraction of ``cluster.peak_flops_per_s(dtype)`` an operation of `flops` FLOPs on
    one device sustains: the cluster's curve for the dtype and the kind of call (`kernel`,
    `KERNEL_CURVES`) at `flops` (interpolated in log FLOPs, clamped at its ends), or 1
    where the cluster has no curve for it (profiled clusters without a sweep, CPU, kinds
    without a table row: their ``peak_flops`` is what a call sustains).

    The one place the time model reads kernel efficiency; memory traffic is priced at
    ``memory_bandwidth_bytes_per_s``, already the bandwidth a streaming kernel sustains.
    """
    name = _dtype_name(dtype)
    for field in KERNEL_CURVES[kernel]:
        curve = getattr(cluster, field).get(name)
        if curve is not None:
            return efficiency.fraction_at(curve, flops)
    return 1.0


def compute_time_s(flops: float, bytes_accessed: float, dtype: Any, cluster: ClusterSpec,
                   kernel: str = "matmul") -> float:
    """Roofline time on one device: max(flops / (peak(dtype) x `flop_fraction`),
    bytes_accessed / memory bandwidth).

    Args:
      flops: floating-point operations executed on the device (a multiply-add counts 2).
      bytes_accessed: bytes read from and written to device memory.
      dtype: dtype that sets the peak (numpy/jax dtype or name); unknown dtypes use the
        float32 peak.
      cluster: supplies ``peak_flops_per_s(dtype)`` (FLOP/s), the efficiency curves and
        ``memory_bandwidth_bytes_per_s`` (bytes/s).
      kernel: the kind of call (`KERNEL_CURVES`: ``"matmul"`` or ``"conv"``).

    Returns:
      Seconds.
    """
    if flops < 0 or bytes_accessed < 0:
        raise ValueError(
            f"compute_time_s requires flops >= 0 and bytes_accessed >= 0, "
            f"got {flops=}, {bytes_accessed=}"
        )
    rate = cluster.peak_flops_per_s(dtype) * flop_fraction(flops, dtype, cluster, kernel)
    return max(flops / rate, bytes_accessed / cluster.memory_bandwidth_bytes_per_s)
