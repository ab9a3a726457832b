"""Layering pass: group a program's equations into L contiguous layers (Alpa §5, simplified).

`run(graph, num_layers)` cuts the equation order into layers that the inter-op pass then
groups into pipeline stages.  Two sources of cuts:

- user: the program contains `boundary_primitive` equations (`autopar.mark_pipeline_boundary()`);
  the pass cuts right after each of them and ignores `num_layers`.
- auto: a dynamic program over program order.  Every layer's FLOPs must stay within
  ``cap = (1 + delta) * total_flops / L``; among the layerings that do, it minimizes

  1. the largest number of bytes crossing any one cut (min-max, as Alpa's clustering DP):
     stages exchange activations concurrently over different links, so the slowest single
     transfer is what stalls the pipeline, and it also bounds the receive buffer per stage;
  2. then the total bytes crossing all cuts (less traffic and memory among the min-max ties);
  3. then the distance of each cut from its ideal FLOP position ``l * total / L`` (balance).

Bytes crossing the cut before equation `c`: values produced by an equation before `c` and read
by an equation at or after `c`, each value once per cut it crosses.  Program inputs and
constants are not counted (every stage that reads a parameter or a batch field gets it
directly, not through the previous stage), nor are program outputs unless an equation after
the cut reads them (an output leaves the stage that computes it).

Speed.  Equations with 0 FLOPs (reshape, broadcast, the markers, ...) never change a layer's
FLOPs, so between two consecutive FLOP-carrying equations all cut positions are equivalent
for balance; the pass keeps only the one with the fewest crossing bytes there.  That leaves
m − 1 candidate cuts for m FLOP-carrying equations, and each layer must contain at least one
FLOP-carrying equation.  The DP ``G[l][k] = combine(c_k, min_{j in window(k)} G[l-1][j])``
has a window (the layers ending at k whose FLOPs fit the cap) whose two ends only move right
as k grows, so a monotone deque gives the window minimum in amortized O(1): O(n + V) to
price the cuts and O(L·m) per DP phase (two phases), for n equations and V values.

If one equation alone exceeds the cap (e.g. a single huge matmul and L = 4), no layering
meets it; the pass then raises the cap to the smallest one any L-layer split can meet
(binary search with a greedy check) and says so in `stats["cap_relaxed"]`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

from autopar.passes.ir import Graph

from . import primitives

__all__ = ["Layering", "crossing_bytes", "run", "auto_num_layers", "MAX_AUTO_LAYERS"]

MAX_AUTO_LAYERS = 16


@dataclasses.dataclass(frozen=True)
class Layering:
    """The pass's answer.

    Attributes:
      layer_of_eqn: layer index of every equation of the graph, non-decreasing in program
        order (layer l holds a contiguous run of equations).
      num_layers: L.
      flops: FLOPs of each layer (whole, unsharded), length L.
      cut_bytes: bytes crossing each cut l|l+1 (length L − 1), as defined in the module doc.
      source: "user" when the cuts come from boundary markers, else "auto".
      stats: diagnostics (FLOP cap, candidates, whether the cap was relaxed, seconds).
    """

    layer_of_eqn: tuple[int, ...]
    num_layers: int
    flops: tuple[float, ...]
    cut_bytes: tuple[float, ...]
    source: Literal["auto", "user"]
    stats: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def eqn_ranges(self) -> tuple[tuple[int, int], ...]:
        """Half-open equation index range [start, end) of each layer."""
        bounds = np.searchsorted(np.asarray(self.layer_of_eqn, dtype=np.int64),
                                 np.arange(self.num_layers + 1), side="left")
        return tuple((int(bounds[i]), int(bounds[i + 1])) for i in range(self.num_layers))


def crossing_bytes(graph: Graph) -> np.ndarray:
    """float64 [num_eqns + 1]: bytes crossing a cut placed before equation c (c = 0..n).

    Entries 0 and n are 0 (nothing is cut there).
    """
    n = len(graph.eqns)
    diff = np.zeros(n + 2, dtype=np.float64)
    for v in graph.values:
        uses = graph.consumers[v.id]
        if v.producer is None or not uses or uses[-1] <= v.producer:
            continue
        # crosses cuts c with producer < c <= last use
        diff[v.producer + 1] += v.nbytes
        diff[uses[-1] + 1] -= v.nbytes
    return np.cumsum(diff)[: n + 1]


def auto_num_layers(graph: Graph) -> int:
    """The "auto" rule: one layer per two dot/conv equations, at least 1, at most 16 and at
    most the number of FLOP-carrying equations.

    Two heavy ops per layer keeps a matmul and its neighbour (e.g. an MLP block's two dense
    layers, or attention's two batched matmuls) together; 16 layers are plenty for the stage
    DP, whose cost grows as L².
    """
    heavy = sum(1 for e in graph.eqns if primitives.info(e.name).heavy)
    with_flops = sum(1 for e in graph.eqns if e.flops > 0)
    return max(1, min(heavy // 2, MAX_AUTO_LAYERS, with_flops))


def run(graph: Graph, num_layers: int | Literal["auto"] = "auto", *, delta: float = 0.25,
        boundary_primitive: str = "autopar_pipeline_boundary",
        min_layers: int = 1) -> Layering:
    """Groups the equations of `graph` into layers.

    Args:
      graph: the program (usually the forward part of the step).
      num_layers: L, or "auto" (see `auto_num_layers`); ignored when the graph has
        `boundary_primitive` equations.
      delta: FLOP imbalance allowed: each layer's FLOPs ≤ (1 + delta) · total / L.
      boundary_primitive: name of the user's cut-marker primitive.
      min_layers: with "auto", at least this many layers (e.g. the number of stages).

    Raises:
      ValueError: num_layers is not "auto" or an int in [1, number of equations with FLOPs],
        or delta < 0.
    """
    t0 = time.perf_counter()
    if not (isinstance(delta, (int, float)) and delta >= 0):
        raise ValueError(f"layering requires delta >= 0, got {delta=}")
    flops = np.array([e.flops for e in graph.eqns], dtype=np.float64)
    n = len(flops)
    cross = crossing_bytes(graph)

    marks = sorted({e.index + 1 for e in graph.eqns if e.name == boundary_primitive})
    cuts = [c for c in marks if 0 < c < n]
    if marks:
        stats = {"boundaries": len(marks), "seconds": time.perf_counter() - t0}
        return _layering(cuts, flops, cross, "user", stats)

    with_flops = int(np.count_nonzero(flops > 0))
    auto = num_layers == "auto"
    if auto:
        num_layers = min(max(auto_num_layers(graph), min_layers), max(1, with_flops))
    elif isinstance(num_layers, bool) or not isinstance(num_layers, (int, np.integer)):
        raise ValueError(f'num_layers must be "auto" or a positive int, got {num_layers!r}')
    num_layers = int(num_layers)
    if num_layers < 1 or num_layers > max(1, with_flops):
        raise ValueError(
            f"num_layers={num_layers} must be between 1 and the number of equations with "
            f"FLOPs ({with_flops} of {n} equations)")
    if num_layers == 1:
        return _layering([], flops, cross, "auto",
                         {"seconds": time.perf_counter() - t0, "candidates": 0})
    # "auto": repeated blocks grouped into up to 16 layers; identical layers are priced once.
    repeat = repeat_cuts(graph, max(num_layers, MAX_REPEAT_LAYERS) if auto else num_layers)
    # Block-aligned cuts are used when they give enough layers (auto) or exactly the
    # number asked for; otherwise the FLOP-balanced DP cuts inside blocks.
    if repeat is not None and not (len(repeat[0]) + 1 >= min_layers if auto
                                   else len(repeat[0]) + 1 == num_layers):
        repeat = None
    if repeat is not None:
        cuts, stats = repeat
        stats["seconds"] = time.perf_counter() - t0
        return _layering(cuts, flops, cross, "auto", stats)
    cuts, stats = _auto_cuts(flops, cross, num_layers, float(delta))
    stats["seconds"] = time.perf_counter() - t0
    return _layering(cuts, flops, cross, "auto", stats)


MAX_REPEAT_LAYERS = 16


def _signature(graph: Graph, i: int) -> tuple:
    e = graph.eqns[i]
    ins = tuple(graph.values[op].shape if isinstance(op, int) else ("lit", op.shape)
                for op in e.inputs)
    return (e.name, ins, tuple(graph.values[o].shape for o in e.outputs))


def repeat_cuts(graph: Graph, num_layers: int, min_repeats: int = 2,
                min_coverage: float = 0.6) -> tuple[list[int], dict] | None:
    """Cuts aligned with a repeated block (e.g. the transformer layers of a GPT).

    Finds the period p and start of the longest run of identical units — equation
    sequences with the same primitives and shapes, each starting at the same heavy
    (FLOP-carrying) equation — and groups the units k at a time (k = ceil(units / L)),
    the prologue joining the first layer and the epilogue the last.  The middle layers
    then have identical programs, so the planner prices one of them for all.  Returns None
    when no run covers `min_coverage` of the heavy equations.
    """
    heavy = [i for i, e in enumerate(graph.eqns) if e.flops > 0]
    m = len(heavy)
    if m < 2 * min_repeats:
        return None
    sigs = [_signature(graph, i) for i in range(len(graph.eqns))]
    ids: dict[tuple, int] = {}
    codes = np.array([ids.setdefault(sigs[i], len(ids)) for i in heavy], dtype=np.int64)
    best = None   # (coverage in heavy equations, p, start, repeats)
    for p in range(1, m // min_repeats + 1):
        # Longest run of positions i with codes[i] == codes[i + p]: r·p - p of them make
        # r consecutive identical units of p heavy equations.
        same = np.concatenate([[False], codes[:-p] == codes[p:], [False]])
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        if len(edges) == 0:
            continue
        lengths = edges[1::2] - edges[0::2]
        k = int(np.argmax(lengths))
        r = int(lengths[k]) // p + 1
        if r >= min_repeats and (best is None or r * p > best[0]):
            best = (r * p, p, int(edges[2 * k]), r)
        if best is not None and best[0] >= 0.95 * m:
            break
    if best is None or best[0] < min_coverage * m:
        return None
    _, p, a, r = best
    starts = [heavy[a + u * p] for u in range(r)] + [
        heavy[a + r * p] if a + r * p < m else len(graph.eqns)]
    # Whole-unit equation sequences must match too (not just their heavy equations).  The
    # first unit may carry prologue work (e.g. a mask computed once) and joins the first
    # layer; the last runs on into the epilogue, so only its first `length` equations count.
    ref = 1 if r >= 3 else 0
    length = starts[ref + 1] - starts[ref]
    unit = sigs[starts[ref]:starts[ref + 1]]
    for u in range(ref + 1, r):
        if sigs[starts[u]:starts[u] + length] != unit or (
                u < r - 1 and starts[u + 1] - starts[u] != length):
            return None
    k = -(-r // num_layers)
    cuts = [starts[u] for u in range(k, r, k)]
    flops = np.array([e.flops for e in graph.eqns])
    bounds = [0, *cuts, len(flops)]
    cap = flops.sum() / (len(cuts) + 1)
    worst = max(flops[lo:hi].sum() for lo, hi in zip(bounds, bounds[1:]))
    stats = {"repeat_period_heavy_eqns": p, "repeat_units": r, "units_per_layer": k,
             "flops_cap": float(cap), "cap_relaxed": bool(worst > 1.25 * cap)}
    return cuts, stats


def _layering(cuts: list[int], flops: np.ndarray, cross: np.ndarray, source: str,
              stats: dict) -> Layering:
    n = len(flops)
    layer_of = np.searchsorted(np.asarray(cuts, dtype=np.int64), np.arange(n), side="right")
    bounds = [0, *cuts, n]
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    layer_flops = tuple(float(prefix[b] - prefix[a]) for a, b in zip(bounds, bounds[1:]))
    return Layering(tuple(int(x) for x in layer_of), len(cuts) + 1, layer_flops,
                    tuple(float(cross[c]) for c in cuts), source, stats)  # type: ignore[arg-type]


def _auto_cuts(flops: np.ndarray, cross: np.ndarray, L: int, delta: float
               ) -> tuple[list[int], dict]:
    heavy = np.flatnonzero(flops > 0)
    m = len(heavy)
    prefix = [0.0, *np.cumsum(flops[heavy]).tolist()]   # FLOPs of the first k heavy eqns
    total = prefix[-1]
    # Candidate k (1..m-1): best cut position between heavy eqn k-1 and heavy eqn k.
    pos = [0] * (m + 1)
    cost = [0.0] * (m + 1)
    for k in range(1, m):
        lo, hi = int(heavy[k - 1]) + 1, int(heavy[k]) + 1
        i = lo + int(np.argmin(cross[lo:hi]))
        pos[k], cost[k] = i, float(cross[i])

    cap = (1.0 + delta) * total / L
    relaxed = _num_groups(prefix, cap) > L
    if relaxed:
        cap = _min_cap(prefix, L, cap)
    cap_tol = cap * (1.0 + 1e-9)

    # Phase 1: min over layerings of the max cut bytes.
    best_max, _ = _window_dp(prefix, L, cap_tol, 0.0,
                             lambda _layer, k, b: b if k == m else max(b, cost[k]))
    assert best_max is not None  # the cap is feasible by construction

    # Phase 2: among those, min (total cut bytes, distance of cuts from ideal positions).
    def step(layer: int, k: int, b: tuple[float, float]) -> tuple[float, float] | None:
        if k == m:
            return b
        if cost[k] > best_max:
            return None
        return (b[0] + cost[k], b[1] + abs(prefix[k] - layer * total / L))

    best, parents = _window_dp(prefix, L, cap_tol, (0.0, 0.0), step)
    assert best is not None
    ks, k = [], m
    for layer in range(L, 1, -1):
        k = parents[layer][k]
        ks.append(k)
    cuts = [pos[k] for k in reversed(ks)]
    stats = {"candidates": m - 1, "flops_cap": cap, "cap_relaxed": relaxed,
             "max_cut_bytes": best_max, "total_cut_bytes": best[0],
             "objective": "min max cut bytes, then min total cut bytes, then FLOP balance"}
    return cuts, stats


def _window_dp(prefix: list[float], L: int, cap: float, zero: Any,
               step: Callable[[int, int, Any], Any]) -> tuple[Any, list[list[int]]]:
    """G[l][k] = step(l, k, min_{j<k, prefix[k]-prefix[j] <= cap} G[l-1][j]), G[0][0] = zero.

    `step` must be monotone in its last argument (so the window minimum is the right
    predecessor) and may return None (infeasible).  Returns G[L][m] and the parent table
    (parents[l][k] = the j chosen for layer l ending at k; index 0 unused).
    """
    m = len(prefix) - 1
    prev: list[Any] = [None] * (m + 1)
    prev[0] = zero
    parents: list[list[int]] = [[]]
    for layer in range(1, L + 1):
        cur: list[Any] = [None] * (m + 1)
        par = [-1] * (m + 1)
        window: deque[int] = deque()   # j increasing, prev[j] increasing
        nxt = 0
        for k in range(layer, m - (L - layer) + 1):
            while nxt < k:
                if prev[nxt] is not None:
                    while window and prev[window[-1]] >= prev[nxt]:
                        window.pop()
                    window.append(nxt)
                nxt += 1
            while window and prefix[k] - prefix[window[0]] > cap:
                window.popleft()
            if window:
                j = window[0]
                cur[k] = step(layer, k, prev[j])
                par[k] = j
        parents.append(par)
        prev = cur
    return prev[m], parents


def _num_groups(prefix: list[float], cap: float) -> float:
    """Fewest contiguous groups with FLOPs ≤ cap each (greedy), or inf if one eqn exceeds it."""
    arr = np.asarray(prefix)
    m = len(prefix) - 1
    pos, count = 0, 0
    tol = cap * (1.0 + 1e-9)
    while pos < m:
        nxt = int(np.searchsorted(arr, arr[pos] + tol, side="right")) - 1
        if nxt <= pos:
            return float("inf")
        pos, count = nxt, count + 1
    return count


def _min_cap(prefix: list[float], L: int, lo: float) -> float:
    """Smallest cap (to 1e-9 relative) for which some split into L groups fits."""
    hi = prefix[-1]
    for _ in range(100):
        if hi - lo <= 1e-9 * hi:
            break
        mid = 0.5 * (lo + hi)
        if _num_groups(prefix, mid) <= L:
            hi = mid
        else:
            lo = mid
    return hi
