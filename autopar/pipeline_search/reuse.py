"""One solve for identical work in the pipeline search: the key of a layer range's
program up to value ids (`_program_key`: identical layers share one solution), one solver
run for identical ILPs submitted at once (`_SameProblems`), and the layer ranges of a
sub-mesh priced side by side (`_price_side_by_side`)."""

from __future__ import annotations

import concurrent.futures
import contextvars
import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from autopar import pipeline
from autopar.graph import Graph


class _SameProblems:
    """A `submit` that hands each distinct sharding problem to `submit` once: a problem
    equal to one already handed over, number for number (costs, memory usages, liveness,
    edges, usage limit) and with the same solver and time limit, gets that one's future.

    Layer ILPs repeat: on a sub-mesh whose axes split no more of a layer than a smaller
    one's (GPT-39B at 1,024 micro-batches: its layers on (3, 8), (5, 8), (6, 8) and (7, 8)
    pose the problems they pose on (1, 1) or (1, 8)), and neighbour re-solves whose sides
    differ but charge the same seconds for every layout.  GPT-39B on 8x8xV100-16GB at 1,024
    micro-batches: 127 of 289 problems repeat one before them.  Any choice costs the same in
    equal problems, so one answer serves all of them."""

    def __init__(self, submit: Callable[..., Any]):
        self._submit = submit
        self._futures: dict[tuple, Any] = {}
        self._lock = threading.Lock()   # the sub-meshes are priced side by side
        self.shared = 0

    def __call__(self, problem, *, time_limit_s: float, backend: str, **options):
        key = (_problem_digest(problem), float(time_limit_s), backend,
               tuple(sorted(options.items())))
        with self._lock:
            future = self._futures.get(key)
            if future is None:
                future = self._futures[key] = self._submit(
                    problem, time_limit_s=time_limit_s, backend=backend, **options)
            else:
                self.shared += 1
        return future


def _problem_digest(problem) -> bytes:
    """A digest of everything a solver reads from a `ShardingProblem` (not its names)."""
    h = hashlib.blake2b(digest_size=20)
    for arrays in (problem.node_costs, problem.node_usages, problem.edge_costs):
        h.update(len(arrays).to_bytes(8, "little"))
        for a in arrays:
            a = np.ascontiguousarray(a)
            h.update(repr((a.dtype.str, a.shape)).encode())
            h.update(a.tobytes())
    for a in (problem.intervals, problem.edges):
        a = np.ascontiguousarray(a)
        h.update(repr((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    h.update(repr(problem.usage_limit).encode())
    return h.digest()


def _price_side_by_side(range_cost: Callable[[int, int, tuple[int, int]], Any],
                        submeshes: Sequence[tuple[int, int]],
                        asked: Sequence[tuple[int, int, int]]) -> None:
    """Calls `range_cost(i, j, submesh)` for the `asked` triples (`inter_op.asked`: the
    stage DP's), one thread per sub-mesh, each in the DP's order.

    A range's cost waits on its layers' neighbour re-solves (`search`'s `aligned`), one at
    a time along a chain; the chains of different sub-meshes share no state but the solve
    pool, so pricing the sub-meshes side by side keeps the pool's workers busy where the
    DP's own order (every sub-mesh of one range, then the next range) waited on one solve
    at a time.  The DP then reads the memoized costs."""
    per: dict[int, list[tuple[int, int]]] = {}
    for i, j, s in asked:
        per.setdefault(s, []).append((i, j))

    def price(s: int) -> None:
        for i, j in per[s]:
            range_cost(i, j, submeshes[s])

    # Each thread runs in a copy of the caller's context: the fallbacks a layer build
    # reports (`passes.fallbacks.collecting`) reach the caller's collection.
    with concurrent.futures.ThreadPoolExecutor(max(1, len(per))) as threads:
        for f in [threads.submit(contextvars.copy_context().run, price, s) for s in per]:
            f.result()


def _program_key(graph: Graph, prog: pipeline.StageProgram, diff: set[int]) -> str:
    """Identity of a layer for caching: its equations' text with value ids renumbered, the
    renumbered input at each input position, and which inputs carry gradients.

    A solution is stored by input position (`prog.inputs`) and applied to every layer with
    the same key, so the key holds which value each position is.  Inputs are listed in the
    order the equations first read them (`pipeline.program_for_range`), so layers computing
    the same equations match whatever the ids of their inputs (parameters are numbered in
    name order, Block_10 before Block_7)."""
    ren: dict[int, int] = {}

    def name(v):
        return f"v{ren.setdefault(v, len(ren))}" if isinstance(v, int) else repr(v.value)

    lines = []
    for i in prog.eqns:
        e = graph.eqns[i]
        ins = [name(op) if isinstance(op, int) else repr(op.value) for op in e.inputs]
        outs = [f"{name(o)}:{graph.values[o].shape}" for o in e.outputs]
        lines.append(f"{outs}={e.name}{sorted(e.params.items())!r}{ins}")
    lines.append(str([name(o) for o in prog.outputs]))
    lines.append(str([name(v) for v in prog.inputs]))
    lines.append(str([v in diff for v in prog.inputs]))
    return "\n".join(lines)
