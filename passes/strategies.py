"""Sharding strategies per primitive: the rule table of the intra-op pass.

Adding a primitive means naming its rule family in its `passes.primitives` entry (`strategy`;
a new family goes into `_FAMILIES`), which `strategy_rules` reads.  A rule is one of:

- **follow**: the equation takes the layout of one operand (its "leader"); for each layout
  of the leader the rule gives the output specs, the specs the other operands must have,
  and any communication (e.g. an all-reduce when a reduced dim is split).  Followers are
  merged into their leader's ILP node (Alpa's "follow").
- **enumerate**: the rule lists whole strategies (output specs, required input specs,
  compute and communication seconds), e.g. the splits of a `dot_general`.

An unknown primitive gets the replicated strategy and one warning naming it.
Units: seconds for costs, bytes for sizes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Literal

from autopar.cost_model import compute
from autopar.graph import Eqn

from . import fallbacks, primitives
from .sharding_spec import MeshContext, Spec, enumerate_specs, replicated

log = logging.getLogger("autopar")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to run an equation on the mesh.

    Attributes:
      name: short description, e.g. "dot m@x n@y".
      out_specs: spec of every output.
      in_specs: spec every operand must arrive in (None: any, e.g. literals).
      compute_s: seconds of computation per device.
      comm_s: seconds of communication the strategy itself needs (partial-sum reductions).
      partial_bytes: bytes per device of the unreduced partial sum of output 0 that the
        strategy reduces (all-reduce / reduce-scatter), 0 if none (the memory model
        counts that buffer: passes/memory.py).
      partial_axes: the mesh axes of that reduction.
    """

    name: str
    out_specs: tuple[Spec, ...]
    in_specs: tuple[Spec | None, ...]
    compute_s: float
    comm_s: float
    partial_bytes: float = 0.0
    partial_axes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class EqnInfo:
    """An equation with the facts its rule needs.

    Attributes:
      eqn: the equation.
      in_shapes / out_shapes: operand and output shapes.
      in_nbytes / out_nbytes: whole (unsharded) bytes of operands and outputs.
      in_fixed: operands with no sharding decision of their own (literals, constants,
        values computed from constants only); they can be sliced to any layout for free.
      in_from_broadcast: operands produced by broadcast_in_dim (poor leaders).
      batch_size: leading size of the batch arguments, when known (for opaque nodes).
    """

    eqn: Eqn
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    in_nbytes: tuple[float, ...]
    out_nbytes: tuple[float, ...]
    in_fixed: tuple[bool, ...]
    in_from_broadcast: tuple[bool, ...]
    batch_size: int | None = None

    eqn_out_dtype: object = None
    # Bytes the equation moves to and from memory once XLA has fused it with its
    # neighbours (passes/memory.py); None: every operand and output (`eqn.bytes_accessed`).
    fused_bytes: float | None = None

    @property
    def params(self) -> dict:
        return self.eqn.params


@dataclasses.dataclass(frozen=True)
class FollowResult:
    out_specs: tuple[Spec, ...]
    in_specs: tuple[Spec | None, ...]
    comm_s: float


FollowFn = Callable[[EqnInfo, int, Spec, MeshContext], FollowResult]
EnumerateFn = Callable[[EqnInfo, MeshContext], list[Strategy]]
LeaderFn = Callable[[EqnInfo], "int | None"]


@dataclasses.dataclass(frozen=True)
class StrategyRule:
    kind: Literal["follow", "enumerate"]
    follow: FollowFn | None = None
    enumerate: EnumerateFn | None = None
    leader: LeaderFn | None = None


def compute_s(info: EqnInfo, shards: int, mesh: MeshContext) -> float:
    """Roofline seconds per device when the work is cut into `shards` pieces."""
    shards = max(shards, 1)
    nbytes = info.eqn.bytes_accessed if info.fused_bytes is None else info.fused_bytes
    return compute.compute_time_s(info.eqn.flops / shards, nbytes / shards,
                                  info.eqn_out_dtype, mesh.cluster)


