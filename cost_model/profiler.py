"""Measures collectives and compute throughput on live devices and fits a ClusterSpec (DESIGN §6).

What is measured (every timing: one warm-up call, then the median of ``repeats`` calls, each
ended by ``block_until_ready``; dispatch overhead is part of the figure and ends up in α):

* Collectives — ``all-reduce`` (``psum``), ``all-gather``, ``reduce-scatter``
  (``psum_scatter``), ``all-to-all`` and ``collective-permute`` (``ppermute``, a ring shift by
  one) — under ``jax.shard_map`` over each axis of each profiled mesh (default ``(N,)`` and
  ``(2, N/2)``), for each size. A sample's ``nbytes`` is S exactly as
  :mod:`autopar.cost_model.collectives` defines it, so the fit and the pricing agree: the
  per-device buffer is S for all-reduce / reduce-scatter / permute and S/n for all-gather /
  all-to-all (n devices per group). Buffers are float32.
* Compute — per dtype (float32, bfloat16): an (m, m) @ (m, m) matmul and an elementwise
  ``x * 2 + 1`` on every device at once (through ``shard_map``; emulated CPU devices share the
  host's cores, so these are per-device figures under SPMD load). Peak FLOP/s per dtype is the
  best matmul rate; memory bandwidth is the best elementwise rate (bytes read + written / s).
* Matmul efficiency by size — on a GPU by default (``matmul_shapes``): transformer-shaped
  matmuls timed as chains inside one program (`matmul_sweep`: no per-call dispatch in the
  figure); the profiled cluster's ``matmul_efficiency`` curve per dtype is each size's rate
  over the best rate measured, so the planner prices a small micro-batch's matmuls slower
  than a large one's, as the device runs them.  Likewise for convolutions (``conv_shapes``,
  `conv_sweep`: a training pass through two 3x3 convolutions, forward and both gradients),
  the cluster's ``conv_efficiency``.

Fits: for every (collective, mesh shape, axis), least squares of ``time = α + factor(n)·S·β``
with rows weighted by 1/time, i.e. minimizing *relative* error, so the latency-bound small
sizes and the bandwidth-bound large ones count alike and no size has to be dropped; α and β
are clamped to >= 0 (refitting the other). The cluster's ``intra_host`` (``inter_host``) link is
one such fit over all samples of the axes that stay inside (cross) hosts, all collectives
together; when no axis crosses hosts the ``inter_host`` link of
:meth:`ClusterSpec.from_devices` is kept. Dtypes not measured keep the ``from_devices`` figure.

Lowerings (`collectives.LOWERINGS`): the samples are shard_map collectives, which every
backend keeps as the kind asked for — on CPU a ``psum_scatter`` compiles to a native
``reduce-scatter``, and it measured no faster than the ``psum`` of the same buffer (1.3-1.5x
at 1-16 MiB on 4 devices), which is why the time model prices a CPU reduce-scatter as an
all-reduce.  The cluster's links are fitted with each sample at the factor of the kind the
time model prices it as (``factor(kind, n, backend)``: a CPU reduce-scatter at the
all-reduce's 2(n−1)/n), so those samples agree with the formula that will use the link; at
the native (n−1)/n they would read as a link twice as slow and raise β for every kind, and
the planner, pricing the reduce-scatter as an all-reduce on top, would count its extra
volume twice.  The per-kind ``fits`` keep each kind's native factor (they describe what was
measured).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import conv_sweep, matmul_sweep
from .cluster import Backend, ClusterSpec, Link
from .collectives import lowered_kind
from .jsonio import write_json_atomic

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""Collective kinds profiled (HLO spelling)."""

DEFAULT_SIZES = tuple(2**k for k in range(10, 27, 2))
"""S in bytes: 2^10, 2^12, ..., 2^26."""
QUICK_SIZES = (2**10, 2**14, 2**18, 2**20)
DEFAULT_DTYPES = ("float32", "bfloat16")
DEFAULT_MATMUL_SIZES = (512, 1024, 2048)
QUICK_MATMUL_SIZES = (256,)
DEFAULT_ELEMENTWISE_BYTES = (2**24, 2**26)
QUICK_ELEMENTWISE_BYTES = (2**22,)

Progress = Callable[[int, int, str], None]
"""``progress(done, total, label)``: called before each measurement and once at the end."""


