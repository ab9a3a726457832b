"""Kernel efficiency by size: the fraction of a device's peak FLOP/s a matmul of a given size
sustains, read from the JSON table ``kernel_efficiency.json`` beside this file.

The table holds, per device kind (``devices.DEVICE_KINDS`` names) and per dtype of the
operation, points ``(FLOPs of one call on one device, achieved fraction of the peak)``, each
with its source (a datasheet, a published run, or a measurement of this repository), and
the fraction of the datasheet memory bandwidth a streaming kernel reaches.  Between points
the fraction is interpolated linearly in log(FLOPs); outside them it is clamped to the
nearest end.  A kind the table lacks keeps the fixed fraction of ``devices.py``.

Only data and lookups live here: ``cluster.py`` builds a preset's curves from the table and
``compute.py`` prices an operation through :func:`fraction_at`.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

TABLE_PATH = os.path.join(os.path.dirname(__file__), "kernel_efficiency.json")
FORMAT_VERSION = 1

Curve = tuple[tuple[float, float], ...]
"""Points ``(FLOPs per call, fraction of peak)`` sorted by FLOPs, FLOPs > 0, 0 < fraction <= 1."""


@dataclasses.dataclass(frozen=True)
class Point:
    """One row of the table.

    Attributes:
      flops: FLOPs of one call on one device (a multiply-add counts 2).
      fraction: achieved FLOP/s / the device's dense peak for the dtype (``devices.py``).
      source: where the figure comes from (paper and table/row, file of this repository).
    """

    flops: float
    fraction: float
    source: str


@dataclasses.dataclass(frozen=True)
class KindEfficiency:
    """The table's entry for one device kind.

    Attributes:
      matmul: per dtype name, the points sorted by ``flops``.
      bandwidth_fraction: achieved / datasheet memory bandwidth of a streaming kernel.
      bandwidth_source: where ``bandwidth_fraction`` comes from.
      conv: per dtype name, the points of convolution calls (``conv_general_dilated``:
        forward, input and kernel gradients alike); dtypes without them price convolutions
        on ``matmul``.
    """

    matmul: Mapping[str, tuple[Point, ...]]
    bandwidth_fraction: float
    bandwidth_source: str
    conv: Mapping[str, tuple[Point, ...]] = dataclasses.field(default_factory=dict)

    def curves(self) -> dict[str, Curve]:
        """Per dtype, the matmul ``(flops, fraction)`` pairs (what a ClusterSpec carries)."""
        return _pairs(self.matmul)

    def conv_curves(self) -> dict[str, Curve]:
        """Per dtype, the convolution ``(flops, fraction)`` pairs."""
        return _pairs(self.conv)


def _pairs(points: Mapping[str, tuple[Point, ...]]) -> dict[str, Curve]:
    return {d: tuple((p.flops, p.fraction) for p in pts) for d, pts in points.items()}


def check_curve(dtype: str, curve: Sequence[Sequence[float]]) -> Curve:
    """`curve` as a sorted :data:`Curve`; ValueError naming `dtype` if a point is malformed."""
    points = []
    for point in curve:
        if len(point) != 2:
            raise ValueError(f"efficiency curve {dtype!r}: a point is (flops, fraction), "
                             f"got {point!r}")
        flops, frac = (float(v) for v in point)
        if not (flops > 0 and math.isfinite(flops) and 0 < frac <= 1):
            raise ValueError(f"efficiency curve {dtype!r}: needs flops > 0 and "
                             f"0 < fraction <= 1, got ({flops!r}, {frac!r})")
        points.append((flops, frac))
    if not points:
        raise ValueError(f"efficiency curve {dtype!r} has no points")
    points.sort()
    if len({f for f, _ in points}) != len(points):
        raise ValueError(f"efficiency curve {dtype!r}: two points at the same FLOPs")
    return tuple(points)


def fraction_at(curve: Curve, flops: float) -> float:
    """The fraction of peak at `flops` FLOPs per call: linear in log(FLOPs) between the
    points of `curve`, the end point's fraction outside them (and at flops <= 0)."""
    if flops <= curve[0][0]:
        return curve[0][1]
    if flops >= curve[-1][0]:
        return curve[-1][1]
    i = bisect.bisect_right(curve, (flops, math.inf))
    (f0, e0), (f1, e1) = curve[i - 1], curve[i]
    t = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
    return e0 + t * (e1 - e0)


def parse(data: Mapping[str, Any]) -> dict[str, KindEfficiency]:
    """The table from its JSON form; ValueError naming the kind and field that is wrong."""
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"kernel efficiency table: format_version must be {FORMAT_VERSION}, "
                         f"got {data.get('format_version')!r}")
    kinds = {}
    for kind, entry in data["devices"].items():
        bandwidth = entry["bandwidth"]
        frac = float(bandwidth["fraction"])
        if not 0 < frac <= 1:
            raise ValueError(f"kernel efficiency table, {kind}: bandwidth fraction must be in "
                             f"(0, 1], got {frac!r}")
        matmul = _points(kind, "matmul", entry["matmul"])
        conv = _points(kind, "conv", entry.get("conv", {}))
        if set(conv) - set(matmul):
            # A fraction is of the datasheet peak only for dtypes with matmul rows (the
            # others run at devices.py's fixed fraction), so conv rows need matmul rows.
            raise ValueError(f"kernel efficiency table, {kind}: conv rows for "
                             f"{sorted(set(conv) - set(matmul))} without matmul rows")
        kinds[kind] = KindEfficiency(matmul, frac, str(bandwidth["source"]), conv)
    return kinds


def _points(kind: str, op: str, table: Mapping[str, Any]) -> dict[str, tuple[Point, ...]]:
    """Per dtype, the rows of one operation of one kind as sorted points (checked)."""
    out = {}
    for dtype, rows in table.items():
        check_curve(f"{kind}/{op}/{dtype}", [(r["flops"], r["fraction"]) for r in rows])
        out[dtype] = tuple(sorted((Point(float(r["flops"]), float(r["fraction"]),
                                         str(r["source"])) for r in rows),
                                  key=lambda p: p.flops))
    return out


@functools.lru_cache(maxsize=1)
def table() -> dict[str, KindEfficiency]:
    """The shipped table (``kernel_efficiency.json``), read once."""
    with open(TABLE_PATH, encoding="utf-8") as f:
        return parse(json.load(f))
