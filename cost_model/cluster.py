"""ClusterSpec: the hardware a plan is searched for (DESIGN §6).

A cluster is ``num_hosts`` hosts of ``devices_per_host`` identical devices. Logical meshes
lay the devices out in row-major order with hosts outermost; each mesh axis is priced with
the intra-host or the inter-host :class:`Link`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, TypeAlias

import numpy as np

from . import devices as _devices
from . import efficiency as _efficiency
from .jsonio import write_json_atomic

FORMAT_VERSION = 1

Backend: TypeAlias = Literal["cpu", "gpu", "tpu"]
"""The XLA backend that compiles a cluster's programs (which collectives it runs natively:
`collectives.LOWERINGS`)."""

#: The backend of a device kind: the first pattern (case-insensitive) that matches it.  A kind
#: matching none is a GPU (every kind of `devices.DEVICE_KINDS`, and a profiled GPU kind the
#: table lacks); CPU clusters are named ``"cpu"`` by every constructor (presets, cpu-local,
#: ``from_devices``, the profiler).
_BACKEND_PATTERNS: tuple[tuple[str, Backend], ...] = ((r"^cpu$", "cpu"), (r"tpu", "tpu"))


@functools.lru_cache(maxsize=64)
def backend_of(device_kind: str) -> Backend:
    """The XLA backend of `device_kind` (``"cpu"``, ``"gpu"`` or ``"tpu"``; memoized: the
    planner prices collectives millions of times)."""
    return next((backend for pattern, backend in _BACKEND_PATTERNS
                 if re.search(pattern, device_kind, re.IGNORECASE)), "gpu")

_PRESET_GRAMMAR = (
    "'[HOSTS x ]DEVICES x KIND' (e.g. '8xA100-80GB', '2x8xA100-80GB'), 'NxCPU' or 'cpu-local'"
)
_EXAMPLES = (
    "cpu-local",
    "8xCPU",
    "8xV100-16GB",
    "8x8xV100-16GB",
    "8xV100-32GB",
    "8xA100-40GB",
    "8xA100-80GB",
    "2x8xA100-80GB",
    "8xH100-80GB",
    "4x8xH100-80GB",
)
_DTYPE_ALIASES = {
    "f64": "float64", "fp64": "float64", "f32": "float32", "fp32": "float32",
    "f16": "float16", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
    "tf32": "tfloat32", "s8": "int8", "i8": "int8",
}  # fmt: skip


class _Frozen(Mapping[str, Any]):
    """Read-only, hashable ``str -> value`` mapping, keys sorted and values normalized by
    `_value` (keeps ClusterSpec frozen and hashable)."""

    __slots__ = ("_items",)

    @staticmethod
    def _value(key: str, value: Any) -> Any:
        return value

    def __init__(self, items: Mapping[str, Any]):
        self._items = {str(k): self._value(str(k), v) for k, v in sorted(items.items())}

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return False
        try:
            return self._items == {str(k): self._value(str(k), v) for k, v in other.items()}
        except (TypeError, ValueError):
            return False

    def __repr__(self) -> str:
        return repr(self._items)


class _FrozenFloats(_Frozen):
    """``dtype -> FLOP/s`` (floats)."""

    @staticmethod
    def _value(key: str, value: Any) -> float:
        return float(value)


_CURVE_FIELDS = ("matmul_efficiency", "conv_efficiency")
"""ClusterSpec's optional per-dtype efficiency curves, by kind of call."""


class _FrozenCurves(_Frozen):
    """``dtype -> efficiency curve`` (`efficiency.Curve`, checked and sorted)."""

    @staticmethod
    def _value(key: str, value: Any) -> _efficiency.Curve:
        return _efficiency.check_curve(key, value)


