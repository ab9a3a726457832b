"""Audit of a compiled executable: its real collectives, FLOPs and memory, priced (DESIGN §6).

:func:`audit` reads ``compiled.as_text()`` (the partitioned, optimized HLO), and
``compiled.cost_analysis()`` / ``compiled.memory_analysis()``; :meth:`Audit.price` prices what
it found with a :class:`ClusterSpec` through the same α-β functions the planner uses — an
independent check that the emitted program is the plan.

Conventions, checked on jax 0.10.2 (CPU):

* Every figure is **per device**: the HLO of an SPMD executable is the per-device program, so
  collective shapes are per-device buffers; ``cost_analysis()`` reports the per-device FLOPs
  and bytes (a batch-sharded (256, 512) @ (512, 128) matmul on 8 devices reports 1/8 of the
  global FLOPs, plus the collectives' own adds); ``memory_analysis()`` is per device.
* A collective is one instruction in the text (``-start`` forms once, their ``-done`` not
  at all) that runs ``Collective.count`` times per run of the executable: the product of
  the ``known_trip_count`` XLA records (``backend_config``) on the ``while`` loops whose
  bodies hold it, e.g. an ``nn.scan`` layer's collectives once per layer; a loop whose trip
  count XLA does not know counts once.  Byte and time totals (`Audit.bytes_by_kind`,
  `Audit.price`) include the count.
* Replica groups come in three spellings, all expanded to explicit device-id groups:
  ``{{0,1},{2,3}}`` (``{}`` = all devices), iota ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, and
  the mesh form this XLA prints for partitioner-made collectives,
  ``mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}`` (sub-axes
  ``'a':(pre)size``). The ids are SPMD partition ids, i.e. positions in the executable's
  device order, which for jit / shard_map over a Mesh is ``mesh.devices.flat``.
* Bytes priced (S of :mod:`autopar.cost_model.collectives`): all-reduce, reduce-scatter: the
  operand; all-gather: the result; all-to-all: group size × operand (the operand is this
  device's share S/n of the exchanged tensor — the planner prices all-to-all on the group's
  whole tensor, so this keeps both sides on one definition); collective-permute: a send/recv
  of the operand.
* Collectives are priced as the cluster's backend runs them (`collectives.LOWERINGS`): on a
  CPU cluster a ``reduce-scatter`` left in the HLO (shard_map's ``psum_scatter``; the
  partitioner's own already reads ``all-reduce`` + ``dynamic-slice``) costs an all-reduce.
* Predicted step time = compute + communication, with no overlap between them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import collectives as _collectives
from . import hlo_text as hlo
from .cluster import Backend, ClusterSpec, Link
from .compute import compute_time_s

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the audited module (per-device figures).

    Attributes:
      kind: one of ``KINDS`` (``-start`` forms are reported under their base kind).
      name: the HLO instruction name.
      dtype: element type of the result (numpy name, e.g. ``"float32"``).
      result_bytes: bytes of the result, summed over tuple elements (of the ``-done`` for
        async forms).
      operand_bytes: bytes of the operands, summed.
      groups: the replica groups as device ids; for ``collective-permute`` the
        (source, target) pairs.
      group_size: devices per group; for a permute, devices along the axes it moves over.
      axes: names of the logical mesh axes that vary inside a group (or between a pair).
      full_axes: whether every group is exactly all devices along ``axes`` (False for groups
        over part of an axis, e.g. a sub-axis of the partitioner's mesh).
      is_async: the instruction was a ``-start`` form.
      count: how many times it runs per run of the executable (the trip counts of the
        loops around it).
    """

    kind: str
    name: str
    dtype: str
    result_bytes: int
    operand_bytes: int
    groups: tuple[tuple[int, ...], ...]
    group_size: int
    axes: tuple[str, ...]
    full_axes: bool
    is_async: bool = False
    count: int = 1

    @property
    def nbytes(self) -> float:
        """S priced by :mod:`autopar.cost_model.collectives` (see the module docstring)."""
        if self.kind == "all-gather":
            return float(self.result_bytes)
        if self.kind == "all-to-all":
            return float(self.operand_bytes * self.group_size)
        return float(self.operand_bytes)

    def seconds(self, links: Sequence[Link], mesh_axes: Sequence[str],
                backend: Backend = "gpu") -> float:
        """α-β seconds on the slowest link among ``axes`` (``links`` per mesh axis), as
        ``backend`` runs the kind (`collectives.LOWERINGS`: a reduce-scatter kept by XLA:CPU,
        from a shard_map ``psum_scatter``, costs the all-reduce of its operand; the default,
        ``"gpu"``, runs every kind natively)."""
        if not self.axes:
            return 0.0
        used = [links[list(mesh_axes).index(a)] for a in self.axes]
        link = Link(max(x.alpha_s for x in used), max(x.beta_s_per_byte for x in used))
        if self.kind == "collective-permute":
            moves = any(src != dst for src, dst in self.groups)
            return _collectives.send_recv_s(self.nbytes, 2 if moves else 1, link)
        return _collectives.collective_s(self.kind, self.nbytes, self.group_size, link, backend)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["groups"] = [list(g) for g in self.groups]
        d["axes"] = list(self.axes)
        d["nbytes"] = self.nbytes
        return d


