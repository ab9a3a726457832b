"""Enumerate rules (`passes.strategies`): whole strategies of an equation (output specs,
required input specs, compute and communication seconds), e.g. the splits of a
`dot_general` or a convolution.  Units: seconds, bytes."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from .sharding_spec import MeshContext, enumerate_specs, replicated
from .strategy_types import (
    EqnInfo,
    Strategy,
    compute_s,
    layout_compute_s,
    replicated_strategy,
)

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