def layout_compute_s(info: EqnInfo, shards: int, specs: Sequence[Spec],
                     mesh: MeshContext) -> float:
    """Roofline seconds per device of a strategy whose output and operands take `specs`
    (output first): the FLOPs cut `shards` ways, and each operand and output read or
    written at its own layout — a data-parallel matmul reads its whole (replicated)
    weight on every device, which `compute_s` (every byte cut `shards` ways) misses.
    Bytes fused away by XLA (`fused_bytes`) scale the total alike."""
    whole = info.eqn.bytes_accessed
    nbytes = sum(b / max(mesh.shards(spec), 1)
                 for b, spec in zip((info.out_nbytes[0],) + tuple(info.in_nbytes), specs))
    if info.fused_bytes is not None and whole > 0:
        nbytes *= info.fused_bytes / whole
    return compute.compute_time_s(info.eqn.flops / max(shards, 1), nbytes,
                                  info.eqn_out_dtype, mesh.cluster)


def replicated_strategy(info: EqnInfo, mesh: MeshContext, name: str = "replicated") -> Strategy:
    return Strategy(name, tuple(replicated(len(s)) for s in info.out_shapes),
                    tuple(replicated(len(s)) for s in info.in_shapes),
                    compute_s(info, 1, mesh), 0.0)


# ---- leaders ------------------------------------------------------------------------------


def largest_operand(info: EqnInfo) -> int | None:
    """The operand to follow: not fixed, then not a broadcast, then the most ranks, then
    the most dims the output has whole (not a size-1 dim the op stretches), then largest,
    then first.  Flax's LayerNorm `rsqrt(var) [B,S,1] * scale [1,1,D]` follows its rows
    however B·S compares with D: led by the scale, the output could never split the batch
    (a micro-batch of 8 rows of 4 tokens against D = 40 flipped it, and the plan gathered
    every micro-batch)."""
    best, key = None, None
    out = info.out_shapes[0] if info.out_shapes else ()
    for i, (shape, fixed) in enumerate(zip(info.in_shapes, info.in_fixed)):
        if fixed:
            continue
        whole = sum(1 for d, o in zip(shape, out) if d == o and d > 1) \
            if len(shape) == len(out) else 0
        k = (not info.in_from_broadcast[i], len(shape), whole, math.prod(shape), -i)
        if key is None or k > key:
            best, key = i, k
    return best


def first_operand(info: EqnInfo) -> int | None:
    return None if info.in_fixed[0] else 0


# ---- follow rules -------------------------------------------------------------------------


def _drop_axes(spec: Spec, dims: Sequence[int]) -> tuple[Spec, tuple[str, ...]]:
    """Unsplits `dims`; returns the new spec and the axes that were dropped."""
    dropped = tuple(a for d in dims for a in spec[d])
    return tuple(() if d in dims else axes for d, axes in enumerate(spec)), dropped


def _gather_cost(nbytes: float, spec: Spec, axes: Sequence[str], mesh: MeshContext) -> float:
    if not axes:
        return 0.0
    others = mesh.shards(spec) // mesh.dim_shards(axes)
    return mesh.all_gather_s(nbytes / max(others, 1), axes)


def _carry(spec: Spec, src: tuple[int, ...], dst: tuple[int, ...]) -> Spec:
    """`spec` of a value of shape `src` carried to an operand or result of shape `dst` of
    the same elementwise op: lax broadcasts size-1 dims implicitly ((256, 8) == (256, 1)),
    so dims of equal size keep their axes and the size-1 side of a broadcast is whole;
    other shapes (scalars) are replicated."""
    if dst == src:
        return spec
    if len(dst) != len(src) or any(a != b and 1 not in (a, b) for a, b in zip(src, dst)):
        return replicated(len(dst))
    return tuple(axes if a == b else () for axes, a, b in zip(spec, src, dst))


def _operand_specs(info: EqnInfo, spec: Spec, shape: tuple[int, ...]) -> tuple[Spec | None, ...]:
    return tuple(_carry(spec, shape, s) for s in info.in_shapes)


def follow_elementwise(info: EqnInfo, lead: int, spec: Spec, mesh: MeshContext) -> FollowResult:
    shape = info.in_shapes[lead]
    outs = tuple(_carry(spec, shape, s) for s in info.out_shapes)
    return FollowResult(outs, _operand_specs(info, spec, shape), 0.0)


