"""Roofline compute time of one operation on one device (DESIGN §6), with the matmul
efficiency by size of the cluster's device kind (`efficiency.py`)."""

from __future__ import annotations

from typing import Any

from . import efficiency
from .cluster import ClusterSpec, _dtype_name


def flop_fraction(flops: float, dtype: Any, cluster: ClusterSpec) -> float:
    """The fraction of ``cluster.peak_flops_per_s(dtype)`` an operation of `flops` FLOPs on
    one device sustains: the cluster's curve for the dtype at `flops` (interpolated in
    log FLOPs, clamped at its ends), or 1 where the cluster has no curve for it (profiled
    clusters, CPU, kinds without a table row: their ``peak_flops`` is what a call sustains).

    The one place the time model reads kernel efficiency; memory traffic is priced at
    ``memory_bandwidth_bytes_per_s``, already the bandwidth a streaming kernel sustains.
    """
    curve = cluster.matmul_efficiency.get(_dtype_name(dtype))
    return 1.0 if curve is None else efficiency.fraction_at(curve, flops)


def compute_time_s(flops: float, bytes_accessed: float, dtype: Any, cluster: ClusterSpec) -> float:
    """Roofline time on one device: max(flops / (peak(dtype) x `flop_fraction`),
    bytes_accessed / memory bandwidth).

    Args:
      flops: floating-point operations executed on the device (a multiply-add counts 2).
      bytes_accessed: bytes read from and written to device memory.
      dtype: dtype that sets the peak (numpy/jax dtype or name); unknown dtypes use the
        float32 peak.
      cluster: supplies ``peak_flops_per_s(dtype)`` (FLOP/s), ``matmul_efficiency`` and
        ``memory_bandwidth_bytes_per_s`` (bytes/s).

    Returns:
      Seconds.
    """
    if flops < 0 or bytes_accessed < 0:
        raise ValueError(
            f"compute_time_s requires flops >= 0 and bytes_accessed >= 0, "
            f"got {flops=}, {bytes_accessed=}"
        )
    rate = cluster.peak_flops_per_s(dtype) * flop_fraction(flops, dtype, cluster)
    return max(flops / rate, bytes_accessed / cluster.memory_bandwidth_bytes_per_s)
