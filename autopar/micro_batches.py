"""`num_micro_batches="auto"`: the pipeline search tries micro-batch counts and keeps the
fastest predicted plan that fits memory.

The step is traced at micro-batch size, so every count B is its own traced program and its
own search (each through the plan cache).  The counts tried are a ladder of divisors of the
batch (`ladder`: 1, 2, 4, ... — every divisor at least twice the previous one, and the
batch itself), all of them for a short ladder, else explored by hill climbing from the
middle of the ladder (`explore`):

- memory: a count whose search finds no layout that fits (bigger micro-batches need more
  activation memory) rules out every smaller count too;
- bubble and per-micro-batch overheads: the predicted step time Σ t_i + (B − 1)·max t_i
  falls with B while the pipeline bubble shrinks and rises once per-micro-batch costs
  (latencies, small kernels) dominate, so the search walks downhill from the start and
  stops in a direction at the first count that is slower than its neighbour, after looking
  one count further towards more micro-batches (memory: below);
- two valleys: one stage with no bubble is fastest with few micro-batches, a pipeline with
  many, and the climb from the middle finds one of them.  A second climb starts from the
  fewest micro-batches that fit (wrn-6.8b on 32 H100s: the first stopped at 128
  micro-batches and 7.967 s, one stage with 2 runs in 7.947 s).

The chosen plan records every try in `Plan.solver["micro_batch_tries"]` (count, predicted
step seconds or why it failed, search seconds); `autopar.report` shows them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from autopar.cost_model import ClusterSpec

from .microbatch import MicroBatchError
from .passes.inter_op import NoStageLayoutError
from .passes.intra_op import MemoryBudgetError
from .plan import Plan

if TYPE_CHECKING:
    from .api import ParallelizedFunction, Traced


@dataclasses.dataclass(frozen=True)
class Try:
    """One micro-batch count tried: its plan's predicted step seconds (None: no plan fits,
    `error` says why) and the seconds its trace + search (or cache lookup) took."""

    num_micro_batches: int
    step_s: float | None
    search_s: float
    error: str = ""
    cached: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_micro_batches": self.num_micro_batches,
                               "step_s": self.step_s, "search_s": round(self.search_s, 3)}
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


# Ladders this short are tried whole (small batches: each search is short, and the step time
# need not be unimodal there: one stage without a bubble can beat every pipeline).
EXHAUSTIVE_MAX = 6


def explore(counts: Sequence[int], evaluate: Callable[[int], float | None],
            start: int | None = None) -> int | None:
    """Index into `counts` of the fastest count found: every count of a ladder of at most
    `EXHAUSTIVE_MAX`, else steepest-descent hill climbing from `start` (default: the
    middle; both neighbours of each count are priced), and again from the fewest
    micro-batches that fit;
    `evaluate(count)` gives predicted seconds or None (no layout fits: every smaller count
    is then skipped).  Each count is evaluated at most once."""
    if not counts:
        return None
    seen: dict[int, float | None] = {}
    if len(counts) <= EXHAUSTIVE_MAX:
        for k in range(len(counts) - 1, -1, -1):  # most micro-batches (least memory) first
            seen[k] = evaluate(counts[k])
            if seen[k] is None:
                break  # bigger micro-batches need more memory still
        ok = [k for k, v in seen.items() if v is not None]
        return min(ok, key=lambda k: (seen[k], k)) if ok else None

    def value(k: int) -> float | None:
        if k not in seen:
            seen[k] = evaluate(counts[k])
        return seen[k]

    k = len(counts) // 2 if start is None else start
    while value(k) is None and k + 1 < len(counts):
        k += 1  # too big a micro-batch: go to smaller ones (more micro-batches)
    if value(k) is None:
        return None
    first = _climb(k, counts, value, seen)
    # The other valley: from the fewest micro-batches that fit.
    k = max((j for j, v in seen.items() if v is None), default=-1) + 1
    while value(k) is None:
        k += 1
    second = _climb(k, counts, value, seen)
    return min((first, second), key=lambda j: (seen[j], j))


def _climb(k: int, counts: Sequence[int], value: Callable[[int], float | None],
           seen: dict[int, float | None]) -> int:
    """Steepest descent over the ladder from index `k` (which fits); see `explore`."""
    floor = max((j for j, v in seen.items() if v is None), default=-1)
    while True:
        # Both neighbours, then the better: a count whose stages only fit memory-lean
        # (parameters cut finely, gathered every micro-batch) can beat its neighbour on one
        # side and be far slower than the other.
        best_j, best_v = k, value(k)
        for j in (k - 1, k + 1):
            if floor < j < len(counts):
                vj = value(j)
                if vj is None:
                    floor = max(floor, j)
                elif vj < best_v:
                    best_j, best_v = j, vj
        if best_j == k:
            # Memory makes the step time bumpy in the count: where a count's stages only
            # fit with memory-saving layouts (optimizer state split and gathered back over a
            # slow link, parameters cut finely), the next count up can be a little slower
            # and the one after it, whose smaller micro-batches fit without them, faster.
            # One more count up before stopping.
            j = k + 2
            if not (j < len(counts) and j not in seen and seen.get(k + 1) is not None):
                return k
            vj = value(j)
            if vj is None or vj >= best_v:
                return k
            best_j = j
        k = best_j


def search(step: ParallelizedFunction, dynamic: list, static: tuple, positions: list[int],
           in_tree, cluster: ClusterSpec, device_ids: list[int]) -> Traced:
    """`step._plan` for a method with `num_micro_batches="auto"`: traces and searches the
    counts `explore` visits and returns the fastest one's `Traced`."""
    from .api import Traced

    method = step.method
    counts = ladder(_batch_size(step, dynamic, positions, in_tree))
    results: dict[int, tuple[Any, Any, Plan]] = {}
    tries: list[Try] = []

    def evaluate(count: int) -> float | None:
        t0 = time.perf_counter()
        if step.progress:
            step.progress(f"micro-batch count {count} ({len(tries) + 1} tried so far)")
        method_b = dataclasses.replace(method, num_micro_batches=count)
        try:
            traced, split, fp = step._trace_for(dynamic, static, positions, in_tree, count,
                                                method.pipelined, cluster)
            plan = step._search_cached(method_b, traced, split, fp, cluster, device_ids)
        except (MemoryBudgetError, NoStageLayoutError, MicroBatchError) as err:
            # no layout fits (memory), or the batch does not split: this count is out
            tries.append(Try(count, None, time.perf_counter() - t0,
                             error=" ".join(str(err).split())[:200]))
            return None
        results[count] = (traced, split, plan)
        cached = bool(plan.solver.get("plan_cache", {}).get("hit"))
        tries.append(Try(count, plan.predicted.step_s, time.perf_counter() - t0,
                         cached=cached))
        if step.progress:
            best = min(t.step_s for t in tries if t.step_s is not None)
            step.progress(f"micro-batch count {count}: {plan.predicted.step_s * 1e3:.3f} ms "
                          f"per step (best so far {best * 1e3:.3f} ms)")
        return plan.predicted.step_s

    k = explore(counts, evaluate)
    if k is None:
        detail = "; ".join(f"B={t.num_micro_batches}: {t.error}" for t in tries)
        raise ValueError(f"num_micro_batches='auto': no micro-batch count in {counts} gives a "
                         f"plan that fits ({detail})")
    traced, split, plan = results[counts[k]]
    plan = dataclasses.replace(plan, solver={
        **plan.solver, "micro_batch_tries": [t.to_json() for t in tries],
        "micro_batch_candidates": counts})
    return Traced(traced.program, plan, split, traced.out_tree, in_tree, traced.args_info,
                  _trace=traced, _positions=positions, _trace_static=static, _step=step)


def _batch_size(step: ParallelizedFunction, dynamic: list, positions: list[int],
                in_tree) -> int:
    """The rows every batch leaf has (their greatest common divisor: any micro-batch count
    must divide each)."""
    import math

    from .api import _leaf_positions

    leaves = jax.tree_util.tree_leaves(dynamic)
    leaf_pos = _leaf_positions(in_tree, positions)
    sizes = [jax.numpy.shape(x)[0] for x, p in zip(leaves, leaf_pos)
             if p in step.batch_argnums and jax.numpy.shape(x)]
    if not sizes:
        raise ValueError(f"num_micro_batches='auto' needs batch arguments: none of "
                         f"batch_argnums={step.batch_argnums} holds an array")
    return math.gcd(*sizes)