def follow_unsplit(dims_of: Callable[[EqnInfo], Sequence[int]]) -> FollowFn:
    """Elementwise-shaped ops that need some dims whole (cumsum axis, sort dim, ...)."""

    def rule(info: EqnInfo, lead: int, spec: Spec, mesh: MeshContext) -> FollowResult:
        new, dropped = _drop_axes(spec, dims_of(info))
        cost = _gather_cost(info.in_nbytes[lead], spec, dropped, mesh)
        outs = []
        for s in info.out_shapes:
            if len(s) == len(new) and mesh.divides(s, new):
                outs.append(new)
            else:
                outs.append(replicated(len(s)))
        ins = _operand_specs(info, new, info.in_shapes[lead])
        return FollowResult(tuple(outs), ins, cost)

    return rule


def follow_window(info: EqnInfo, lead: int, spec: Spec, mesh: MeshContext) -> FollowResult:
    """Windowed reductions and their gradients (pooling): the window dims whole, the others
    as `lead` has them on every operand and result of its rank, whatever their window-dim
    sizes (max pooling's backward reads the pooled cotangent and the unpooled input)."""
    new, dropped = _drop_axes(spec, _window_dims(info))
    cost = _gather_cost(info.in_nbytes[lead], spec, dropped, mesh)
    like = lambda s: new if len(s) == len(new) and mesh.divides(s, new) else replicated(len(s))
    return FollowResult(tuple(like(s) for s in info.out_shapes),
                        tuple(like(s) for s in info.in_shapes), cost)


def follow_reduce(info: EqnInfo, lead: int, spec: Spec, mesh: MeshContext) -> FollowResult:
    axes = tuple(info.params["axes"])
    out = tuple(a for d, a in enumerate(spec) if d not in axes)
    split = tuple(a for d in axes for a in spec[d])
    out_bytes = info.out_nbytes[0] / max(mesh.shards(out), 1)
    comm = mesh.all_reduce_s(out_bytes, split) if split else 0.0
    if info.eqn.name in ("argmax", "argmin") and split:
        # An index reduction cannot combine partial results with one all-reduce: gather.
        out = tuple(a for d, a in enumerate(_drop_axes(spec, axes)[0]) if d not in axes)
        comm = _gather_cost(info.in_nbytes[lead], spec, split, mesh)
        spec = _drop_axes(spec, axes)[0]
    return FollowResult((out,) * len(info.out_shapes), (spec,), comm)


def follow_transpose(info: EqnInfo, lead: int, spec: Spec, mesh: MeshContext) -> FollowResult:
    perm = info.params["permutation"]
    return FollowResult((tuple(spec[p] for p in perm),), (spec,), 0.0)


def follow_squeeze(info: EqnInfo, lead: int, spec: Spec, mesh: MeshContext) -> FollowResult:
    dims = set(info.params["dimensions"])
    return FollowResult((tuple(a for d, a in enumerate(spec) if d not in dims),), (spec,), 0.0)


def follow_broadcast(info: EqnInfo, lead: int, spec: Spec, mesh: MeshContext) -> FollowResult:
    out_shape = info.out_shapes[0]
    in_shape = info.in_shapes[0]
    out: list[tuple[str, ...]] = [()] * len(out_shape)
    in_spec = list(spec)
    for i, d in enumerate(info.params["broadcast_dimensions"]):
        if in_shape[i] == out_shape[d]:
            out[d] = spec[i]
        else:  # size-1 dim stretched: it cannot stay split
            in_spec[i] = ()
    return FollowResult((tuple(out),), (tuple(in_spec),) + (None,) * (len(info.in_shapes) - 1),
                        0.0)


def _reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pairs of (src dims, dst dims) whose sizes multiply to the same number."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        ps = pd = 1
        while True:
            if ps <= pd and i < len(src):
                ps *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pd *= dst[j]
                gj.append(j)
                j += 1
            else:
                break
            if ps == pd and (i == len(src) or src[i] != 1 or gj) and gi and gj:
                break
        groups.append((gi, gj))
    return groups