@dataclasses.dataclass(frozen=True)
class Link:
    """The interconnect of one mesh axis, in the α-β model.

    Attributes:
      alpha_s: latency per collective, seconds.
      beta_s_per_byte: transfer time per byte (1 / effective bandwidth), seconds/byte.
    """

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self):
        for field in ("alpha_s", "beta_s_per_byte"):
            value = getattr(self, field)
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise ValueError(f"Link requires a finite {field} >= 0, got {field}={value!r}")
            object.__setattr__(self, field, float(value))

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Effective bandwidth, bytes/s (``inf`` when ``beta_s_per_byte == 0``)."""
        return math.inf if self.beta_s_per_byte == 0 else 1.0 / self.beta_s_per_byte


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Hosts × devices per host of one device kind, with per-device and per-link figures.

    Attributes:
      name: a label, e.g. ``"2x8xA100-80GB"``.
      num_hosts: hosts (processes), >= 1.
      devices_per_host: devices on each host, >= 1.
      device_kind: e.g. ``"A100-80GB"`` or ``"cpu"``.
      peak_flops: FLOP/s per device keyed by dtype name; must hold ``"float32"``, the
        fallback for dtypes without a figure. A dtype with a curve in ``matmul_efficiency``
        sustains this times the curve's fraction; one without sustains this figure. GPU
        presets: the dense datasheet peak at XLA's default precision (float32 at TF32 on
        A100/H100/H200), times the kind's fixed ``achieved_fraction`` for dtypes without a
        curve (devices.py); profiled clusters: measured. Stored read-only.
      memory_bytes: device memory per device, bytes.
      memory_bandwidth_bytes_per_s: memory bandwidth a streaming kernel sustains per device,
        bytes/s (GPU presets: datasheet x the kind's measured fraction, kernel_efficiency.json).
      intra_host: link between devices of one host.
      inter_host: link between devices of different hosts (per-device share of the network).
      matmul_efficiency: per dtype name, points ``(FLOPs of one call on one device, fraction
        of peak_flops)`` that `compute.flop_fraction` interpolates (log FLOPs, clamped);
        empty: every call at the full ``peak_flops``. Stored read-only and sorted.
      conv_efficiency: the same for convolution calls (``conv_general_dilated``); a dtype
        without a curve here prices its convolutions on ``matmul_efficiency``.
    """

    name: str
    num_hosts: int
    devices_per_host: int
    device_kind: str
    peak_flops: Mapping[str, float]
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    intra_host: Link
    inter_host: Link
    matmul_efficiency: Mapping[str, _efficiency.Curve] = dataclasses.field(
        default_factory=dict)
    conv_efficiency: Mapping[str, _efficiency.Curve] = dataclasses.field(
        default_factory=dict)

    def __post_init__(self):
        for field in ("num_hosts", "devices_per_host"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ClusterSpec requires an integer {field} >= 1, got {value!r}")
            object.__setattr__(self, field, int(value))
        for field in ("memory_bytes", "memory_bandwidth_bytes_per_s"):
            value = getattr(self, field)
            if not _is_number(value) or not value > 0 or not math.isfinite(value):
                raise ValueError(f"ClusterSpec requires a finite {field} > 0, got {value!r}")
            object.__setattr__(self, field, float(value))
        if not isinstance(self.peak_flops, Mapping):
            raise ValueError(f"ClusterSpec.peak_flops must be a mapping, got {self.peak_flops!r}")
        for dtype, value in self.peak_flops.items():
            if not _is_number(value) or not value > 0 or not math.isfinite(value):
                raise ValueError(f"ClusterSpec.peak_flops[{dtype!r}] must be > 0, got {value!r}")
        if "float32" not in self.peak_flops:
            raise ValueError(
                "ClusterSpec.peak_flops needs a 'float32' entry (the fallback for other dtypes), "
                f"got keys {sorted(self.peak_flops)}"
            )
        object.__setattr__(self, "peak_flops", _FrozenFloats(self.peak_flops))
        for field in ("intra_host", "inter_host"):
            value = getattr(self, field)
            if not isinstance(value, Link):
                raise ValueError(f"ClusterSpec.{field} must be a Link, got {value!r}")
        for field in _CURVE_FIELDS:
            value = getattr(self, field)
            if not isinstance(value, Mapping):
                raise ValueError(f"ClusterSpec.{field} must be a mapping, got {value!r}")
            object.__setattr__(self, field, _FrozenCurves(value))

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    # --- queries ------------------------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        """The XLA backend of the cluster's devices (`backend_of` its ``device_kind``)."""
        return backend_of(self.device_kind)

    @property
    def num_devices(self) -> int:
        """Total devices, ``num_hosts * devices_per_host``."""
        return self.num_hosts * self.devices_per_host

    def peak_flops_per_s(self, dtype: Any) -> float:
        """Peak FLOP/s of one device for ``dtype`` (numpy/jax dtype, scalar type or name).

        Dtypes without a figure in ``peak_flops`` get the ``float32`` figure.
        """
        return self.peak_flops.get(_dtype_name(dtype), self.peak_flops["float32"])

    def mesh_axis_links(self, mesh_shape: Sequence[int]) -> tuple[Link, ...]:
        """The link of each axis of a logical mesh laid over the first ``prod(mesh_shape)`` devices.

        Devices are numbered row-major with hosts outermost (device ``i`` is on host
        ``i // devices_per_host``). An axis whose groups (devices that differ only in that
        axis' coordinate) span more than one host uses ``inter_host``, otherwise ``intra_host``.
        E.g. on 2x8 devices: mesh (2, 8) -> (inter, intra); (16,) -> (inter,);
        (4, 4) -> (inter, intra).

        Raises:
          ValueError: an entry is not a positive integer, ``prod(mesh_shape)`` exceeds
            ``num_devices`` or does not divide it.
        """
        shape = tuple(mesh_shape)
        if any(not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 1 for s in shape):
            raise ValueError(f"mesh_shape entries must be positive integers, got {shape}")
        size = math.prod(shape)
        if size > self.num_devices or self.num_devices % size:
            raise ValueError(
                f"mesh_shape={shape} has {size} devices, which must be <= and divide the "
                f"{self.num_devices} devices of cluster {self.name!r} "
                f"({self.num_hosts} hosts x {self.devices_per_host})"
            )
        host = (np.arange(size) // self.devices_per_host).reshape(shape)
        return tuple(
            self.inter_host
            if np.any(host.max(axis=axis) != host.min(axis=axis))
            else self.intra_host
            for axis in range(len(shape))
        )

    def with_devices(self, num_hosts: int, devices_per_host: int) -> ClusterSpec:
        """The same hardware (per-device figures and links) with another size, e.g. a sub-mesh."""
        name = _size_name(num_hosts, devices_per_host, self.device_kind)
        return dataclasses.replace(
            self, name=name, num_hosts=num_hosts, devices_per_host=devices_per_host
        )

    # --- JSON ---------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict with a ``"format_version"``; inverse of :meth:`from_json`
        (``"matmul_efficiency"`` and ``"conv_efficiency"`` only when the spec has such
        curves)."""
        curves = {field: {d: [list(p) for p in c] for d, c in getattr(self, field).items()}
                  for field in _CURVE_FIELDS}
        return {
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "num_hosts": self.num_hosts,
            "devices_per_host": self.devices_per_host,
            "device_kind": self.device_kind,
            "peak_flops": dict(self.peak_flops),
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
            "intra_host": dataclasses.asdict(self.intra_host),
            "inter_host": dataclasses.asdict(self.inter_host),
            **{field: c for field, c in curves.items() if c},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ClusterSpec:
        """Builds a spec from :meth:`to_json` output.

        Raises:
          ValueError: naming the missing, unknown or ill-typed field.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"a ClusterSpec JSON must be an object, got {type(d).__name__}")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"field 'format_version': expected {FORMAT_VERSION}, got {version!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields - {"format_version"})
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; expected {sorted(fields)}")
        missing = sorted(fields - set(d) - set(_CURVE_FIELDS))  # optional
        if missing:
            raise ValueError(f"missing field(s) {missing}")
        _check_type(d, "name", str)
        _check_type(d, "device_kind", str)
        _check_type(d, "num_hosts", int)
        _check_type(d, "devices_per_host", int)
        _check_type(d, "memory_bytes", float)
        _check_type(d, "memory_bandwidth_bytes_per_s", float)
        _check_type(d, "peak_flops", dict)
        for dtype in d["peak_flops"]:
            _check_type(d["peak_flops"], dtype, float, where="peak_flops.")
        links = {}
        for field in ("intra_host", "inter_host"):
            _check_type(d, field, dict)
            if set(d[field]) != {"alpha_s", "beta_s_per_byte"}:
                raise ValueError(
                    f"field {field!r}: expected keys ['alpha_s', 'beta_s_per_byte'], "
                    f"got {sorted(d[field])}"
                )
            for key in ("alpha_s", "beta_s_per_byte"):
                _check_type(d[field], key, float, where=f"{field}.")
            links[field] = Link(**d[field])
        curves = {field: d.get(field, {}) for field in _CURVE_FIELDS}
        for field, value in curves.items():
            if not isinstance(value, Mapping):
                raise ValueError(f"field {field!r}: expected an object, got {value!r}")
        try:
            return cls(
                name=d["name"],
                num_hosts=d["num_hosts"],
                devices_per_host=d["devices_per_host"],
                device_kind=d["device_kind"],
                peak_flops=d["peak_flops"],
                memory_bytes=d["memory_bytes"],
                memory_bandwidth_bytes_per_s=d["memory_bandwidth_bytes_per_s"],
                **curves,
                **links,
            )
        except ValueError as e:
            raise ValueError(f"invalid value: {e}") from e

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes :meth:`to_json` to ``path`` (JSON, indented)."""
        write_json_atomic(path, self.to_json(), sort_keys=True)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ClusterSpec:
        """Reads a file written by :meth:`save`, or a profile written by
        ``profiler.ProfileResult.save`` (``{"cluster": {...}, "samples": ..., ...}``).

        Raises:
          ValueError: the file is not valid JSON or a field is wrong; the message names the
            file and the field.
        """
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)}: not valid JSON ({e})") from e
        if isinstance(data, Mapping) and "cluster" in data and "format_version" not in data:
            data = data["cluster"]  # a profiler output wraps the spec with its samples
        try:
            return cls.from_json(data)
        except ValueError as e:
            raise ValueError(f"{os.fspath(path)}: bad ClusterSpec: {e}") from e

    # --- constructors -------------------------------------------------------------------------

    @classmethod
    def presets(cls) -> list[str]:
        """Example preset names, one or more per known device kind (all accepted by preset)."""
        return list(_EXAMPLES)

    @classmethod
    def preset(cls, name: str) -> ClusterSpec:
        """A cluster from its name: ``"[HOSTS x ]DEVICES x KIND"``, ``"NxCPU"`` or ``"cpu-local"``.

        KIND is one of ``devices.DEVICE_KINDS`` (case-insensitive), e.g. ``"8xA100-80GB"``,
        ``"2x8xA100-80GB"``, ``"8x8xV100-16GB"`` (Alpa's testbed). ``"cpu-local"`` is this
        machine with 8 emulated devices, from figures measured on it (see ``devices.py``).

        Raises:
          ValueError: unknown kind or malformed name; lists the grammar and the valid kinds.
        """
        if not isinstance(name, str):
            raise ValueError(f"preset name must be a str, got {name!r}")
        key = name.strip()
        if key.lower() == "cpu-local":
            return _cpu_cluster(1, _devices.CPU_LOCAL_DEVICES, name="cpu-local")
        m = re.fullmatch(r"\s*(?:(\d+)\s*[xX]\s*)?(\d+)\s*[xX]\s*([A-Za-z0-9][\w.-]*)\s*", key)
        kind = None
        if m:
            kind = m.group(3).upper()
            if kind != "CPU" and kind not in _devices.DEVICE_KINDS:
                kind = None
        if kind is None:
            raise ValueError(
                f"unknown cluster preset {name!r}: expected {_PRESET_GRAMMAR}, where KIND is "
                f"one of {_known_kinds()}; examples: {list(_EXAMPLES)}"
            )
        num_hosts = int(m.group(1)) if m.group(1) is not None else 1
        devices_per_host = int(m.group(2))
        if num_hosts < 1 or devices_per_host < 1:
            raise ValueError(f"preset {name!r} needs at least 1 host and 1 device per host")
        if kind == "CPU":
            return _cpu_cluster(num_hosts, devices_per_host)
        return _gpu_cluster(_devices.DEVICE_KINDS[kind], num_hosts, devices_per_host)

    @classmethod
    def from_devices(cls, devices: Sequence[Any]) -> ClusterSpec:
        """The cluster of live ``jax.Device``s (e.g. ``jax.devices()``).

        CPU devices give ``cpu-local`` figures (measured on the dev machine) split over the
        devices of each host. GPUs are matched by ``device_kind`` (e.g.
        ``"NVIDIA A100-SXM4-80GB"``) against the table in ``devices.py``. Hosts are counted by
        ``process_index``; every host must hold the same number of devices.

        Raises:
          ValueError: no devices, mixed kinds, uneven hosts, or a device kind not in the table
            (the message names it and lists the known kinds).
        """
        devices = list(devices)
        if not devices:
            raise ValueError("ClusterSpec.from_devices needs at least one device, got none")
        kinds = sorted({(d.platform, d.device_kind) for d in devices})
        if len(kinds) > 1:
            raise ValueError(f"ClusterSpec.from_devices needs one device kind, got {kinds}")
        platform, device_kind = kinds[0]
        per_host: dict[int, int] = {}
        for d in devices:
            per_host[d.process_index] = per_host.get(d.process_index, 0) + 1
        counts = sorted(set(per_host.values()))
        if len(counts) > 1:
            raise ValueError(
                f"ClusterSpec.from_devices needs the same number of devices on every host, "
                f"got {dict(sorted(per_host.items()))} (process_index -> devices)"
            )
        num_hosts, devices_per_host = len(per_host), counts[0]
        if platform == "cpu":
            name = "cpu-local" if num_hosts == 1 and devices_per_host == len(devices) else None
            return _cpu_cluster(num_hosts, devices_per_host, name=name)
        for kind in _devices.DEVICE_KINDS.values():
            if any(re.search(p, device_kind, re.IGNORECASE) for p in kind.match):
                return _gpu_cluster(kind, num_hosts, devices_per_host)
        raise ValueError(
            f"unknown device kind {device_kind!r} (platform {platform!r}): known kinds are "
            f"{_known_kinds()}; add it to autopar/cost_model/devices.py or run the profiler "
            "and load its ClusterSpec JSON"
        )


# --- helpers ----------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _dtype_name(dtype: Any) -> str:
    """The canonical name of `dtype` (memoized: the intra-op builder asks ~10^5 times)."""
    try:
        return _dtype_name_cached(dtype)
    except TypeError:  # unhashable
        return _dtype_name_uncached(dtype)


def _dtype_name_uncached(dtype: Any) -> str:
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        if key in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[key]
        try:
            return np.dtype(key).name
        except TypeError:
            return key
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype).lower()


_dtype_name_cached = functools.lru_cache(maxsize=512)(_dtype_name_uncached)


def _check_type(d: Mapping[str, Any], key: str, kind: type, where: str = "") -> None:
    value = d[key]
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        expected = {float: "number", int: "integer", str: "string", dict: "object"}[kind]
        raise ValueError(f"field '{where}{key}': expected a {expected}, got {value!r}")


def _known_kinds() -> list[str]:
    return [*_devices.DEVICE_KINDS, "CPU"]


def _size_name(num_hosts: int, devices_per_host: int, kind: str) -> str:
    kind = "CPU" if kind == "cpu" else kind
    if num_hosts == 1:
        return f"{devices_per_host}x{kind}"
    return f"{num_hosts}x{devices_per_host}x{kind}"


def _gpu_cluster(kind: _devices.DeviceKind, num_hosts: int, devices_per_host: int) -> ClusterSpec:
    measured = _efficiency.table().get(kind.name)
    curves = measured.curves() if measured else {}
    bandwidth_fraction = measured.bandwidth_fraction if measured else 1.0
    intra_bw = kind.intra_host_bytes_per_s * _devices.NVLINK_EFFICIENCY
    # Each device's share of its node's network (all devices cross hosts at once under SPMD).
    inter_bw = kind.host_network_bytes_per_s * _devices.NETWORK_EFFICIENCY / kind.devices_per_node
    return ClusterSpec(
        name=_size_name(num_hosts, devices_per_host, kind.name),
        num_hosts=num_hosts,
        devices_per_host=devices_per_host,
        device_kind=kind.name,
        peak_flops=kind.sustained_flops(curves),
        memory_bytes=kind.memory_bytes,
        memory_bandwidth_bytes_per_s=kind.memory_bandwidth_bytes_per_s * bandwidth_fraction,
        intra_host=Link(kind.intra_host_alpha_s, 1.0 / intra_bw),
        inter_host=Link(kind.inter_host_alpha_s, 1.0 / inter_bw),
        matmul_efficiency=curves,
        conv_efficiency=measured.conv_curves() if measured else {},
    )


def _cpu_cluster(num_hosts: int, devices_per_host: int, name: str | None = None) -> ClusterSpec:
    host = _devices.CPU_LOCAL
    # Emulated devices share the host's cores and memory: each gets an equal share.
    link = Link(host.collective_alpha_s, host.collective_beta_s_per_byte)
    return ClusterSpec(
        name=name or _size_name(num_hosts, devices_per_host, "cpu"),
        num_hosts=num_hosts,
        devices_per_host=devices_per_host,
        device_kind="cpu",
        peak_flops={k: v / devices_per_host for k, v in host.peak_flops.items()},
        memory_bytes=host.memory_bytes / devices_per_host,
        memory_bandwidth_bytes_per_s=host.memory_bandwidth_bytes_per_s / devices_per_host,
        intra_host=link,
        # No multi-host CPU measurement exists: reuse the local one until the profiler runs.
        inter_host=link,
    )