def factor(collective: str, n: int, backend: Backend | None = None) -> float:
    """The α-β bandwidth factor of ``collective`` on ``n`` devices (S·β is multiplied by it);
    with ``backend``, of the kind that backend runs it as (`collectives.lowered_kind`)."""
    if n <= 1:
        return 0.0
    if backend is not None:
        collective = lowered_kind(collective, backend)
    return {
        "all-reduce": 2.0 * (n - 1) / n,
        "all-gather": (n - 1) / n,
        "reduce-scatter": (n - 1) / n,
        "all-to-all": (n - 1) / (n * n),
        "collective-permute": 1.0,
        "send-recv": 1.0,
    }[collective]


@dataclasses.dataclass(frozen=True)
class ProfileResult:
    """What :func:`profile` measured and the cluster fitted from it.

    Attributes:
      cluster: the fitted cluster (``intra_host`` / ``inter_host`` links, peak FLOP/s, memory
        bandwidth from the measurements; the rest from ``ClusterSpec.from_devices``).
      samples: one dict per collective measurement: ``collective``, ``mesh_shape`` (list),
        ``axis`` (index into ``mesh_shape``), ``group_size``, ``crosses_hosts``, ``nbytes``
        (S, bytes), ``seconds`` (median).
      fits: one dict per (collective, mesh_shape, axis): ``alpha_s``, ``beta_s_per_byte``,
        ``max_rel_error``, ``median_rel_error`` (of the fit over its own samples),
        ``num_samples``.
      links: ``{"intra_host": {...}, "inter_host": {...}}``, the joint fits behind the cluster's
        links with the same keys as a fit (``inter_host`` only when measured).
      compute_samples: one dict per compute measurement: ``op`` (``"matmul"`` or
        ``"elementwise"``), ``dtype``, ``shape``, ``flops``, ``nbytes``, ``seconds``,
        ``flops_per_s``, ``bytes_per_s`` (per device).
      meta: platform, device kind, device count, jax version, timestamp, repeats.
    """

    cluster: ClusterSpec
    samples: tuple[dict[str, Any], ...]
    fits: tuple[dict[str, Any], ...]
    links: Mapping[str, dict[str, Any]]
    compute_samples: tuple[dict[str, Any], ...]
    meta: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        """``{"cluster": ClusterSpec JSON, "samples", "fits", "links", "compute_samples", "meta"}``
        (the wrapped form :meth:`ClusterSpec.load` accepts)."""
        return {
            "cluster": self.cluster.to_json(),
            "samples": [dict(s) for s in self.samples],
            "fits": [dict(f) for f in self.fits],
            "links": {k: dict(v) for k, v in self.links.items()},
            "compute_samples": [dict(s) for s in self.compute_samples],
            "meta": dict(self.meta),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ProfileResult:
        """Inverse of :meth:`to_json`."""
        if not isinstance(d, Mapping) or "cluster" not in d:
            raise ValueError("a profile JSON must be an object with a 'cluster' field")
        return cls(
            cluster=ClusterSpec.from_json(d["cluster"]),
            samples=tuple(d.get("samples", ())),
            fits=tuple(d.get("fits", ())),
            links=dict(d.get("links", {})),
            compute_samples=tuple(d.get("compute_samples", ())),
            meta=dict(d.get("meta", {})),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes :meth:`to_json` to ``path``; ``ClusterSpec.load(path)`` reads its cluster."""
        write_json_atomic(path, self.to_json(), sort_keys=True)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ProfileResult:
        """Reads a file written by :meth:`save`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_json(json.load(f))


def profile(
    devices: Sequence[Any] | None = None,
    *,
    quick: bool = False,
    sizes: Sequence[int] | None = None,
    repeats: int | None = None,
    mesh_shapes: Sequence[Sequence[int]] | None = None,
    collectives: Sequence[str] = COLLECTIVES,
    dtypes: Sequence[str] = DEFAULT_DTYPES,
    matmul_sizes: Sequence[int] | None = None,
    elementwise_bytes: Sequence[int] | None = None,
    matmul_shapes: Sequence[Sequence[int]] | None = None,
    conv_shapes: Sequence[Sequence[int]] | None = None,
    progress: Progress | None = None,
) -> ProfileResult:
    """Measures ``devices`` (default ``jax.devices()``) and fits a :class:`ClusterSpec`.

    Args:
      devices: the devices to profile, all of one kind.
      quick: few sizes and repeats (for tests): sizes ``QUICK_SIZES``, 5 repeats, one matmul
        and one elementwise size. Explicit arguments override it.
      sizes: collective sizes S in bytes (default ``DEFAULT_SIZES``, 2^10..2^26).
      repeats: timed calls per measurement after the warm-up (default 10, quick 5).
      mesh_shapes: logical meshes over ``devices`` (row-major); default ``(N,)`` and, when N is
        even and >= 4, ``(2, N // 2)``. Axes of size 1 are skipped.
      collectives: subset of ``COLLECTIVES``.
      dtypes: dtypes for the matmul / elementwise measurements.
      matmul_sizes: m of the per-device (m, m) @ (m, m) matmuls.
      elementwise_bytes: per-device buffer sizes of the elementwise measurement.
      matmul_shapes: ``(m, k, n)`` shapes of the efficiency sweep (`matmul_sweep`); default
        ``matmul_sweep.GPU_SHAPES`` on a GPU, none elsewhere; ``()`` skips it.
      conv_shapes: ``(n, side, c, w)`` shapes of the convolution sweep (`conv_sweep`);
        default ``conv_sweep.GPU_SHAPES`` on a GPU, none elsewhere; ``()`` skips it.
      progress: ``progress(done, total, label)`` callback.

    Raises:
      ValueError: an unknown collective, a mesh that does not fit the devices, bad sizes.
    """
    devices = list(jax.devices() if devices is None else devices)
    n_dev = len(devices)
    sizes = tuple(sizes if sizes is not None else (QUICK_SIZES if quick else DEFAULT_SIZES))
    repeats = int(repeats if repeats is not None else (5 if quick else 10))
    if mesh_shapes is None:
        mesh_shapes = [(n_dev,)] + ([(2, n_dev // 2)] if n_dev >= 4 and n_dev % 2 == 0 else [])
    mesh_shapes = [tuple(int(s) for s in shape) for shape in mesh_shapes]
    matmul_sizes = tuple(matmul_sizes or (QUICK_MATMUL_SIZES if quick else DEFAULT_MATMUL_SIZES))
    elementwise_bytes = tuple(
        elementwise_bytes or (QUICK_ELEMENTWISE_BYTES if quick else DEFAULT_ELEMENTWISE_BYTES))
    if matmul_shapes is None:
        matmul_shapes = matmul_sweep.GPU_SHAPES if devices[0].platform == "gpu" else ()
    matmul_shapes = [tuple(int(v) for v in shape) for shape in matmul_shapes]
    if conv_shapes is None:
        conv_shapes = conv_sweep.GPU_SHAPES if devices[0].platform == "gpu" else ()
    conv_shapes = [tuple(int(v) for v in shape) for shape in conv_shapes]
    _check_settings(n_dev, sizes, repeats, mesh_shapes, collectives, matmul_shapes,
                    conv_shapes)

    base = _base_cluster(devices)
    groups = [(kind, shape, axis) for shape in mesh_shapes for axis, n in enumerate(shape)
              if n > 1 for kind in collectives]
    ticker = _Ticker(progress, len(groups) * len(sizes) + len(dtypes) * (
        len(matmul_sizes) + len(elementwise_bytes) + len(matmul_shapes) + len(conv_shapes)))
    meshes = {shape: _mesh(devices, shape) for shape in mesh_shapes}
    samples = _measure_collectives(groups, meshes, sizes, repeats, ticker)
    compute_samples = _measure_compute(_mesh(devices, (n_dev,)), dtypes, matmul_sizes,
                                       elementwise_bytes, matmul_shapes, conv_shapes,
                                       repeats, ticker)
    ticker.at("done")

    fits = _fit_groups(samples)
    links, cluster = _fit_cluster(base, samples, compute_samples)
    meta = {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "num_devices": n_dev,
        "jax_version": jax.__version__,
        "repeats": repeats,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return ProfileResult(cluster, tuple(samples), tuple(fits), links, tuple(compute_samples),
                         meta)



def _check_settings(n_dev: int, sizes: Sequence[int], repeats: int,
                    mesh_shapes: Sequence[tuple[int, ...]], collectives: Sequence[str],
                    matmul_shapes: Sequence[tuple[int, ...]],
                    conv_shapes: Sequence[tuple[int, ...]] = ()) -> None:
    """Raises ValueError for settings `profile` cannot measure."""
    if any(len(shape) != 3 or min(shape) < 1 for shape in matmul_shapes):
        raise ValueError(f"matmul_shapes must be (m, k, n) triples of positive integers, "
                         f"got {list(matmul_shapes)}")
    if any(len(shape) != 4 or min(shape) < 1 for shape in conv_shapes):
        raise ValueError(f"conv_shapes must be (n, side, c, w) tuples of positive integers, "
                         f"got {list(conv_shapes)}")
    unknown = sorted(set(collectives) - set(COLLECTIVES))
    if unknown:
        raise ValueError(f"unknown collective(s) {unknown}; valid: {list(COLLECTIVES)}")
    if repeats < 1 or not sizes or any(int(s) < 1 for s in sizes):
        raise ValueError(f"profile requires repeats >= 1 and sizes >= 1, got {repeats=}, {sizes=}")
    for shape in mesh_shapes:
        if math.prod(shape) != n_dev:
            raise ValueError(f"mesh shape {shape} does not hold the {n_dev} devices profiled")


class _Ticker:
    """`profile`'s progress: measurements done out of `total`, reported before each one."""

    def __init__(self, progress: Progress | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def at(self, label: str) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total, label)


def _measure_collectives(groups: Sequence[tuple[str, tuple[int, ...], int]],
                         meshes: dict[tuple[int, ...], Any], sizes: Sequence[int],
                         repeats: int, ticker: _Ticker) -> list[dict]:
    """One sample per (collective, mesh, axis, size): its seconds for `nbytes` bytes."""
    samples = []
    for kind, shape, axis in groups:
        ticker.at(f"{kind} mesh={shape} axis={axis}")
        crosses = _crosses_hosts(meshes[shape], axis)
        for nbytes, seconds in _time_collective(kind, meshes[shape], axis, sizes, repeats):
            samples.append({"collective": kind, "mesh_shape": list(shape), "axis": axis,
                            "group_size": shape[axis], "crosses_hosts": crosses,
                            "nbytes": nbytes, "seconds": seconds})
        ticker.done += len(sizes)
    return samples


def _measure_compute(flat: Any, dtypes: Sequence[str], matmul_sizes: Sequence[int],
                     elementwise_bytes: Sequence[int],
                     matmul_shapes: Sequence[tuple[int, ...]],
                     conv_shapes: Sequence[tuple[int, ...]], repeats: int,
                     ticker: _Ticker) -> list[dict]:
    """Matmul, elementwise, matmul-chain and conv-chain samples on the flat mesh `flat`,
    per dtype."""
    samples = []

    def run(label: str, measure: Callable[..., dict], *args: Any) -> None:
        ticker.at(label)
        samples.append(measure(*args))
        ticker.done += 1

    for dtype in dtypes:
        for m in matmul_sizes:
            run(f"matmul {dtype} {m}x{m}x{m}", _time_matmul, flat, dtype, m, repeats)
        for nbytes in elementwise_bytes:
            run(f"elementwise {dtype} {nbytes} B", _time_elementwise, flat, dtype, nbytes,
                repeats)
        for shape in matmul_shapes:
            run(f"matmul chain {dtype} {'x'.join(map(str, shape))}", matmul_sweep.time_shape,
                flat, dtype, shape, repeats, _interleaved_medians)
        for shape in conv_shapes:
            run(f"conv chain {dtype} {'x'.join(map(str, shape))}", conv_sweep.time_shape,
                flat, dtype, shape, repeats, _interleaved_medians)
    return samples


# --- fitting ----------------------------------------------------------------------------------


def fit_alpha_beta(x: Sequence[float], t: Sequence[float]) -> tuple[float, float]:
    """(α, β) >= 0 minimizing Σ((α + x·β − t) / t)²: relative-error least squares.

    Args:
      x: factor(n)·S per sample, bytes.
      t: measured seconds per sample (> 0).
    """
    x = np.asarray(x, dtype=float)
    t = np.asarray(t, dtype=float)
    w = 1.0 / t
    a = np.stack([w, x * w], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0:
        alpha, beta = 0.0, float(np.sum(x * w) / max(np.sum((x * w) ** 2), 1e-300))
    if beta < 0:
        alpha, beta = float(np.sum(w) / np.sum(w * w)), 0.0
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def _errors(alpha: float, beta: float, x: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    rel = np.abs(alpha + x * beta - t) / t
    return float(np.max(rel)), float(np.median(rel))


def _fit_record(rows: list[dict[str, Any]], backend: Backend | None = None) -> dict[str, Any]:
    """α-β fit of `rows` (each at `factor(kind, n, backend)`) and its errors."""
    x = np.array([factor(r["collective"], r["group_size"], backend) * r["nbytes"]
                  for r in rows])
    t = np.array([r["seconds"] for r in rows])
    alpha, beta = fit_alpha_beta(x, t)
    max_err, med_err = _errors(alpha, beta, x, t)
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "max_rel_error": max_err,
            "median_rel_error": med_err, "num_samples": len(rows)}


def _fit_groups(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault((s["collective"], tuple(s["mesh_shape"]), s["axis"]), []).append(s)
    return [
        {"collective": kind, "mesh_shape": list(shape), "axis": axis,
         "group_size": shape[axis], **_fit_record(rows)}
        for (kind, shape, axis), rows in groups.items()
    ]


# The ClusterSpec efficiency field each sweep's samples fit (its `curves(samples, peaks)`).
CURVE_SWEEPS = (("matmul_efficiency", matmul_sweep), ("conv_efficiency", conv_sweep))


def _fit_cluster(base: ClusterSpec, samples, compute_samples):
    by_link: dict[str, list[dict[str, Any]]] = {"intra_host": [], "inter_host": []}
    for s in samples:
        by_link["inter_host" if s["crosses_hosts"] else "intra_host"].append(s)
    # Each sample at the factor of the kind the time model prices it as (module docstring).
    fitted = {name: _fit_record(rows, base.backend) for name, rows in by_link.items() if rows}
    new_links = {
        name: Link(rec["alpha_s"], rec["beta_s_per_byte"]) for name, rec in fitted.items()
    }
    peak = dict(base.peak_flops)
    bandwidth = base.memory_bandwidth_bytes_per_s
    matmuls = [c for c in compute_samples if c["op"] in ("matmul", "matmul-chain")]
    for dtype in {c["dtype"] for c in matmuls}:
        peak[dtype] = max(c["flops_per_s"] for c in matmuls if c["dtype"] == dtype)
    # Measured curves replace the preset's; dtypes the sweep did not cover keep theirs only
    # if their peak was not re-measured (a preset fraction is of the datasheet peak).
    remeasured = {m["dtype"] for m in matmuls}
    fitted_curves = {}
    for field, sweep in CURVE_SWEEPS:
        kept = {d: c for d, c in getattr(base, field).items() if d not in remeasured}
        fitted_curves[field] = {**kept, **sweep.curves(compute_samples, peak)}
    streams = [c["bytes_per_s"] for c in compute_samples if c["op"] == "elementwise"]
    if streams:
        bandwidth = max(streams)
    cluster = dataclasses.replace(
        base,
        name=f"profiled-{base.name}",
        peak_flops=peak,
        memory_bandwidth_bytes_per_s=bandwidth,
        **fitted_curves,
        **new_links,
    )
    return fitted, cluster


# --- measuring --------------------------------------------------------------------------------


def _base_cluster(devices: list[Any]) -> ClusterSpec:
    try:
        return ClusterSpec.from_devices(devices)
    except ValueError:
        pass
    # A device kind without a table row: memory from the runtime, the rest measured below.
    stats = devices[0].memory_stats() or {}
    memory = float(stats.get("bytes_limit", 0)) or 1.0
    return ClusterSpec(
        name=f"{len(devices)}x{devices[0].device_kind}", num_hosts=1,
        devices_per_host=len(devices), device_kind=str(devices[0].device_kind),
        peak_flops={"float32": 1.0}, memory_bytes=memory, memory_bandwidth_bytes_per_s=1.0,
        intra_host=Link(0.0, 0.0), inter_host=Link(0.0, 0.0),
    )


def _mesh(devices: list[Any], shape: tuple[int, ...]) -> Mesh:
    names = tuple(f"a{i}" for i in range(len(shape)))
    return Mesh(np.array(devices, dtype=object).reshape(shape), names,
                axis_types=(AxisType.Auto,) * len(shape))


def _crosses_hosts(mesh: Mesh, axis: int) -> bool:
    """Whether the groups along ``axis`` hold devices of more than one process (host)."""
    hosts = np.vectorize(lambda d: d.process_index)(mesh.devices)
    return bool(np.any(hosts.max(axis=axis) != hosts.min(axis=axis)))


def _median_time(fn: Callable[[Any], Any], arg: Any, repeats: int) -> float:
    return _interleaved_medians([(fn, arg)], repeats)[0]


def _interleaved_medians(calls: Sequence[tuple[Callable[[Any], Any], Any]],
                         repeats: int) -> list[float]:
    """Median seconds of each ``fn(arg)``, timed in ``repeats`` rounds over all the calls.

    Rounds rather than one call after another: a burst of load from other processes then
    lands on one repeat of several sizes (which the median drops) instead of on every
    repeat of one size (which would bend the fit). Each round opens with an untimed call,
    so the first size does not pay for freeing the previous round's largest buffers, and a
    result is released only after its clock stops.
    """
    for fn, arg in calls:
        jax.block_until_ready(fn(arg))  # warm-up: first-run allocations, thread pools
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        jax.block_until_ready(calls[0][0](calls[0][1]))
        for i, (fn, arg) in enumerate(calls):
            start = time.perf_counter()
            out = fn(arg)
            jax.block_until_ready(out)
            times[i].append(time.perf_counter() - start)
            del out
    return [statistics.median(t) for t in times]


def _local_op(kind: str, name: str, n: int) -> Callable[[Any], Any]:
    if kind == "all-reduce":
        return lambda x: jax.lax.psum(x, name)
    if kind == "all-gather":
        return lambda x: jax.lax.all_gather(x, name, axis=1, tiled=True)
    if kind == "reduce-scatter":
        return lambda x: jax.lax.psum_scatter(x, name, scatter_dimension=1, tiled=True)
    if kind == "all-to-all":
        return lambda x: jax.lax.all_to_all(x, name, 1, 1, tiled=True)
    perm = [(i, (i + 1) % n) for i in range(n)]
    return lambda x: jax.lax.ppermute(x, name, perm)


def _time_collective(kind: str, mesh: Mesh, axis: int, sizes: Sequence[int],
                     repeats: int) -> list[tuple[int, float]]:
    """(S actually used, median seconds) per size; S is rounded so buffers split evenly."""
    n = mesh.devices.shape[axis]
    spec = P(mesh.axis_names)  # dim 0 over all axes: one (1, elems) row per device
    fn = jax.jit(jax.shard_map(_local_op(kind, mesh.axis_names[axis], n), mesh=mesh,
                               in_specs=spec, out_specs=spec, check_vma=False))
    sharding = NamedSharding(mesh, spec)
    split = n if kind in ("all-gather", "all-to-all") else 1  # per-device buffer = S / split
    used, calls = [], []
    for nbytes in sizes:
        elems = max(n, (int(nbytes) // split // 4) // n * n)  # float32, divisible by n
        x = jax.jit(lambda e=elems: jnp.ones((mesh.devices.size, e), jnp.float32),
                    out_shardings=sharding)()
        used.append(elems * 4 * split)
        calls.append((fn, x))
    seconds = _interleaved_medians(calls, repeats)
    return list(zip(used, seconds))


def _time_matmul(mesh: Mesh, dtype: str, m: int, repeats: int) -> dict[str, Any]:
    n = mesh.devices.size
    spec = P(mesh.axis_names[0])
    sharding = NamedSharding(mesh, spec)
    fn = jax.jit(jax.shard_map(lambda a: jnp.dot(a, a, preferred_element_type=dtype), mesh=mesh,
                               in_specs=spec, out_specs=spec, check_vma=False))
    # Random operands: GPUs multiply constant or zero matrices measurably faster (less
    # switching power, higher clocks), which would overstate the peak.
    x = jax.jit(lambda: jax.random.uniform(jax.random.key(0), (n * m, m), dtype, -1.0, 1.0),
                out_shardings=sharding)()
    seconds = _median_time(fn, x, repeats)
    flops = 2.0 * m**3
    nbytes = 3 * m * m * jnp.dtype(dtype).itemsize
    return {"op": "matmul", "dtype": dtype, "shape": [m, m, m], "flops": flops,
            "nbytes": nbytes, "seconds": seconds, "flops_per_s": flops / seconds,
            "bytes_per_s": nbytes / seconds}


def _time_elementwise(mesh: Mesh, dtype: str, nbytes: int, repeats: int) -> dict[str, Any]:
    n = mesh.devices.size
    elems = max(1, nbytes // jnp.dtype(dtype).itemsize)
    spec = P(mesh.axis_names[0])
    sharding = NamedSharding(mesh, spec)
    fn = jax.jit(jax.shard_map(lambda a: a * 2 + 1, mesh=mesh, in_specs=spec, out_specs=spec,
                               check_vma=False))
    x = jax.jit(lambda: jnp.ones((n * elems,), dtype), out_shardings=sharding)()
    seconds = _median_time(fn, x, repeats)
    moved = 2.0 * elems * jnp.dtype(dtype).itemsize  # read + write
    return {"op": "elementwise", "dtype": dtype, "shape": [elems], "flops": 2.0 * elems,
            "nbytes": moved, "seconds": seconds, "flops_per_s": 2.0 * elems / seconds,
            "bytes_per_s": moved / seconds}