def follow_reshape(info: EqnInfo, lead: int, spec: Spec, mesh: MeshContext) -> FollowResult:
    src, dst = info.in_shapes[0], info.out_shapes[0]
    out: list[tuple[str, ...]] = [()] * len(dst)
    in_spec = list(spec)
    for gi, gj in _reshape_groups(src, dst):
        split = [d for d in gi if spec[d]]
        if not split:
            continue
        # Only a split of the group's major (first non-1) src dim carries over, onto the
        # major dst dim, when that dst dim stays divisible.
        major_src = next((d for d in gi if src[d] != 1), gi[0])
        major_dst = next((d for d in gj if dst[d] != 1), gj[0] if gj else None)
        if (split == [major_src] and major_dst is not None
                and dst[major_dst] % mesh.dim_shards(spec[major_src]) == 0
                and (src[major_src] == dst[major_dst] or
                     dst[major_dst] % src[major_src] == 0 or src[major_src] % dst[major_dst] == 0)):
            out[major_dst] = spec[major_src]
        else:
            for d in split:
                in_spec[d] = ()
    in_new = tuple(in_spec)
    dropped = tuple(a for d in range(len(spec)) for a in spec[d] if not in_new[d])
    cost = _gather_cost(info.in_nbytes[0], spec, dropped, mesh)
    ins = (in_new,) + (None,) * (len(info.in_shapes) - 1)
    return FollowResult((tuple(out),), ins, cost)


def _unsplit_dims_where_sizes_change(info: EqnInfo) -> list[int]:
    a, b = info.in_shapes[0], info.out_shapes[0]
    return [d for d in range(len(a)) if a[d] != b[d]]


def follow_slice_like(info: EqnInfo, lead: int, spec: Spec, mesh: MeshContext) -> FollowResult:
    dims = _unsplit_dims_where_sizes_change(info)
    new, dropped = _drop_axes(spec, dims)
    cost = _gather_cost(info.in_nbytes[0], spec, dropped, mesh)
    ins = (new,) + tuple(replicated(len(s)) for s in info.in_shapes[1:])
    return FollowResult((new,), ins, cost)


def follow_dynamic_update_slice(info: EqnInfo, lead: int, spec: Spec,
                                mesh: MeshContext) -> FollowResult:
    op, upd = info.in_shapes[0], info.in_shapes[1]
    dims = [d for d in range(len(op)) if op[d] != upd[d]]
    new, dropped = _drop_axes(spec, dims)
    cost = _gather_cost(info.in_nbytes[0], spec, dropped, mesh)
    ins = (new, new) + tuple(replicated(len(s)) for s in info.in_shapes[2:])
    return FollowResult((new,), ins, cost)


def follow_concatenate(info: EqnInfo, lead: int, spec: Spec, mesh: MeshContext) -> FollowResult:
    new, dropped = _drop_axes(spec, [info.params["dimension"]])
    cost = _gather_cost(info.in_nbytes[lead], spec, dropped, mesh)
    return FollowResult((new,), (new,) * len(info.in_shapes), cost)


def follow_pad(info: EqnInfo, lead: int, spec: Spec, mesh: MeshContext) -> FollowResult:
    dims = [d for d, (lo, hi, interior) in enumerate(info.params["padding_config"])
            if lo or hi or interior]
    new, dropped = _drop_axes(spec, dims)
    cost = _gather_cost(info.in_nbytes[0], spec, dropped, mesh)
    return FollowResult((new,), (new, ()), cost)


def follow_top_k(info: EqnInfo, lead: int, spec: Spec, mesh: MeshContext) -> FollowResult:
    """top_k reads its `axis` (the last dim unless given) whole."""
    new, dropped = _drop_axes(spec, [info.params.get("axis", -1) % len(spec)])
    cost = _gather_cost(info.in_nbytes[0], spec, dropped, mesh)
    return FollowResult((new, new), (new,), cost)


