"""Inter-op pass: split L layers into pipeline stages on sub-meshes (Alpa §5, DESIGN §5).

Pure and device-free: the caller prices a candidate stage with `stage_cost(i, j, s)` =
seconds of one micro-batch's forward + backward of layers i..j (inclusive) on sub-mesh s
(the best logical mesh shape of that sub-mesh, memory checked), or None when it does not fit.

Objective, for B micro-batches (pipeline latency of GPipe / 1F1B):
```
T* = min over t_max of { Σ_stages t_i + (B − 1) · t_max }
F(s, k, d; t_max) = min_{j, n} { t(k..j, n) + F(s − 1, j + 1, d − |n|; t_max) },  t(k..j, n) ≤ t_max
```
F covers layers k..L−1 with s stages using exactly d devices.  The stage count s is tracked
only when `num_stages` is fixed (the stage cost does not depend on the stage's position, so
otherwise it adds nothing).  t_max runs over the sorted unique finite stage costs; the DP is
vectorized over a chunk of t_max values at a time (numpy), chunks growing geometrically, and
the search stops once B · t_max ≥ the best T found (no layout whose slowest stage takes t_max
or more can beat it, since T ≥ B · max_i t_i).

Cost: |range × sub-mesh| = L(L+1)/2 · |S| calls of `stage_cost` (each once; ranges that cannot
appear in any layout — e.g. a sub-mesh leaving no device for the other layers — are skipped),
then O(L² · |S| · P · D · T) float operations in O(L² · |S|) numpy calls per chunk, where
D = num_devices, T = t_max candidates evaluated and P = num_stages + 1 (or 1).

Assumption: the DP only checks that the stages' device counts sum to `num_devices`.  With the
Alpa shapes (1, 2^k) and (k, M) and M a power of two, any such multiset tiles the N × M
cluster (place the largest first, aligned); for other shapes or M, `assign_devices` is the
check and raises when they do not pack.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["StageChoice", "InterOpResult", "submesh_shapes", "run", "asked",
           "assign_devices"]

# Floats held by one DP table (L + 1 arrays of P x (D + 1) x chunk): bounds the chunk size.
_TABLE_FLOATS = 1 << 22
_FIRST_CHUNK = 16


class NoStageLayoutError(ValueError):
    """No split of the layers into stages on the sub-meshes has a feasible stage for every
    part (each stage over the memory, or a layer range no sub-mesh can run), or the stage
    count asked for cannot be formed (more stages than layers, or than the devices hold).
    A `ValueError`; bad arguments raise plain `ValueError`s."""


@dataclasses.dataclass(frozen=True)
class StageChoice:
    """One pipeline stage: layers (first, last) inclusive, sub-mesh (hosts, devices per host),
    and its `stage_cost` in seconds per micro-batch (forward + backward)."""

    layers: tuple[int, int]
    submesh: tuple[int, int]
    cost_s: float


@dataclasses.dataclass(frozen=True)
class InterOpResult:
    """The chosen stages in pipeline order; `total_s` = Σ cost_s + (B − 1) · t_max_s, with
    `t_max_s` the slowest stage's cost; `stats` holds counts and seconds of the search."""

    stages: tuple[StageChoice, ...]
    total_s: float
    t_max_s: float
    stats: Mapping[str, Any]


def submesh_shapes(num_hosts: int, devices_per_host: int) -> list[tuple[int, int]]:
    """Alpa's sub-mesh shapes of an N x M cluster: (1, 1), (1, 2), (1, 4), … (powers of two
    below M), (1, M), then (2, M), …, (N, M)."""
    for name, v in (("num_hosts", num_hosts), ("devices_per_host", devices_per_host)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"submesh_shapes requires a positive int {name}, got {v!r}")
    shapes = []
    m = 1
    while m < devices_per_host:
        shapes.append((1, m))
        m *= 2
    shapes.append((1, int(devices_per_host)))
    shapes.extend((k, int(devices_per_host)) for k in range(2, num_hosts + 1))
    return shapes


