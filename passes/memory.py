"""Per-device memory of the program XLA builds from a laid-out jaxpr (DESIGN §4, §6).

The intra-op pass predicts what ``compiled.memory_analysis()`` reports for the emitted
step: ``argument + output − alias + temp`` bytes per device.  The terms, as XLA's buffer
assignment has them:

* **arguments**: every input at its layout, live for the whole step (the caller owns the
  buffers; a donated one is reused for the output tied to it).
* **outputs**: every output at its layout; an output tied to a donated input (new params /
  optimizer state) is written into that input's buffer (**alias**) and adds nothing.
* **temp**: the peak, over the program order, of the intermediate buffers live at once:
  - a value gets a buffer only if XLA materializes it: elementwise / layout-only producers
    whose consumers all fuse them (loop and input fusion) have none (`fused`), and their
    operands stay live until the fusion runs (`BufferInfo.end`);
  - a partial-sum result (a strategy that all-reduces or reduce-scatters) has a second
    buffer for the unreduced sum; reductions that nothing on the critical path waits for
    (parameter gradients) are combined by XLA in buckets of up to `COMBINE_BYTES`, and a
    bucket's unreduced sums stay live until its last member is computed;
  - a reshard that gathers or moves data (all-gather, all-to-all) makes a copy of the
    operand in the consumer's layout, shared by every consumer that needs that layout
    (XLA's CSE), live from the first of them to the last; slicing to a finer layout is
    fused into the consumer.
  Values computed from constants only are folded into constants by XLA (no temp).

Time is the jaxpr's equation order: XLA's scheduler reorders little for a training step
(forward, backward, update), and where it does it lowers the peak, so the figure is an
upper estimate of the schedule XLA picks.  `analyze(graph)` is the layout-independent part
(fusion, liveness, combinable reductions); `estimate(...)` prices one layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import numpy as np

from autopar.passes.ir import Graph

from . import primitives
from .sharding_spec import COMBINE_BYTES


def _expensive(graph: Graph, e) -> bool:
    """Whether XLA keeps `e` rather than recompute it in several fusions.  A division by a
    broadcast non-scalar (softmax's normalization) is rewritten by XLA's algebraic
    simplifier into a multiplication by the reciprocal of the smaller operand: cheap."""
    if e.name != "div":
        return primitives.info(e.name).expensive
    divisor = e.inputs[1] if len(e.inputs) > 1 else None
    if isinstance(divisor, int) and graph.values[divisor].producer is not None:
        src = graph.eqns[graph.values[divisor].producer]
        if src.name == "broadcast_in_dim" and isinstance(src.inputs[0], int) \
                and graph.values[src.inputs[0]].ndim > 0:
            return False
    return True


@dataclasses.dataclass(frozen=True, eq=False)
class BufferInfo:
    """Layout-independent facts about a program's buffers.

    Attributes:
      materialized: bool [num_values]: the value gets a buffer (not fused, not a constant,
        not folded from constants).
      start / end: int64 [num_values]: the buffer's live interval [start, end) in equation
        order (inputs from 0, outputs to `horizon`); `end` is when the last fusion reading
        the value runs.
      horizon: one past the last time step.
      urgent: bool [num_values]: something on the critical path (a matmul, a gather, a
        loop, ...) reads the value, so a reduction of it cannot be deferred and combined.
      is_output: bool [num_values]: the value is a program output.
      runs_at: int64 [num_eqns]: the latest time each equation's work runs (a fused
        equation runs inside its consumers' fusions).
      inplace: value id → the buffers a loop fusion producing it reads (its operands through
        fused producers); XLA may write the result over one that dies there.
      readers: value id → (equation, time) of every read of its buffer.
      eqn_bytes: float64 [num_eqns]: bytes each equation reads and writes in memory once
        fused: the buffers it reads (not the values it recomputes) and the buffers it
        writes (a fused output is never written).
      broadcasts: (value, like, start, end) per implicit broadcast XLA:CPU materializes
        (`analyze(cpu=True)`): `value` broadcast to the shape of value `like` (whose
        layout it has), live [start, end).
      expansions: (equation, value, factor) per equation that XLA rewrites into several
        with buffers of their own (`EXPANDED`): while it runs, `factor` x the bytes per
        device of `value` more are live.
    """

    materialized: np.ndarray
    start: np.ndarray
    end: np.ndarray
    horizon: int
    urgent: np.ndarray
    is_output: np.ndarray
    runs_at: np.ndarray
    inplace: dict
    readers: dict
    eqn_bytes: np.ndarray
    broadcasts: tuple[tuple[int, int, int, int], ...] = ()
    expansions: tuple[tuple[int, int, float], ...] = ()


def _select_and_scatter(graph: Graph, e) -> tuple[int, float] | None:
    """XLA's SelectAndScatterExpander (XLA:CPU and XLA:GPU both run it) rewrites a
    select-and-scatter (max pooling's backward) into a reduce-window over the padded
    operand and one s32 iota of its indices per dimension, returning the selected value
    and its indices per window, and a scatter of the source at those indices.  Live while
    it runs: the padded operand and its iotas, and the reduce-window's results (source
    sized).  wrn-250m on one device, micro-batch 384: five 2.9 GiB buffers at the stem's
    backward.  (operand value, factor on its bytes)."""
    source, operand = e.inputs[:2]
    if not isinstance(operand, int) or not isinstance(source, int):
        return None
    v, src = graph.values[operand], graph.values[source]
    if v.size == 0:
        return None
    padded = math.prod(n + lo + hi for n, (lo, hi) in zip(v.shape, e.params["padding"]))
    per_elem = 1.0 + v.ndim * 4.0 / max(v.nbytes / v.size, 1.0)  # value + s32 indices
    return operand, per_elem * (padded + src.size) / v.size


# Equations XLA expands into several with buffers of their own: name -> (graph, eqn) ->
# (value, factor) such that factor x that value's bytes per device are live while it runs.
EXPANDED: dict[str, Callable] = {"select_and_scatter_add": _select_and_scatter}


def analyze(graph: Graph, *, cpu: bool = False,
            awaited: Collection[int] = ()) -> BufferInfo:
    """Fusion, liveness and urgency of every value of `graph` (see the module docstring).

    awaited: output value ids that work outside the program waits for as soon as they are
    made (a pipeline layer's activations for the next layer, its input cotangents for the
    layer before): urgent like a value a matmul reads, so their reductions are not
    deferred into a combined bucket.

    A fusible equation (elementwise, layout change) is recomputed inside every consumer
    that can fuse it.  If all its consumers can, it has no buffer; if some cannot (a matmul,
    a gather, ...), it is materialized for those only, and its operands stay live until the
    fusing consumers have run too.  An expensive one (exp, log, tanh, ...) read by several
    consumers is not recomputed: it keeps its buffer until its last use.

    cpu: XLA:CPU's reduction fusions (YNNPACK) take one elementwise producer into the
    reduce kernel and read that producer's operands as buffers, so e.g. LayerNorm's
    broadcast scale, which its backward's `reduce_sum(mul(g, broadcast(scale)))` reads,
    is materialized and lives from the forward to the backward (GPU XLA recomputes it).
    """
    n_vals, n_eqns = len(graph.values), len(graph.eqns)
    into_reduce = np.zeros(n_eqns, bool)  # XLA:CPU: reads its operands as buffers
    if cpu:
        for e in graph.eqns:
            users = graph.consumers[e.outputs[0]] if len(e.outputs) == 1 else ()
            into_reduce[e.index] = (primitives.info(e.name).fusible and bool(users) and all(
                primitives.info(graph.eqns[u].name).fusion_reduce for u in users))
    horizon = n_eqns + 1
    is_output = np.zeros(n_vals, bool)
    for op in graph.outvars:
        if isinstance(op, int):
            is_output[op] = True
    folded = _folded(graph)
    mode = _fusion_modes(graph, is_output, folded, into_reduce)

    def recomputes(vid: int, user: int) -> bool:
        # Where the value has a buffer anyway, a reduction reads it (input fusion reads
        # materialized operands); loop fusions recompute it.
        m = mode.get(vid)
        if into_reduce[user]:
            return False
        return m == "fused" or (m == "split" and primitives.info(graph.eqns[user].name).fusible)

    # last[e]: the latest time equation e's computation runs (in its own position, or
    # inside the fusions that recompute it).
    last = np.arange(n_eqns, dtype=np.int64)
    earliest = np.arange(n_eqns, dtype=np.int64)  # the first time it runs
    for e in reversed(graph.eqns):
        if len(e.outputs) != 1 or e.outputs[0] not in mode:
            continue
        out = e.outputs[0]
        inside = [u for u in graph.consumers[out] if recomputes(out, u)]
        own = [e.index] if mode[out] == "split" else []
        last[e.index] = max([int(last[u]) for u in inside] + own)
        earliest[e.index] = min([int(earliest[u]) for u in inside] + own)
    start = np.zeros(n_vals, np.int64)
    end = np.zeros(n_vals, np.int64)
    readers: dict[int, tuple[tuple[int, int], ...]] = {}
    for v in graph.values:
        s = 0 if v.producer is None else v.producer
        # A consumer recomputed inside later fusions reads the buffer when they run.
        reads = tuple((u, int(last[u])) for u in graph.consumers[v.id]
                      if not recomputes(v.id, u))
        readers[v.id] = reads
        start[v.id] = s
        if is_output[v.id] or v.producer is None:
            end[v.id] = horizon
        else:
            end[v.id] = max((t for _, t in reads), default=s) + 1
    _start_indexed_from_inputs(graph, start)
    fused = np.array([mode.get(v, "") == "fused" for v in range(n_vals)], bool)
    materialized = ~fused & ~folded
    eqn_bytes = np.zeros(n_eqns)
    for v in graph.values:
        if not materialized[v.id] and v.const_index is None:
            continue
        for u, _ in readers[v.id]:
            eqn_bytes[u] += v.nbytes
        if v.producer is not None and materialized[v.id]:
            eqn_bytes[v.producer] += v.nbytes
    expansions = []
    for e in graph.eqns:
        found = EXPANDED[e.name](graph, e) if e.name in EXPANDED else None
        if found is not None:
            expansions.append((e.index, *found))
    return BufferInfo(materialized, start, end, horizon, _urgent(graph, awaited), is_output,
                      last, _inplace(graph, mode, materialized), readers, eqn_bytes,
                      _cpu_broadcasts(graph, into_reduce, earliest, last), tuple(expansions))


def _folded(graph: Graph) -> np.ndarray:
    """Per value: a constant, or computed from constants only (no random draws)."""
    folded = np.zeros(len(graph.values), bool)
    for v in graph.values:
        if v.const_index is not None:
            folded[v.id] = True
    for e in graph.eqns:
        ops = [op for op in e.inputs if isinstance(op, int)]
        if all(folded[op] for op in ops) and not primitives.info(e.name).random:
            folded[list(e.outputs)] = True
    return folded


def _fusion_modes(graph: Graph, is_output: np.ndarray, folded: np.ndarray,
                  into_reduce: np.ndarray) -> dict[int, str]:
    """Per fusible equation output: "fused" (every reader recomputes it) or "split" (some
    readers recompute it, the others read its buffer); absent: every reader reads its
    buffer."""
    mode: dict[int, str] = {}
    for e in graph.eqns:
        if not primitives.info(e.name).fusible or len(e.outputs) != 1:
            continue
        out = e.outputs[0]
        users = graph.consumers[out]
        if is_output[out] or not users or folded[out]:
            continue
        if _expensive(graph, e) and len(users) > 1:
            continue
        fusing = [u for u in users
                  if primitives.info(graph.eqns[u].name).reads_fused and not into_reduce[u]]
        if len(fusing) == len(users):
            mode[out] = "fused"
        elif any(primitives.info(graph.eqns[u].name).fusible for u in fusing):
            mode[out] = "split"
    return mode


def _start_indexed_from_inputs(graph: Graph, start: np.ndarray) -> None:
    """A gather / scatter that reads only the step's inputs (embedding lookups, one-hot
    labels) is scheduled at the start by XLA: its buffer lives from then on (`start` set
    to 0 in place)."""
    from_inputs = np.zeros(len(graph.values), bool)
    for v in graph.values:
        if v.producer is None:
            from_inputs[v.id] = True
    for e in graph.eqns:
        if all(from_inputs[op] for op in e.inputs if isinstance(op, int)):
            from_inputs[list(e.outputs)] = True
            if primitives.info(e.name).indexed:
                start[list(e.outputs)] = 0


def _urgent(graph: Graph, awaited: Collection[int] = ()) -> np.ndarray:
    """Per value: read, directly or through other values, by a critical equation or awaited
    outside the program (`analyze`)."""
    urgent = np.zeros(len(graph.values), bool)
    urgent[list(awaited)] = True
    for e in reversed(graph.eqns):
        hot = primitives.info(e.name).critical or any(urgent[o] for o in e.outputs)
        if hot:
            for op in e.inputs:
                if isinstance(op, int):
                    urgent[op] = True
    return urgent


def _inplace(graph: Graph, mode: Mapping[int, str],
             materialized: np.ndarray) -> dict[int, tuple[int, ...]]:
    """Per materialized fusible output: the materialized computed values its fusion reads
    (through the fused values it recomputes), whose buffers it may reuse."""
    inplace: dict[int, tuple[int, ...]] = {}
    for e in graph.eqns:
        if not primitives.info(e.name).fusible or len(e.outputs) != 1:
            continue
        out = e.outputs[0]
        if not materialized[out]:
            continue
        found, stack, seen = [], [e], set()
        while stack:
            q = stack.pop()
            for op in q.inputs:
                if not isinstance(op, int) or op in seen:
                    continue
                seen.add(op)
                if op in mode:
                    stack.append(graph.eqns[graph.values[op].producer])
                elif materialized[op] and graph.values[op].producer is not None:
                    found.append(op)
        inplace[out] = tuple(found)
    return inplace


def _cpu_broadcasts(graph: Graph, into_reduce: np.ndarray, earliest: np.ndarray,
                    runs_at: np.ndarray) -> tuple[tuple[int, int, int, int], ...]:
    """The implicit broadcasts (lax broadcasts size-1 dims of an elementwise operand) that
    an XLA:CPU reduction fusion reads as buffers.  XLA makes one broadcast instruction per
    (operand, shape) for the whole step (CSE), so the buffer lives from the first
    equation anywhere that broadcasts that operand to that shape (LayerNorm's forward) to
    the last reduction fusion reading it (its backward)."""
    if not into_reduce.any():
        return ()
    first: dict[tuple[int, tuple], int] = {}
    last_read: dict[tuple[int, tuple], tuple[int, int]] = {}
    for e in graph.eqns:
        if not primitives.info(e.name).fusible or len(e.outputs) != 1:
            continue
        shape = graph.values[e.outputs[0]].shape
        for op in e.inputs:
            if not isinstance(op, int):
                continue
            v = graph.values[op]
            if v.ndim != len(shape) or v.shape == shape or v.size == 0:
                continue
            key, t = (op, shape), int(runs_at[e.index])
            first[key] = min(first.get(key, t), int(earliest[e.index]))
            if into_reduce[e.index] and t >= last_read.get(key, (-1, 0))[0]:
                last_read[key] = (t, e.outputs[0])
    return tuple((op, like, first[(op, shape)], t + 1)
                 for (op, shape), (t, like) in last_read.items())


@dataclasses.dataclass(frozen=True)
class Reshard:
    """Equation `eqn` reads `value` in another layout (`target`) than its own.

    A gathering reshard (all-gather, all-to-all) makes a copy of `nbytes` per device just
    before the reader, at `time`.  A `slice` (a finer layout of the same splits) is computed
    once, right after the value (XLA's scheduler frees the whole value early that way): the
    copy lives from the value's production to its last sliced reader, and those readers no
    longer keep the value itself live.  `until`: the copy of an output into its tied input's
    layout is kept to the end of the step (XLA copies it into the donated buffer after the
    step's last read of that buffer).  `gathered`: bytes per device of a larger copy the
    move passes through (the gathered layout of `gather_first`, which the partitioner
    slices down to `target` at once): it exists for one step, at the first read of the
    (value, target) copy, while the `nbytes` copy is what stays live until the last read.
    """

    value: int
    target: object
    nbytes: float
    time: int
    eqn: int = -1
    slice: bool = False
    until: int | None = None
    gathered: float = 0.0


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Predicted ``memory_analysis()`` of a laid-out program, bytes per device.

    Attributes:
      peak_bytes: argument + output − alias + temp.
      argument_bytes / output_bytes / alias_bytes / temp_bytes: the four terms.
      peak_time: the equation index where the temp peak is reached.
      at_peak: the largest contributions to the temp peak, (label, bytes), largest first.
    """

    peak_bytes: float
    argument_bytes: float
    output_bytes: float
    alias_bytes: float
    temp_bytes: float
    peak_time: int
    at_peak: tuple[tuple[str, float], ...] = ()

    def to_json(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "argument_bytes": self.argument_bytes,
                "output_bytes": self.output_bytes, "alias_bytes": self.alias_bytes,
                "temp_bytes": self.temp_bytes, "peak_time": self.peak_time,
                "at_peak": [list(x) for x in self.at_peak]}


def estimate(graph: Graph, info: BufferInfo, value_bytes: Callable[[int], float], *,
             aliased: Iterable[int] = (),
             partial: Mapping[int, float] | None = None,
             reshards: Sequence[Reshard] = (),
             scatter_as_all_reduce: bool = False,
             top: int = 12) -> MemoryEstimate:
    """The peak of one layout.

    Args:
      graph / info: the program and `analyze(graph)`.
      value_bytes: bytes per device of a value at its layout.
      aliased: output values written into a donated input's buffer.
      partial: value id → bytes per device of its unreduced partial sum (the value is the
        result of an all-reduce / reduce-scatter of that buffer).
      reshards: consumer-side copies (`Reshard`); copies of one (value, target) are shared.
      scatter_as_all_reduce: the backend lowers a reduce-scatter to an all-reduce and a
        slice (XLA:CPU): the unscattered buffer exists for one step, until the fusions
        that slice it, scheduled right after the reduction, have run.
      top: how many contributions to report in `MemoryEstimate.at_peak`.
    """
    aliased = set(aliased)
    args = sum(value_bytes(v) for v in graph.invars)
    outs = alias = 0.0
    for op in graph.outvars:
        if isinstance(op, int):
            outs += value_bytes(op)
            if op in aliased:
                alias += value_bytes(op)
    events = temp_buffers(graph, info, value_bytes, aliased=aliased, partial=partial,
                          reshards=reshards, scatter_as_all_reduce=scatter_as_all_reduce)
    temp, t_peak = 0.0, 0
    if events:
        live = usage_profile(events, info.horizon)
        t_peak = int(np.argmax(live))
        temp = float(live[t_peak])
    at_peak = sorted(((lab, b) for s, e, b, lab in events if s <= t_peak < e),
                     key=lambda x: -x[1])[:top]
    return MemoryEstimate(args + outs - alias + temp, float(args), float(outs), float(alias),
                          temp, t_peak, tuple(at_peak))


def usage_profile(events: Sequence[tuple[int, int, float, str]], horizon: int) -> np.ndarray:
    """Bytes live at every time step [0, horizon] of `temp_buffers`' events."""
    usage = np.zeros(horizon + 2)
    for s, e, nbytes, _ in events:
        usage[s] += nbytes
        usage[min(e, horizon + 1)] -= nbytes
    return np.cumsum(usage)[:horizon + 1]


def temp_buffers(graph: Graph, info: BufferInfo, value_bytes: Callable[[int], float], *,
                 aliased: Iterable[int] = (),
                 partial: Mapping[int, float] | None = None,
                 reshards: Sequence[Reshard] = (),
                 scatter_as_all_reduce: bool = False) -> list[tuple[int, int, float, str]]:
    """(start, end, bytes per device, label) of every temporary buffer of one layout
    (arguments and outputs excluded); arguments as in `estimate`."""
    aliased = set(aliased)
    partial = dict(partial or {})
    events: list[tuple[int, int, float, str]] = []
    reduced_at = {}
    for vid, s0, t_reduce, nbytes in combined_partials(info, partial):
        events.append((s0, t_reduce + 1, nbytes, f"partial v{vid}"))
        reduced_at[vid] = t_reduce
    sliced: dict[int, set[int]] = {}
    for r in reshards:
        if r.slice:
            sliced.setdefault(r.value, set()).add(r.eqn)
    end_of = {}
    for vid, eqns in sliced.items():
        if info.is_output[vid] or graph.values[vid].producer is None:
            continue
        rest = [t for e, t in info.readers[vid] if e not in eqns]
        end_of[vid] = max(rest, default=int(info.start[vid])) + 1
    ends = _shared_ends(graph, info, value_bytes, aliased, end_of)
    for v in graph.values:
        vid = v.id
        if v.producer is None or info.is_output[vid] or not info.materialized[vid]:
            continue
        s, e = reduced_at.get(vid, int(info.start[vid])), ends.get(vid, int(info.end[vid]))
        nbytes = value_bytes(vid)
        if scatter_as_all_reduce and partial.get(vid, 0.0) > nbytes:
            # The all-reduced buffer lives one step: the fusions that slice it run at once.
            events.append((s, s + 1, partial[vid] - nbytes, f"all-reduced v{vid}"))
        events.append((s, max(e, s + 1), nbytes, f"v{vid} {v.shape}"))
    for vid, like, s, e in info.broadcasts:
        events.append((s, e, value_bytes(like), f"broadcast v{vid} {graph.values[like].shape}"))
    for k, vid, factor in info.expansions:
        t = int(info.runs_at[k])
        events.append((t, t + 1, factor * value_bytes(vid), f"{graph.eqns[k].name} v{vid}"))
    # One copy per (value, layout), shared by its readers (XLA's CSE): a gathering copy is
    # made before the first of them, a slice right after the value.
    # A move through a gathered layout adds that layout's copy for one step at the first
    # read (the partitioner gathers, slices to the target, and frees the gathered copy).
    copies: dict[tuple[int, object], list] = {}
    for r in reshards:
        if r.nbytes <= 0:
            continue
        key = (r.value, r.target)
        start = int(info.start[r.value]) if r.slice else r.time
        end = r.time + 1 if r.until is None else r.until
        if key in copies:
            c = copies[key]
            if start < c[0]:
                c[0], c[3] = start, r.gathered
            c[1] = max(c[1], end)
        else:
            copies[key] = [start, end, r.nbytes, r.gathered]
    for (vid, _), (s, e, nbytes, gathered) in copies.items():
        events.append((s, e, nbytes, f"reshard v{vid}"))
        if gathered > nbytes:
            events.append((s, s + 1, gathered - nbytes, f"gathered v{vid}"))
    return events


def _shared_ends(graph: Graph, info: BufferInfo, value_bytes: Callable[[int], float],
                 aliased: set[int], end_of: dict[int, int]) -> dict[int, int]:
    """Buffers a loop fusion overwrites in place: value → its shortened end.

    When a fusion's result has the size of a buffer it reads for the last time, XLA's buffer
    assignment gives the result that buffer (`CanShareOperandBufferWithUser`); the operand
    then ends where the result starts instead of overlapping it for one step.
    """
    ends: dict[int, int] = dict(end_of)
    taken: set[int] = set()
    for out, reads in info.inplace.items():
        if info.is_output[out] and out not in aliased:
            continue
        t = int(info.start[out])
        size = value_bytes(out)
        for u in reads:
            if u in taken or ends.get(u, int(info.end[u])) != t + 1 or info.is_output[u]:
                continue
            if value_bytes(u) == size:
                ends[u] = t
                taken.add(u)
                break
    return ends


def combined_partials(info: BufferInfo, partial: Mapping[int, float]
                      ) -> list[tuple[int, int, int, float]]:
    """(value, produced at, reduced at, bytes) of every unreduced partial-sum buffer.

    An urgent reduction runs where its producer does.  The others are combined in
    production order into buckets of up to `COMBINE_BYTES` (XLA's all-reduce combiner); a
    bucket runs when its last member is produced, so each member's partial lives until then
    and its reduced buffer exists from then on.
    """
    out: list[tuple[int, int, int, float]] = []
    lazy = []
    for vid, nbytes in partial.items():
        s = int(info.start[vid])
        if info.urgent[vid]:
            out.append((vid, s, s, nbytes))
        else:
            lazy.append((s, vid, nbytes))
    lazy.sort()
    bucket: list[tuple[int, int, float]] = []
    size = 0.0

    def flush() -> None:
        if bucket:
            t = max(s for s, _, _ in bucket)
            out.extend((vid, s, t, b) for s, vid, b in bucket)
            bucket.clear()

    for s, vid, nbytes in lazy:
        if bucket and size + nbytes > COMBINE_BYTES:
            flush()
            size = 0.0
        bucket.append((s, vid, nbytes))
        size += nbytes
    flush()
    return out