def follow_split(info: EqnInfo, lead: int, spec: Spec, mesh: MeshContext) -> FollowResult:
    """`split` (jnp.split, e.g. a fused qkv projection cut in three): every piece keeps the
    operand's layout on the other dims.  A split of `axis` itself stays when every piece
    divides evenly by its shard count — piece blocks do not sit where the operand's blocks
    do, so XLA moves them with collective-permutes, priced as an all-to-all of the operand —
    else that dim is gathered whole first."""
    axis = info.params["axis"]
    n = mesh.dim_shards(spec[axis])
    if spec[axis] and all(int(size) % n == 0 for size in info.params["sizes"]):
        others = mesh.shards(spec) // n
        cost = mesh.all_to_all_s(info.in_nbytes[lead] / max(others, 1), spec[axis])
        return FollowResult((spec,) * len(info.out_shapes), (spec,), cost)
    new, dropped = _drop_axes(spec, [axis])
    cost = _gather_cost(info.in_nbytes[lead], spec, dropped, mesh)
    return FollowResult((new,) * len(info.out_shapes), (new,), cost)


def follow_sort(info: EqnInfo, lead: int, spec: Spec, mesh: MeshContext) -> FollowResult:
    new, dropped = _drop_axes(spec, [info.params["dimension"]])
    cost = _gather_cost(info.in_nbytes[lead], spec, dropped, mesh)
    return FollowResult((new,) * len(info.out_shapes), (new,) * len(info.in_shapes), cost)


def _window_dims(info: EqnInfo) -> list[int]:
    """Dims a windowed reduction reads across (window > 1 or strided): kept whole."""
    p = info.params
    dims = p.get("window_dimensions", ())
    strides = p.get("window_strides", (1,) * len(dims))
    return [d for d, (w, s) in enumerate(zip(dims, strides)) if w != 1 or s != 1]


# ---- enumerate rules ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Slot:
    """A group of tensor dims that one mesh axis splits together.

    `dims` lists (tensor, dim) pairs, tensor 0 being the output and 1.. the operands;
    `partial` marks contracting slots, whose split leaves partial sums in the output;
    `groups`, when set, must be divisible by the slot's shard count, so that every device's
    block holds whole groups (a grouped convolution's feature or batch groups).
    """

    label: str
    dims: tuple[tuple[int, int], ...]
    partial: bool = False
    groups: int = 0


def _whole_groups(slots: Sequence[Slot], axes: Sequence[str], assign: Sequence[int | None],
                  mesh: MeshContext) -> bool:
    """Whether every grouped slot's shard count under `assign` divides its `groups`."""
    return all(slot.groups % mesh.dim_shards([a for a, si in zip(axes, assign) if si == k]) == 0
               for k, slot in enumerate(slots) if slot.groups)


def slot_strategies(info: EqnInfo, mesh: MeshContext, slots: Sequence[Slot],
                    prefix: str) -> list[Strategy]:
    """Every assignment of the split mesh axes to `slots` (or to none) that divides all
    shapes evenly.  Partial sums are all-reduced, or reduce-scattered onto the largest
    free output dim (a second strategy)."""
    shapes = (info.out_shapes[0],) + info.in_shapes
    out_shape = shapes[0]
    axes = mesh.split_axes
    strategies: list[Strategy] = []
    for assign in itertools.product([None, *range(len(slots))], repeat=len(axes)):
        dims: list[list[list[str]]] = [[[] for _ in s] for s in shapes]
        partial: list[str] = []
        for axis, si in zip(axes, assign):
            if si is None:
                continue
            for t, d in slots[si].dims:
                dims[t][d].append(axis)
            if slots[si].partial:
                partial.append(axis)
        specs = [tuple(tuple(a) for a in t) for t in dims]
        if not all(mesh.divides(s, spec) for s, spec in zip(shapes, specs)):
            continue
        if not _whole_groups(slots, axes, assign, mesh):
            continue
        used = [a for a, si in zip(axes, assign) if si is not None]
        comp = layout_compute_s(info, mesh.dim_shards(used), specs, mesh)
        name = prefix + " " + " ".join(f"{slots[si].label}@{a}"
                                       for a, si in zip(axes, assign) if si is not None)
        ospec, ins = specs[0], tuple(specs[1:])
        if not partial:
            strategies.append(Strategy(name, (ospec,), ins, comp, 0.0))
            continue
        per_group = info.out_nbytes[0] / max(mesh.shards(ospec), 1)
        strategies.append(Strategy(name + " allreduce", (ospec,), ins, comp,
                                   mesh.all_reduce_s(per_group, partial), per_group,
                                   tuple(partial)))
        free = [d for d in range(len(out_shape)) if not ospec[d]
                and out_shape[d] % mesh.dim_shards(partial) == 0]
        if free:
            d = max(free, key=lambda i: out_shape[i])
            rs_spec = tuple(tuple(partial) if i == d else a for i, a in enumerate(ospec))
            strategies.append(Strategy(name + f" reducescatter@{d}", (rs_spec,), ins, comp,
                                       mesh.reduce_scatter_s(per_group, partial), per_group,
                                       tuple(partial)))
    return strategies