@dataclasses.dataclass(frozen=True)
class MemoryUsage:
    """Per-device memory from ``memory_analysis()``, bytes."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int

    @property
    def total_bytes(self) -> int:
        """argument + output − alias + temp (``peak_memory_in_bytes`` omits temp buffers)."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @classmethod
    def of(cls, compiled) -> MemoryUsage:
        """The terms of ``compiled.memory_analysis()``."""
        m = compiled.memory_analysis()
        return cls(int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                   int(m.alias_size_in_bytes), int(m.temp_size_in_bytes))


@dataclasses.dataclass(frozen=True)
class Audit:
    """What an executable does per device, read back from XLA.

    Attributes:
      mesh_shape: the logical mesh the executable runs on.
      mesh_axes: its axis names.
      collectives: every collective, in HLO text order.
      flops: ``cost_analysis()["flops"]`` per device (0.0 if unavailable).
      bytes_accessed: ``cost_analysis()["bytes accessed"]`` per device, bytes.
      memory: per-device memory (None if ``memory_analysis()`` is unavailable).
      compute_dtype: dtype of the largest dot / convolution output (sets the peak FLOP/s;
        ``"float32"`` when there is none).
      compute_kernel: the kind of call (`compute.KERNEL_CURVES` key) with the most output
        elements: ``"conv"`` where convolutions dominate, else ``"matmul"``; the FLOPs are
        priced on that kind's efficiency curve.
      involuntary_rematerializations: reshards the partitioner did by replicating the whole
        tensor (its "Involuntary full rematerialization" warnings, see
        :mod:`autopar.cost_model.compile_log`), or None when the compile was not logged.
    """

    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    collectives: tuple[Collective, ...]
    flops: float
    bytes_accessed: float
    memory: MemoryUsage | None
    compute_dtype: str
    involuntary_rematerializations: int | None = None
    compute_kernel: str = "matmul"

    def bytes_by_kind(self, which: str = "nbytes") -> dict[str, float]:
        """Sum of ``which`` (``"nbytes"``, ``"operand_bytes"`` or ``"result_bytes"``) per kind."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + float(getattr(c, which)) * c.count
        return out

    def price(self, cluster: ClusterSpec) -> dict[str, Any]:
        """Predicted seconds of one run on ``cluster``.

        Returns:
          ``{"communication_s", "compute_s", "total_s"}`` (total = compute + communication,
          no overlap), ``"by_kind"`` (seconds per collective kind) and ``"collectives"`` (one
          ``{"name", "kind", "seconds"}`` per collective).
        """
        links = cluster.mesh_axis_links(self.mesh_shape)
        per = [(c, c.seconds(links, self.mesh_axes, cluster.backend) * c.count)
               for c in self.collectives]
        by_kind: dict[str, float] = {}
        for c, s in per:
            by_kind[c.kind] = by_kind.get(c.kind, 0.0) + s
        comm = sum(s for _, s in per)
        compute = compute_time_s(self.flops, self.bytes_accessed, self.compute_dtype, cluster,
                                 self.compute_kernel)
        return {
            "communication_s": comm,
            "compute_s": compute,
            "total_s": comm + compute,
            "by_kind": by_kind,
            "collectives": [{"name": c.name, "kind": c.kind, "seconds": s} for c, s in per],
        }

    def to_json(self) -> dict[str, Any]:
        memory = None
        if self.memory is not None:
            memory = {**dataclasses.asdict(self.memory), "total_bytes": self.memory.total_bytes}
        return {
            "mesh_shape": list(self.mesh_shape),
            "mesh_axes": list(self.mesh_axes),
            "collectives": [c.to_json() for c in self.collectives],
            "flops": self.flops,
            "bytes_accessed": self.bytes_accessed,
            "memory": memory,
            "compute_dtype": self.compute_dtype,
            "compute_kernel": self.compute_kernel,
            "involuntary_rematerializations": self.involuntary_rematerializations,
        }

    def summary(self, cluster: ClusterSpec | None = None) -> str:
        """A text table: one row per collective, then FLOPs and memory (and seconds if
        ``cluster`` is given)."""
        priced = self.price(cluster) if cluster is not None else None
        header = (f"{'kind':<20}{'dtype':<10}{'axes':<12}{'n':>4}{'runs':>6}{'operand B':>14}"
                  f"{'result B':>14}")
        if priced:
            header += f"{'seconds':>12}"
        lines = [f"audit on mesh {self.mesh_shape} {self.mesh_axes}", header, "-" * len(header)]
        for i, c in enumerate(self.collectives):
            axes = ",".join(c.axes) or "-"
            row = (f"{c.kind + ('*' if c.is_async else ''):<20}{c.dtype:<10}{axes:<12}"
                   f"{c.group_size:>4}{c.count:>6}{c.operand_bytes:>14,}{c.result_bytes:>14,}")
            if priced:
                row += f"{priced['collectives'][i]['seconds']:>12.3e}"
            lines.append(row)
        lines.append(f"flops/device {self.flops:,.0f}   bytes accessed/device "
                     f"{self.bytes_accessed:,.0f}   compute dtype {self.compute_dtype}")
        if self.memory is not None:
            m = self.memory
            lines.append(f"memory/device {m.total_bytes:,} B = argument {m.argument_bytes:,} + "
                         f"output {m.output_bytes:,} - alias {m.alias_bytes:,} + "
                         f"temp {m.temp_bytes:,}")
        if priced:
            lines.append(f"predicted: compute {priced['compute_s']:.3e} s + communication "
                         f"{priced['communication_s']:.3e} s = {priced['total_s']:.3e} s")
        return "\n".join(lines)


def audit(compiled: Any, mesh_shape: Sequence[int], mesh_axes: Sequence[str],
          device_ids: Sequence[int] | None = None, compile_log: Any = None) -> Audit:
    """Audits ``compiled`` (``jax.jit(f).lower(...).compile()``) run on a logical mesh.

    Args:
      compiled: a compiled executable (``as_text``, ``cost_analysis``, ``memory_analysis``).
      mesh_shape: devices along each logical mesh axis, e.g. ``(2, 4)``.
      mesh_axes: the axis names, e.g. ``("x", "y")``.
      device_ids: the id the HLO uses for each flat (row-major) mesh position; default
        ``range(prod(mesh_shape))`` — SPMD partition ids follow the mesh's device order.
      compile_log: the `compile_log.CompileLog` of the compile that made ``compiled``
        (`compile_log.compile_logged`), to count involuntary full rematerializations.

    Raises:
      ValueError: mismatched mesh shape / names / device ids, or HLO this parser cannot read.
    """
    flops, bytes_accessed = _cost(compiled)
    try:
        memory = MemoryUsage.of(compiled)
    except Exception:  # noqa: BLE001 - backends without memory stats raise various errors
        memory = None
    base = audit_text(compiled.as_text(), mesh_shape, mesh_axes, device_ids)
    remats = None if compile_log is None else compile_log.involuntary_rematerializations
    return dataclasses.replace(base, flops=flops, bytes_accessed=bytes_accessed, memory=memory,
                               involuntary_rematerializations=remats)


def audit_text(hlo_text: str, mesh_shape: Sequence[int], mesh_axes: Sequence[str],
               device_ids: Sequence[int] | None = None) -> Audit:
    """The collectives of HLO text (no FLOPs or memory: those need the executable)."""
    shape = tuple(int(s) for s in mesh_shape)
    axes = tuple(str(a) for a in mesh_axes)
    if len(shape) != len(axes) or any(s < 1 for s in shape):
        raise ValueError(f"mesh_shape and mesh_axes must match, got {shape} and {axes}")
    size = math.prod(shape)
    ids = list(range(size)) if device_ids is None else [int(i) for i in device_ids]
    if len(ids) != size or len(set(ids)) != size:
        raise ValueError(f"device_ids must be {size} distinct ids, got {device_ids!r}")
    position = {d: p for p, d in enumerate(ids)}

    instructions = hlo.parse_instructions(hlo_text)
    counts = hlo.run_counts(hlo_text)
    types = {name: typ for name, typ, _, _, _ in instructions}
    done_types = {}
    for _, typ, opcode, operands, _ in instructions:
        if opcode.endswith("-done"):
            for ref in re.findall(r"%([\w.\-]+)", operands):
                done_types[ref] = typ
    found = []
    compute: dict[tuple[str, str], int] = {}  # (kind of call, HLO dtype) -> output elements
    for name, typ, opcode, operands, attrs in instructions:
        kernel = hlo.kernel_kind(opcode, attrs)
        if kernel is not None:
            # A library call's result is (output, scratch bytes): its first shape only.
            shapes = hlo.shapes(typ)[:1] if opcode == "custom-call" else hlo.shapes(typ)
            for dt, elems in shapes:
                compute[kernel, dt] = compute.get((kernel, dt), 0) + elems
        is_async = opcode.endswith("-start")
        kind = opcode[: -len("-start")] if is_async else opcode
        if kind not in KINDS:
            continue
        operand_bytes = hlo.operand_bytes(operands, types)
        result_type = done_types.get(name, typ) if is_async else typ
        result_bytes = hlo.nbytes(result_type)
        result_shapes = hlo.shapes(result_type)
        dtype = hlo.HLO_DTYPES.get(result_shapes[0][0], (result_shapes[0][0],))[0] \
            if result_shapes else "float32"
        if kind == "collective-permute":
            pairs = _parse_pairs(attrs)
            found.append(dataclasses.replace(
                _permute(kind, name, dtype, result_bytes, operand_bytes, pairs, shape, axes,
                         position, is_async), count=counts.get(name, 1)))
            continue
        groups = _parse_groups(attrs, ids)
        varying, full = _varying_axes(groups, shape, position)
        found.append(Collective(
            kind=kind, name=name, dtype=dtype, result_bytes=result_bytes,
            operand_bytes=operand_bytes, groups=tuple(tuple(g) for g in groups),
            group_size=max(len(g) for g in groups), axes=tuple(axes[a] for a in varying),
            full_axes=full, is_async=is_async, count=counts.get(name, 1)))
    hlo_dtype = _largest(compute, 1) or "f32"
    return Audit(shape, axes, tuple(found), 0.0, 0.0, None,
                 hlo.HLO_DTYPES.get(hlo_dtype, ("float32",))[0],
                 compute_kernel=_largest(compute, 0) or "matmul")


def _largest(elements: dict[tuple[str, str], int], part: int) -> str | None:
    """The key part (0: kind of call, 1: dtype) with the most elements, None if empty."""
    totals: dict[str, int] = {}
    for key, n in elements.items():
        totals[key[part]] = totals.get(key[part], 0) + n
    return max(totals, key=totals.get) if totals else None


def _iota(dims: Sequence[int], reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    a = np.arange(math.prod(reshape)).reshape(reshape)
    if perm:
        a = a.transpose(perm)
    return a.reshape(dims)


def _ints(s: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", s or "")]


def _parse_groups(attrs: str, ids: list[int]) -> list[list[int]]:
    text = hlo.attribute(attrs, "replica_groups")
    if text is None or re.fullmatch(r"\{\s*\}", text):
        return [list(ids)]
    if text.startswith("{"):
        groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]
        return [g for g in groups if g] or [list(ids)]
    m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m:
        return _iota(_ints(m.group(1)), _ints(m.group(2)), _ints(m.group(3))).tolist()
    if text.startswith("mesh["):
        return _mesh_groups(text)
    raise ValueError(f"cannot read replica_groups={text!r}")


def _mesh_groups(text: str) -> list[list[int]]:
    """Explicit groups of the mesh form ``mesh[...][, device_ids=(...)] {axis refs}``."""
    end = hlo.closing(text, 4)
    names, sizes = [], []
    for name, size in re.findall(r"'?([^'=,\s]+)'?=(\d+)", text[5:end - 1]):
        names.append(name)
        sizes.append(int(size))
    n = math.prod(sizes)
    ids = np.arange(n)
    m = re.search(r"device_ids=\(", text)
    if m:
        inner = text[m.end():hlo.closing(text, m.end() - 1) - 1]
        iota = re.fullmatch(r"(?:\[([\d,]+)\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?", inner.strip())
        if iota:
            ids = _iota([n], _ints(iota.group(2)), _ints(iota.group(3)))
        else:  # an explicit list, possibly after its dims: the last n integers are the ids
            ids = np.array(_ints(inner)[-n:])
        if ids.size != n:
            raise ValueError(f"cannot read the device ids of replica_groups={text!r}")
    refs_text = text[text.rfind("{") + 1:-1]
    # Per mesh dim: (stride, size) of each grouped digit; coordinate c has digit
    # (c // stride) % size. A full axis is stride 1, size = axis size.
    digits: list[tuple[int, int, int]] = []
    for name, pre, sub in re.findall(r"'?([^':,{}\s]+)'?(?::\((\d+)\)(\d+))?", refs_text):
        dim = names.index(name)
        if pre:
            digits.append((dim, sizes[dim] // (int(pre) * int(sub)), int(sub)))
        else:
            digits.append((dim, 1, sizes[dim]))
    groups: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
    for flat in range(n):
        coords = list(np.unravel_index(flat, sizes))
        order = tuple((coords[d] // stride) % size for d, stride, size in digits)
        key = list(coords)
        for (d, stride, _), digit in zip(digits, order):
            key[d] -= digit * stride
        groups.setdefault(tuple(key), []).append((order, int(ids[flat])))
    return [[dev for _, dev in sorted(members)] for members in groups.values()]


def _parse_pairs(attrs: str) -> list[tuple[int, int]]:
    text = hlo.attribute(attrs, "source_target_pairs") or "{}"
    return [tuple(_ints(p)) for p in re.findall(r"\{(\d+\s*,\s*\d+)\}", text)]


def _coords(device: int, shape: tuple[int, ...], position: dict[int, int]) -> tuple[int, ...]:
    if device not in position:
        raise ValueError(f"HLO device id {device} is not on the mesh {shape} "
                         f"(ids {sorted(position)}); pass device_ids")
    return tuple(int(c) for c in np.unravel_index(position[device], shape))


def _varying_axes(groups, shape, position) -> tuple[tuple[int, ...], bool]:
    varying: set[int] = set()
    coords = [[_coords(d, shape, position) for d in g] for g in groups]
    for members in coords:
        for a in range(len(shape)):
            if len({c[a] for c in members}) > 1:
                varying.add(a)
    span = math.prod(shape[a] for a in varying)
    full = all(len(members) == span for members in coords)
    return tuple(sorted(varying)), full


def _permute(kind, name, dtype, result_bytes, operand_bytes, pairs, shape, axes, position,
             is_async) -> Collective:
    varying: set[int] = set()
    for src, dst in pairs:
        a, b = _coords(src, shape, position), _coords(dst, shape, position)
        varying.update(i for i in range(len(shape)) if a[i] != b[i])
    ordered = tuple(sorted(varying))
    return Collective(
        kind=kind, name=name, dtype=dtype, result_bytes=result_bytes,
        operand_bytes=operand_bytes, groups=tuple(pairs),
        group_size=math.prod(shape[a] for a in ordered), axes=tuple(axes[a] for a in ordered),
        full_axes=True, is_async=is_async)


def _cost(compiled: Any) -> tuple[float, float]:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return 0.0, 0.0
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0] if cost else {}
    cost = cost or {}
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