def equal_ranges(num_layers: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous (first, last) layer ranges of (nearly) equal length — the stages
    of a hand-written pipeline (Megatron-style equal layer counts)."""
    if not 1 <= parts <= num_layers:
        raise ValueError(f"equal_ranges: cannot cut {num_layers} layers into {parts} "
                         f"non-empty stages")
    edges = [round(k * num_layers / parts) for k in range(parts + 1)]
    return [(edges[k], edges[k + 1] - 1) for k in range(parts)]


def run(num_layers: int, submeshes: Sequence[tuple[int, int]],
        stage_cost: Callable[[int, int, int], float | None], *, num_devices: int,
        num_micro_batches: int, num_stages: int | None = None) -> InterOpResult:
    """Chooses stages (layer ranges) and a sub-mesh for each, minimizing pipeline latency.

    Args:
      num_layers: L; layers are 0..L−1.
      submeshes: candidate (hosts, devices per host) shapes; `stage_cost`'s `s` indexes it.
      stage_cost: (first layer, last layer inclusive, sub-mesh index) → seconds per
        micro-batch (forward + backward), or None when infeasible.  Called at most once
        per argument triple.
      num_devices: the stages' sub-meshes use exactly this many devices in total.
      num_micro_batches: B.
      num_stages: fix the number of stages, or None to search it.

    Raises:
      ValueError: bad arguments (naming them), or no layout is feasible (naming the smallest
        obstacle found: a layer no sub-mesh can hold, or the device counts).
    """
    t0 = time.perf_counter()
    L, D, B, S = num_layers, num_devices, num_micro_batches, num_stages
    for name, v in (("num_layers", L), ("num_devices", D), ("num_micro_batches", B)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"inter_op.run requires a positive int {name}, got {v!r}")
    shapes = [_check_shape(sh) for sh in submeshes]
    if not shapes:
        raise ValueError("inter_op.run requires at least one sub-mesh shape, got none")
    sizes = [h * m for h, m in shapes]
    if S is not None:
        if isinstance(S, bool) or not isinstance(S, (int, np.integer)) or S < 1:
            raise ValueError(f"num_stages must be None or a positive int, got {S!r}")
        if S > L:
            raise NoStageLayoutError(f"num_stages={S} exceeds num_layers={L}: each stage "
                                     f"needs a layer")
        if S * min(sizes) > D:
            raise NoStageLayoutError(
                f"num_stages={S} needs at least {S * min(sizes)} devices (smallest sub-mesh "
                f"{shapes[sizes.index(min(sizes))]}), but there are only num_devices={D}")

    cost = np.full((L, L, len(shapes)), np.inf)
    was_asked = np.zeros(cost.shape, dtype=bool)
    calls = 0
    for i, j, s in asked(L, shapes, num_devices=D, num_stages=S):
        c = stage_cost(i, j, s)
        was_asked[i, j, s] = True
        calls += 1
        if c is None:
            continue
        c = float(c)
        if math.isnan(c) or c < 0:
            raise ValueError(f"stage_cost({i}, {j}, {s}) returned {c}; expected seconds "
                             f">= 0 or None")
        cost[i, j, s] = c
    t_cost = time.perf_counter() - t0

    candidates = np.unique(cost[np.isfinite(cost)])
    final = 0 if S is None else S
    per_t = (L + 1) * (1 if S is None else S + 1) * (D + 1)
    max_chunk = max(1, _TABLE_FLOATS // per_t)
    best, best_t = math.inf, math.nan
    start, chunk, evaluated = 0, _FIRST_CHUNK, 0
    while start < len(candidates) and B * candidates[start] < best:
        tv = candidates[start:start + min(chunk, max_chunk)]
        table = _table(cost, sizes, D, S, tv)
        obj = table[0][final, D] + (B - 1) * tv
        i = int(np.argmin(obj))
        if obj[i] < best:
            best, best_t = float(obj[i]), float(tv[i])
        evaluated += len(tv)
        start += len(tv)
        chunk *= 2
    if not math.isfinite(best):
        raise NoStageLayoutError(_infeasible_message(cost, was_asked, shapes, sizes, D, S))

    stages = _reconstruct(cost, shapes, sizes, D, S, best_t)
    t_max = max(st.cost_s for st in stages)
    total = sum(st.cost_s for st in stages) + (B - 1) * t_max
    stats = {"stage_cost_calls": calls, "t_max_candidates": len(candidates),
             "t_max_evaluated": evaluated, "cost_s": t_cost,
             "seconds": time.perf_counter() - t0}
    return InterOpResult(tuple(stages), float(total), float(t_max), stats)


def asked(num_layers: int, submeshes: Sequence[tuple[int, int]], *, num_devices: int,
          num_stages: int | None = None) -> list[tuple[int, int, int]]:
    """The (first layer, last layer, sub-mesh index) triples `run` asks `stage_cost` for,
    in its order (a caller can price them ahead, e.g. several sub-meshes at once)."""
    sizes = [h * m for h, m in submeshes]
    if not sizes:
        return []
    lo, hi = min(sizes), max(sizes)
    return [(i, j, s) for i in range(num_layers) for j in range(i, num_layers)
            for s, size in enumerate(sizes)
            if _usable(i, j, size, num_layers, num_devices, num_stages, lo, hi)]


def _check_shape(shape: Any) -> tuple[int, int]:
    try:
        h, m = shape
    except (TypeError, ValueError):
        raise ValueError(f"a sub-mesh shape is (hosts, devices per host), got {shape!r}") from None
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 for v in (h, m)):
        raise ValueError(f"sub-mesh shape entries must be positive ints, got {shape!r}")
    return int(h), int(m)


def _usable(i: int, j: int, size: int, L: int, D: int, S: int | None, min_size: int,
            max_size: int) -> bool:
    """Whether stage i..j on `size` devices can appear in some layout (cheap necessary test)."""
    before, after = i > 0, j < L - 1
    if S is None:
        return size <= D - min_size * (before + after) and (before or after or size == D)
    # p stages before (0 iff i == 0, else 1..i), q after (0 iff j == L-1, else 1..L-1-j)
    lo = int(before) + int(after)
    hi = i + (L - 1 - j)
    rest = D - size
    return lo <= S - 1 <= hi and min_size * (S - 1) <= rest <= max_size * (S - 1)


def _table(cost: np.ndarray, sizes: list[int], D: int, S: int | None,
           tv: np.ndarray) -> list[np.ndarray]:
    """F[k][p, d, t]: least Σ stage cost covering layers k.. with (p stages if S is set) and
    exactly d devices, every stage ≤ tv[t]; inf if impossible."""
    L = cost.shape[0]
    P, shift = (1, 0) if S is None else (S + 1, 1)
    F: list[np.ndarray] = [np.empty(0)] * (L + 1)
    end = np.full((P, D + 1, len(tv)), np.inf)
    end[0, 0, :] = 0.0
    F[L] = end
    for k in range(L - 1, -1, -1):
        acc = np.full((P, D + 1, len(tv)), np.inf)
        for j in range(k, L):
            nxt = F[j + 1]
            for s, size in enumerate(sizes):
                c = cost[k, j, s]
                if not np.isfinite(c) or size > D:
                    continue
                stage = np.where(tv >= c, c, np.inf)
                view = acc[shift:, size:]
                np.minimum(view, stage + nxt[:P - shift, :D + 1 - size], out=view)
        F[k] = acc
    return F


def _reconstruct(cost: np.ndarray, shapes: list[tuple[int, int]], sizes: list[int], D: int,
                 S: int | None, t_max: float) -> list[StageChoice]:
    L = cost.shape[0]
    F = _table(cost, sizes, D, S, np.array([t_max]))
    shift = 0 if S is None else 1
    k, p, d = 0, (0 if S is None else S), D
    stages = []
    while k < L:
        target = F[k][p, d, 0]
        step = None
        for j in range(k, L):
            for s, size in enumerate(sizes):
                c = cost[k, j, s]
                if c > t_max or size > d or p - shift < 0:
                    continue
                if c + F[j + 1][p - shift, d - size, 0] <= target * (1 + 1e-12):
                    step = (j, s, float(c))
                    break
            if step:
                break
        assert step is not None, "DP table and reconstruction disagree"
        j, s, c = step
        stages.append(StageChoice((k, j), shapes[s], c))
        k, p, d = j + 1, p - shift, d - sizes[s]
    return stages


def _infeasible_message(cost: np.ndarray, asked: np.ndarray, shapes: list[tuple[int, int]],
                        sizes: list[int], D: int, S: int | None) -> str:
    L = cost.shape[0]
    fits = np.isfinite(cost).any(axis=2)        # [i, j]: range i..j fits some sub-mesh
    tried = asked.any(axis=2)
    for layer in range(L):
        if tried[: layer + 1, layer:].any() and not fits[: layer + 1, layer:].any():
            return (f"no stage layout fits: layer {layer} does not fit on any sub-mesh "
                    f"(tried {shapes}), alone or in any range of layers that could form a stage")
    full = _table(cost, sizes, D, S, np.array([np.inf]))
    totals = np.flatnonzero(np.isfinite(full[0][0 if S is None else S, :, 0]))
    stages = "any number of stages" if S is None else f"num_stages={S}"
    found = f" (feasible layouts use {totals.tolist()} devices)" if len(totals) else ""
    return (f"no stage layout fits: no split of layers 0–{L - 1} into {stages} on sub-meshes "
            f"{shapes} (sizes {sizes}) has feasible stages whose device counts sum to "
            f"num_devices={D}{found}")


def assign_devices(stages: Sequence[StageChoice | tuple[int, int]], num_hosts: int,
                   devices_per_host: int) -> list[list[int]]:
    """Device ids of each stage's sub-mesh on an N x M cluster (device i is on host i // M).

    Each stage gets a contiguous block, row-major with hosts outermost: a (1, m) sub-mesh lies
    inside one host, a (k, M) sub-mesh takes k whole hosts.  Stages are first laid out in
    pipeline order (neighbouring stages on neighbouring devices); if that leaves a (1, m)
    straddling a host, whole-host stages take hosts in order and the rest are packed
    first-fit by decreasing size (always succeeds for power-of-two sizes dividing M).
    Devices not used by any stage are left out.

    Raises:
      ValueError: a shape does not fit the cluster, or the shapes do not pack.
    """
    N, M = num_hosts, devices_per_host
    shapes = [_check_shape(st.submesh if isinstance(st, StageChoice) else st) for st in stages]
    for idx, (h, m) in enumerate(shapes):
        if (h > 1 and m != M) or m > M or h > N:
            raise ValueError(f"stage {idx}'s sub-mesh {(h, m)} does not fit a {N}x{M} cluster: "
                             f"use (1, m) with m <= {M} or (k, {M}) with k <= {N}")
    if sum(h * m for h, m in shapes) > N * M:
        raise ValueError(f"sub-meshes {shapes} need {sum(h * m for h, m in shapes)} devices; "
                         f"the cluster has {N}x{M} = {N * M}")
    # Pipeline order.
    out, cursor = [], 0
    for h, m in shapes:
        if (m == M and cursor % M) or (cursor % M) + m > M:
            break
        out.append(list(range(cursor, cursor + h * m)))
        cursor += h * m
    else:
        return out
    # Whole hosts first, then first-fit decreasing inside hosts.
    result: list[list[int]] = [[] for _ in shapes]
    host = 0
    for idx, (h, m) in enumerate(shapes):
        if m == M:
            result[idx] = list(range(host * M, (host + h) * M))
            host += h
    free = {hh: 0 for hh in range(host, N)}      # host -> devices already used (from the left)
    for idx in sorted((i for i, (_, m) in enumerate(shapes) if m < M), key=lambda i: -shapes[i][1]):
        m = shapes[idx][1]
        fit = next((hh for hh, used in free.items() if used + m <= M), None)
        if fit is None:
            raise ValueError(f"sub-meshes {shapes} do not pack into {N} hosts x {M} devices: "
                             f"stage {idx}'s {(1, m)} finds no host with {m} free devices")
        result[idx] = list(range(fit * M + free[fit], fit * M + free[fit] + m))
        free[fit] += m
    return result