def enumerate_dot(info: EqnInfo, mesh: MeshContext) -> list[Strategy]:
    """Splits of batch, lhs-free, rhs-free and contracting dims (Alpa §4)."""
    (lc, rc), (lb, rb) = info.params["dimension_numbers"]
    lhs, rhs = info.in_shapes
    lf = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rf = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    slots = ([Slot(f"b{k}", ((0, k), (1, lb[k]), (2, rb[k]))) for k in range(len(lb))]
             + [Slot(f"m{d}", ((0, len(lb) + i), (1, d))) for i, d in enumerate(lf)]
             + [Slot(f"n{d}", ((0, len(lb) + len(lf) + i), (2, d))) for i, d in enumerate(rf)]
             + [Slot(f"k{k}", ((1, lc[k]), (2, rc[k])), partial=True) for k in range(len(lc))])
    return slot_strategies(info, mesh, slots, "dot")


def _conv_slots(info: EqnInfo) -> list[Slot] | None:
    """The slots of a convolution (spatial dims whole), None where only replicated runs
    without communication.

    - plain: batch, output features, input features (partial sums);
    - feature groups (`feature_group_count` G > 1: lhs feature block g meets rhs output
      block g): the batch, and the groups — lhs features, rhs and output features together,
      whole groups per device.  Only depthwise (one input feature per group): XLA's SPMD
      partitioner gathers the whole lhs of any other grouped convolution for either split;
    - batch groups (`batch_group_count` B > 1, the weight gradient of a grouped convolution:
      lhs batch block g meets rhs output block g): the groups — lhs batch, rhs and output
      features together, whole groups per device — and the lhs features (partial sums).
    """
    p = info.params
    dn = p["dimension_numbers"]
    fgc, bgc = p.get("feature_group_count", 1), p.get("batch_group_count", 1)
    batch = Slot("batch", ((0, dn.out_spec[0]), (1, dn.lhs_spec[0])))
    cout = ((0, dn.out_spec[1]), (2, dn.rhs_spec[0]))
    cin = Slot("cin", ((1, dn.lhs_spec[1]), (2, dn.rhs_spec[1])), partial=True)
    if bgc > 1:
        return [Slot("group", cout + ((1, dn.lhs_spec[0]),), groups=bgc), cin]
    if fgc > 1:
        if info.in_shapes[1][dn.rhs_spec[1]] != 1:
            return None
        return [batch, Slot("group", cout + ((1, dn.lhs_spec[1]),), groups=fgc)]
    return [batch, Slot("cout", cout), cin]


def enumerate_conv(info: EqnInfo, mesh: MeshContext) -> list[Strategy]:
    """The splits of `_conv_slots` (replicated where it has none).

    XLA (jaxlib 0.10.2) all-reduces the partial sums of a batch-grouped convolution over
    every device of the mesh: with a mesh axis left unsplit they come out multiplied by its
    size (tests/test_strategy_coverage.py).  Such a split runs only with every axis split."""
    slots = _conv_slots(info)
    if slots is None:
        return [replicated_strategy(info, mesh)]
    strategies = slot_strategies(info, mesh, slots, "conv")
    if info.params.get("batch_group_count", 1) > 1:
        every = set(mesh.split_axes)
        strategies = [s for s in strategies if not s.partial_axes
                      or set().union(*map(mesh.axes_used, s.in_specs)) == every]
    return strategies


