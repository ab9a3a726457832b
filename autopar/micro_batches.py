"""`num_micro_batches="auto"`: the pipeline search tries micro-batch counts and keeps the
fastest predicted plan that fits memory.

The step is traced at micro-batch size, so every count B is its own traced program and its
own search (each through the plan cache): the layer ILPs of one count do not serve another
(the micro-batch's rows, the 1/B share of the gradient reduction and of the update all
change their coefficients).  The counts are a ladder of divisors of the batch (`ladder`: 1,
2, 4, ... — every divisor at least twice the previous one, and the batch itself), and the
answer is the one trying every count would give, found trying few (`bounded`):

- memory: a count whose search finds no layout that fits (bigger micro-batches need more
  activation memory) rules out every smaller count too;
- bubble and per-micro-batch costs: a searched count's stage costs bound every larger
  count from below (`lower_bound_s`: no layer range gets faster per row on smaller
  micro-batches, so the stage DP over its costs scaled by the rows, what no layout and no
  count changes kept whole, with the larger count's bubble, is below any plan of that
  count), and a count whose bound is above the best plan found is not searched.  That
  premise is about the stages of layer solutions `pipeline_search.search` assembles, not
  a theorem: it holds where the assembly finds, at every count, a stage no slower per row
  than the stage a larger count's layouts would make (its three alignments of a stage's
  layers, `pipeline_search.AFTER_TARGETS`); `tests/test_auto_micro_batches.py` checks it
  on gpt-toy (float32, float16) and a generated tied embedding.  The assembly may then
  solve a chosen stage's layers as one program, which only lowers a searched count's
  plan (`SearchReport.layered_step_s`: the step before): the count kept is then at least
  as fast as the fastest plan of layer solutions at any count, though a count bounded
  out might have come lower still that way.

The chosen plan records every try in `Plan.solver["micro_batch_tries"]` (count, predicted
step seconds or why it failed, search seconds) and the counts left out by their bound in
`solver["micro_batch_bounded"]`; `autopar.report` shows the tries.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from autopar.cost_model import ClusterSpec
from autopar.pipeline_search import StageCostTable

from . import pipeline_search
from .microbatch import MicroBatchError
from .passes import inter_op
from .passes.inter_op import NoStageLayoutError
from .passes.intra_op import MemoryBudgetError
from .plan import Plan
from .traced import Traced, leaf_positions

if TYPE_CHECKING:
    from .api import ParallelizedFunction


@dataclasses.dataclass(frozen=True)
class Try:
    """One micro-batch count tried: its plan's predicted step seconds (None: no plan fits,
    `error` says why), the seconds its trace + search (or cache lookup) took, and of those
    the trace's (the step traced at this count's micro-batch size; None where the trace
    itself failed)."""

    num_micro_batches: int
    step_s: float | None
    search_s: float
    error: str = ""
    cached: bool = False
    trace_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_micro_batches": self.num_micro_batches,
                               "step_s": self.step_s, "search_s": round(self.search_s, 3)}
        if self.trace_s is not None:
            out["trace_s"] = round(self.trace_s, 3)
        if self.error:
            out["error"] = self.error
        if self.cached:
            out["cached"] = True
        return out


def ladder(batch_size: int) -> list[int]:
    """Micro-batch counts worth trying for a batch of `batch_size` rows: divisors of it,
    each at least twice the previous (1, 2, 4, ... for a power of two), and the batch."""
    if batch_size < 1:
        raise ValueError(f"num_micro_batches='auto' needs a batch size >= 1, got {batch_size}")
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    out = [1]
    for d in divisors[1:]:
        if d >= 2 * out[-1]:
            out.append(d)
    if out[-1] != batch_size:
        out.append(batch_size)
    return out


def lower_bound_s(tables: Sequence[StageCostTable], count: int) -> float | None:
    """Seconds per step no plan of `count` micro-batches beats, from the stage costs that
    searches of fewer micro-batches priced (`tables`; None: none of them is of a count at
    or below `count`).

    A micro-batch of the larger count holds `table.num_micro_batches / count` times the
    rows, and no layer range gets faster per row on smaller micro-batches: what scales with
    the rows (compute, activations moved) scales at best in proportion, and what does not
    (parameter-gradient accumulation, latencies, the per-step update and gradient
    reduction amortized over the micro-batches) stays; a smaller micro-batch also has no
    layout a larger one lacks (a dim that splits over an axis splits at any multiple).  So
    each range's time-optimal seconds per micro-batch at `count` are at least the table's,
    scaled by that ratio (as are their activations' copies from the stage before), plus
    the unscaled rest of the part no layout and no count changes (`StageCostTable.fixed_s`:
    a time t = f + r, f that part, is at `count` at least f + ratio · r); each table gives
    such a floor, and the largest holds.  The stage DP over those floors (Σ t_i +
    (count − 1) · max t_i: the plan's objective without its memory, re-layouts and most
    per-step moves, each >= 0; over several hosts with one stage's activations from
    another host and the tied parameters' moves, `_pipeline_bound_s`) bounds every plan of
    `count` micro-batches from below.  Tables of other layer partitions or sub-meshes are
    bounded apart, the largest bound kept."""
    below = [t for t in tables if t.num_micro_batches <= count]
    if not below:
        return None
    groups: dict[tuple, list[StageCostTable]] = {}
    for t in below:
        groups.setdefault((t.num_layers, t.num_devices, t.submeshes, t.num_stages), []).append(t)
    bounds = [b for b in (_grouped_bound_s(g, count) for g in groups.values()) if b is not None]
    return max(bounds) if bounds else None


def _grouped_bound_s(tables: Sequence[StageCostTable], count: int) -> float | None:
    """`lower_bound_s` from tables of one layer partition and one set of sub-meshes: the
    stage DP over each range's largest floor (`_pipeline_bound_s`; `inter_op.run` for a
    fixed stage count)."""
    first = tables[0]
    keys = [(i, j, sub) for i in range(first.num_layers)
            for j in range(i, first.num_layers) for sub in first.submeshes]

    def floor(t: StageCostTable, key: tuple[int, int, tuple[int, int]], cross: bool) -> float:
        seconds = t.least_s.get(key)
        if seconds is None:
            return 0.0  # not priced: no bound
        if cross:
            seconds = t.cross_s.get(key, seconds)
        scale = t.num_micro_batches / count
        fixed = min(t.fixed_s.get(key, 0.0), seconds)
        return fixed + (seconds - fixed) * scale

    least = {key: max(floor(t, key, False) for t in tables) for key in keys}
    if first.num_stages is None:
        cross = {key: max(floor(t, key, True) for t in tables) for key in keys}
        tied = {sub: max(t.tied_s.get(sub, 0.0) for t in tables) for sub in first.submeshes}
        return _pipeline_bound_s(first, count, least, cross, tied)
    try:
        return inter_op.run(first.num_layers, first.submeshes,
                            lambda i, j, s: least[(i, j, first.submeshes[s])],
                            num_devices=first.num_devices, num_micro_batches=count,
                            num_stages=first.num_stages).total_s
    except NoStageLayoutError:
        return None


Floors = dict[tuple[int, int, tuple[int, int]], float]


def _pipeline_bound_s(table: StageCostTable, count: int, least: Floors, cross: Floors,
                      tied: dict[tuple[int, int], float]) -> float | None:
    """The least Σ t_i + (count − 1) · max t_i (+ per-step moves) over the stage layouts of
    `table`'s layers and sub-meshes using every device (any number of stages), where a
    stage costs its `least` floor, but in a pipeline of several stages

    * one stage after the first costs its `cross` floor (`StageCostTable.cross_s`; the
      same as `least` on one host): the stages span several hosts, and a stage inside one
      host shares it with the stage before only if that one is inside the same host, so
      somewhere a stage receives from another host;
    * the step moves the parameters the first and the last layer share, `tied` seconds
      by the last stage's sub-mesh (`StageCostTable.tied_s`).

    None: no layout.  The inter-op DP (`passes.inter_op`) over the largest stage time t,
    with a second table holding the layouts that have placed the cross-host stage."""
    layers, devices = table.num_layers, table.num_devices
    sizes = [h * m for h, m in table.submeshes]
    shape = (layers, layers, len(sizes))
    f, g = np.full(shape, np.inf), np.full(shape, np.inf)
    for (i, j, sub), c in least.items():
        f[i, j, table.submeshes.index(sub)] = c
        g[i, j, table.submeshes.index(sub)] = cross[(i, j, sub)]
    whole = [count * f[0, layers - 1, s] for s, size in enumerate(sizes) if size == devices]
    best = min(whole, default=math.inf)
    moves = np.array([tied[sub] for sub in table.submeshes])
    candidates = np.unique(np.concatenate([f[np.isfinite(f)], g[np.isfinite(g)]]))
    start, chunk = 0, 16
    while start < len(candidates) and (count - 1) * candidates[start] < best:
        tv = candidates[start:start + chunk]
        sums = _crossed_sums(f, g, moves, sizes, devices, tv)
        best = min(best, float(np.min(sums + (count - 1) * tv)))
        start += len(tv)
        chunk *= 2
    return best if math.isfinite(best) else None


def _crossed_sums(f: np.ndarray, g: np.ndarray, moves: np.ndarray, sizes: Sequence[int],
                  devices: int, tv: np.ndarray) -> np.ndarray:
    """Per largest stage time `tv[t]`: the least Σ of stage floors (`f`, or `g` for the
    cross-host stage; [first layer, last layer, sub-mesh]) over layouts of several stages
    using `devices` devices, each stage at most `tv[t]`, one stage after the first at its
    `g` floor, and the last stage paying `moves` (per sub-mesh) once; inf: none."""
    layers = f.shape[0]
    # per first layer k: [devices used by layers k.., t] without / with the cross stage
    plain = [np.empty(0)] * (layers + 1)
    crossed = [np.empty(0)] * (layers + 1)
    plain[layers] = np.full((devices + 1, len(tv)), np.inf)
    plain[layers][0] = 0.0
    crossed[layers] = np.full((devices + 1, len(tv)), np.inf)
    for k in range(layers - 1, -1, -1):
        a, b = np.full_like(plain[layers], np.inf), np.full_like(plain[layers], np.inf)
        for j in range(k, layers):
            for s, size in enumerate(sizes):
                if size > devices:
                    continue
                rest = slice(0, devices + 1 - size)
                extra = moves[s] if k > 0 and j == layers - 1 else 0.0
                if np.isfinite(f[k, j, s]):
                    stage = np.where(tv >= f[k, j, s], f[k, j, s] + extra, np.inf)
                    np.minimum(a[size:], stage + plain[j + 1][rest], out=a[size:])
                    np.minimum(b[size:], stage + crossed[j + 1][rest], out=b[size:])
                if k > 0 and np.isfinite(g[k, j, s]):
                    stage = np.where(tv >= g[k, j, s], g[k, j, s] + extra, np.inf)
                    np.minimum(b[size:], stage + plain[j + 1][rest], out=b[size:])
        plain[k], crossed[k] = a, b
    return crossed[0][devices]


def bounded(counts: Sequence[int], evaluate: Callable[[int], float | None],
            bound: Callable[[int], float | None]) -> int | None:
    """Index into `counts` of the fastest count, as if every count were evaluated:
    `evaluate(count)` gives predicted seconds or None (no layout fits: every smaller count
    is then out too); `bound(count)` seconds no plan of that count beats, from the counts
    evaluated so far (None: none known), and a count whose bound is above the best found is
    never evaluated (ties go to the smaller count, as in the exhaustive search).

    Order: the fewest micro-batches first (a count's stage costs bound the larger counts
    only, and with memory to spare one stage without a bubble is often the fastest);
    after a count that does not fit, the middle of the counts between the largest that
    does not and the smallest that does (bisection for the memory floor); then, every
    count below the smallest that fits being out, the fewest micro-batches not yet
    evaluated or bounded out."""
    seen: dict[int, float | None] = {}
    floor = -1  # counts at or below this index do not fit

    def best() -> tuple[float, int] | None:
        ok = [(v, k) for k, v in seen.items() if v is not None]
        return min(ok) if ok else None

    def beaten(k: int, incumbent: tuple[float, int] | None) -> bool:
        if incumbent is None:
            return False
        b = bound(counts[k])
        return b is not None and (b, k) > incumbent

    while True:
        incumbent = best()
        open_ = [k for k in range(floor + 1, len(counts))
                 if k not in seen and not beaten(k, incumbent)]
        if not open_:
            return None if incumbent is None else incumbent[1]
        fits = [k for k, v in seen.items() if v is not None]
        below = [k for k in open_ if not fits or k < min(fits)]
        # bisection for the memory floor, once a count is known not to fit; else the
        # fewest micro-batches (its stage costs bound every count above it)
        k = below[len(below) // 2] if below and seen else open_[0]
        seen[k] = evaluate(counts[k])
        if seen[k] is None:
            floor = max(floor, k)


def search(step: ParallelizedFunction, dynamic: list, static: tuple, positions: list[int],
           in_tree, cluster: ClusterSpec, device_ids: list[int]) -> Traced:
    """`step._plan` for a method with `num_micro_batches="auto"`: traces and searches the
    counts `bounded` visits (each search's stage costs bound the larger counts,
    `lower_bound_s`) and returns the fastest one's `Traced`."""
    method = step.method
    counts = ladder(_batch_size(step, dynamic, positions, in_tree))
    results: dict[int, tuple[Any, Any, Plan]] = {}
    tries: list[Try] = []
    tables: dict[int, StageCostTable] = {}
    bounds: dict[tuple[int, tuple[int, ...]], float | None] = {}

    def evaluate(count: int) -> float | None:
        t0 = time.perf_counter()
        if step.progress:
            step.progress(f"micro-batch count {count} ({len(tries) + 1} tried so far)")
        method_b = dataclasses.replace(method, num_micro_batches=count)
        trace_s = None
        try:
            traced, split, fp = step._trace_for(dynamic, static, positions, in_tree, count,
                                                method.pipelined, cluster)
            trace_s = time.perf_counter() - t0
            with pipeline_search.recording():
                plan = step._search_cached(method_b, traced, split, fp, cluster, device_ids)
        except (MemoryBudgetError, NoStageLayoutError, MicroBatchError) as err:
            # no layout fits (memory), or the batch does not split: this count is out
            tries.append(Try(count, None, time.perf_counter() - t0,
                             error=" ".join(str(err).split())[:200], trace_s=trace_s))
            return None
        if "stage_costs" in plan.solver:
            tables[count] = StageCostTable.from_json(plan.solver["stage_costs"])
            plan = dataclasses.replace(plan, solver={
                k: v for k, v in plan.solver.items() if k != "stage_costs"})
        results[count] = (traced, split, plan)
        cached = bool(plan.solver.get("plan_cache", {}).get("hit"))
        tries.append(Try(count, plan.predicted.step_s, time.perf_counter() - t0,
                         cached=cached, trace_s=trace_s))
        if step.progress:
            best = min(t.step_s for t in tries if t.step_s is not None)
            step.progress(f"micro-batch count {count}: {plan.predicted.step_s * 1e3:.3f} ms "
                          f"per step (best so far {best * 1e3:.3f} ms)")
        return plan.predicted.step_s

    def bound(count: int) -> float | None:
        key = (count, tuple(sorted(b for b in tables if b <= count)))
        if key not in bounds:
            bounds[key] = lower_bound_s(list(tables.values()), count)
        return bounds[key]

    k = bounded(counts, evaluate, bound)
    if k is None:
        detail = "; ".join(f"B={t.num_micro_batches}: {t.error}" for t in tries)
        raise ValueError(f"num_micro_batches='auto': no micro-batch count in {counts} gives a "
                         f"plan that fits ({detail})")
    traced, split, plan = results[counts[k]]
    tried = {t.num_micro_batches for t in tries}
    pruned = [{"num_micro_batches": c, "bound_s": bound(c)} for c in counts
              if c not in tried and bound(c) is not None and bound(c) >= plan.predicted.step_s]
    plan = dataclasses.replace(plan, solver={
        **plan.solver, "micro_batch_tries": [t.to_json() for t in tries],
        "micro_batch_bounded": pruned, "micro_batch_candidates": counts})
    return Traced(traced.program, plan, split, traced.out_tree, in_tree, traced.args_info,
                  _trace=traced, _positions=positions, _trace_static=static, _step=step)


def _batch_size(step: ParallelizedFunction, dynamic: list, positions: list[int],
                in_tree) -> int:
    """The rows every batch leaf has (their greatest common divisor: any micro-batch count
    must divide each)."""
    leaves = jax.tree_util.tree_leaves(dynamic)
    leaf_pos = leaf_positions(in_tree, positions)
    sizes = [jax.numpy.shape(x)[0] for x, p in zip(leaves, leaf_pos)
             if p in step.batch_argnums and jax.numpy.shape(x)]
    if not sizes:
        raise ValueError(f"num_micro_batches='auto' needs batch arguments: none of "
                         f"batch_argnums={step.batch_argnums} holds an array")
    return math.gcd(*sizes)
