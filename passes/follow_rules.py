"""Follow rules (`passes.strategies`): an equation takes the layout of one operand, its
leader; for each layout of the leader a rule gives the output specs, the specs the other
operands must have, and the communication that costs.  Units: seconds, bytes."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .sharding_spec import MeshContext, Spec, replicated
from .strategy_types import (
    EqnInfo,
    FollowFn,
    FollowResult,
)

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