def enumerate_gather(info: EqnInfo, mesh: MeshContext) -> list[Strategy]:
    """Gathers: split the index batch dims (with the operand's matching batching dim, as in
    take_along_axis), and/or a window dim taken whole."""
    dn = info.params["dimension_numbers"]
    operand = info.in_shapes[0]
    offset_dims = tuple(dn.offset_dims)
    batch_out = [d for d in range(len(info.out_shapes[0])) if d not in offset_dims]
    window_operand = [d for d in range(len(operand)) if d not in dn.collapsed_slice_dims
                      and d not in dn.operand_batching_dims]
    batching = dict(zip(dn.start_indices_batching_dims, dn.operand_batching_dims))
    # Output batch dim k pairs with indices dim i (the index vector dim is last); a batching
    # indices dim also pairs with its operand dim.
    slots = [Slot(f"b{k}", ((0, k), (2, i)) + (((1, batching[i]),) if i in batching else ()))
             for i, k in enumerate(batch_out)]
    slots += [Slot(f"w{wd}", ((0, od), (1, wd))) for od, wd in zip(offset_dims, window_operand)
              if info.params["slice_sizes"][wd] == operand[wd] and wd not in dn.start_index_map]
    return slot_strategies(info, mesh, slots, "gather")


def _scatter_slots(info: EqnInfo, sums: bool) -> list[Slot]:
    """Slots of a scatter: the updates' scatter dims — with the operand's matching dim for
    batching dims, else (`sums` only: the combiner adds) alone, leaving partial sums — and
    the window dims shared by operand and updates."""
    dn = info.params["dimension_numbers"]
    operand, _, updates = info.in_shapes
    window_upd = tuple(dn.update_window_dims)
    scatter_upd = [d for d in range(len(updates)) if d not in window_upd]
    window_operand = [d for d in range(len(operand)) if d not in dn.inserted_window_dims
                      and d not in dn.operand_batching_dims]
    batching = dict(zip(dn.scatter_indices_batching_dims, dn.operand_batching_dims))
    slots = []
    for i, d in enumerate(scatter_upd):
        if i in batching:
            od = batching[i]
            slots.append(Slot(f"b{d}", ((0, od), (1, od), (2, i), (3, d))))
        elif sums:
            slots.append(Slot(f"s{d}", ((2, i), (3, d)), partial=True))
    slots += [Slot(f"w{od}", ((0, od), (1, od), (3, ud)))
              for ud, od in zip(window_upd, window_operand)
              if updates[ud] == operand[od] and od not in dn.scatter_dims_to_operand_dims]
    return slots


def enumerate_scatter_add(info: EqnInfo, mesh: MeshContext) -> list[Strategy]:
    """Scatter-adds (embedding gradients, take_along_axis transposes): `_scatter_slots`,
    the updates' scatter dims split too (partial sums, all-reduce)."""
    if len(info.in_shapes) != 3:
        return [replicated_strategy(info, mesh)]
    return slot_strategies(info, mesh, _scatter_slots(info, sums=True), "scatter-add")


def enumerate_scatter(info: EqnInfo, mesh: MeshContext) -> list[Strategy]:
    """Scatters that overwrite (`x.at[i].set(u)`) or combine by mul/min/max/sub: the batching
    and window splits of `_scatter_slots`; their updates' partial results do not add up, so
    the other scatter dims stay whole."""
    if len(info.in_shapes) != 3:
        return [replicated_strategy(info, mesh)]
    return slot_strategies(info, mesh, _scatter_slots(info, sums=False), info.eqn.name)


def enumerate_outputs(info: EqnInfo, mesh: MeshContext) -> list[Strategy]:
    """Sources with no array operands worth moving (RNG bits): any layout of the output."""
    out = info.out_shapes[0]
    return [Strategy(f"source {spec}", (spec,) + tuple(replicated(len(s))
                                                      for s in info.out_shapes[1:]),
                     tuple(replicated(len(s)) for s in info.in_shapes),
                     compute_s(info, mesh.shards(spec), mesh), 0.0)
            for spec in enumerate_specs(out, mesh)]


def enumerate_opaque(info: EqnInfo, mesh: MeshContext) -> list[Strategy]:
    """Control flow kept whole: replicated, or every batch-sized leading dim split over
    one axis (the body then runs per batch shard; outputs without that dim are treated
    as partial sums and all-reduced)."""
    strategies = [replicated_strategy(info, mesh)]
    b = info.batch_size
    if not b:
        return strategies
    is_scan = info.eqn.name == "scan"
    num_consts = info.params.get("num_consts", 0) if is_scan else 0
    num_carry = info.params.get("num_carry", 0) if is_scan else 0

    def batch_dim(shape: tuple[int, ...], stacked: bool) -> int | None:
        d = 1 if stacked else 0
        return d if len(shape) > d and shape[d] == b else None

    for axis in mesh.split_axes:
        n = mesh.size(axis)
        if b % n:
            continue
        ins, outs, comm = [], [], 0.0
        for i, shape in enumerate(info.in_shapes):
            stacked = is_scan and i >= num_consts + num_carry
            d = batch_dim(shape, stacked)
            ins.append(tuple((axis,) if k == d else () for k in range(len(shape))))
        for i, shape in enumerate(info.out_shapes):
            stacked = is_scan and i >= num_carry
            d = batch_dim(shape, stacked)
            outs.append(tuple((axis,) if k == d else () for k in range(len(shape))))
            if d is None:
                comm += mesh.all_reduce_s(info.out_nbytes[i], (axis,))
        if not any(any(s) for s in ins):
            continue
        strategies.append(Strategy(f"opaque batch@{axis}", tuple(outs), tuple(ins),
                                   compute_s(info, n, mesh), comm))
    return strategies


# ---- the table ----------------------------------------------------------------------------

_follow = lambda fn, leader=largest_operand: StrategyRule("follow", follow=fn, leader=leader)
_enum = lambda fn: StrategyRule("enumerate", enumerate=fn)

# Rule families by name: a primitive's family is its registry entry's `strategy`
# (`passes.primitives`).  Each spelling of each primitive gets a rule object of its own.
_FAMILIES: dict[str, Callable[[], StrategyRule]] = {
    "elementwise": lambda: _follow(follow_elementwise),
    "reduce": lambda: _follow(follow_reduce, first_operand),
    "cumulative": lambda: _follow(follow_unsplit(lambda info: [info.params["axis"]]),
                                  first_operand),
    "broadcast_in_dim": lambda: _follow(follow_broadcast, first_operand),
    "reshape": lambda: _follow(follow_reshape, first_operand),
    "transpose": lambda: _follow(follow_transpose, first_operand),
    "squeeze": lambda: _follow(follow_squeeze, first_operand),
    "expand_dims": lambda: _follow(follow_reshape, first_operand),
    "slice": lambda: _follow(follow_slice_like, first_operand),
    "dynamic_slice": lambda: _follow(follow_slice_like, first_operand),
    "dynamic_update_slice": lambda: _follow(follow_dynamic_update_slice, first_operand),
    "concatenate": lambda: _follow(follow_concatenate),
    "pad": lambda: _follow(follow_pad, first_operand),
    "rev": lambda: _follow(follow_unsplit(lambda info: list(info.params["dimensions"])),
                           first_operand),
    "top_k": lambda: _follow(follow_top_k, first_operand),
    "sort": lambda: _follow(follow_sort),
    "split": lambda: _follow(follow_split, first_operand),
    "dot_general": lambda: _enum(enumerate_dot),
    "conv_general_dilated": lambda: _enum(enumerate_conv),
    "gather": lambda: _enum(enumerate_gather),
    "scatter-add": lambda: _enum(enumerate_scatter_add),
    "scatter": lambda: _enum(enumerate_scatter),
    "random_bits": lambda: _enum(enumerate_outputs),
    "opaque": lambda: _enum(enumerate_opaque),
    "window": lambda: _follow(follow_window, first_operand),
    # `cond`, PRNG key plumbing (tiny values) and autopar's own pipeline cut marker (no
    # operands, no results): replicated on purpose, no warning.
    "replicated": lambda: _enum(lambda info, mesh: [replicated_strategy(info, mesh)]),
}

strategy_rules: dict[str, StrategyRule] = {
    name: _FAMILIES[primitives.info(name).strategy]()
    for name in primitives.spellings(lambda p: p.strategy is not None)}


def rule_for(name: str, where: str = "") -> StrategyRule | None:
    """The rule of primitive `name`, or None: the equation (at the user's source line
    `where`) runs replicated, reported as a fallback."""
    rule = strategy_rules.get(name)
    if rule is None:
        fallbacks.report("intra-op", f"no sharding rule for primitive {name!r}: it runs "
                         "replicated", where)
    return rule
