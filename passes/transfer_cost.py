"""What moving a value between two pipeline stages costs, from both stages' layouts.

The runtime (`autopar.transfer.local_move` / `_route`, and `StageRunner.send`) moves a value
from the sender's sub-mesh to the receiver's in one of three ways, chosen by the two
layouts:

| route         | device counts, tilings | sender             | each receiver device | receiver  |
| ------------- | ---------------------- | ------------------ | -------------------- | --------- |
| copy          | equal, the same        | nothing            | its own shard        | nothing   |
| relayout+copy | equal, different       | re-lays it out in  | its own shard        | nothing   |
|               |                        | the receiver's     |                      |           |
|               |                        | tiling: collective |                      |           |
| whole copies  | different              | all-gathers it     | the whole value      | cuts it   |
|               |                        | (replicated)       |                      | (a slice) |

So a replicated reader receives the whole value on every device whatever the route.  The
collectives are priced with `sharding_spec.reshard_steps` (the ones the intra-op pass
prices resharding with), the copy as one point-to-point transfer per receiving device over
the link between the two sub-meshes, all of them in parallel.

Units: seconds and bytes; bytes of a collective are S as `cost_model.hlo_audit` counts
them (per device), bytes of the copy are what one receiving device receives.  JAX-free.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

from autopar.cost_model import Link
from autopar.cost_model.collectives import send_recv_s

from .sharding_spec import (
    MeshContext,
    ReshardStep,
    Spec,
    enumerate_specs,
    replicated,
    reshard_steps,
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A value laid out on one sub-mesh: `spec` over the logical mesh `mesh` (its shape,
    axis names and links)."""

    spec: Spec
    mesh: MeshContext

    @property
    def devices(self) -> int:
        return self.mesh.num_devices


@dataclasses.dataclass(frozen=True)
class TransferPrice:
    """One transfer's cost, by phase.

    Attributes:
      route: "copy", "relayout+copy" or "whole copies" (module table).
      relayout: the collectives on the sender's devices before the copy.
      relayout_s: their seconds.
      copy_bytes: bytes each receiving device receives.
      copy_s: seconds of the copy (the receiving devices' copies run in parallel).
      receive: the collectives on the receiver's devices after the copy (none for a cut:
        slicing a held copy is local).
      receive_s: their seconds.
    """

    route: str
    relayout: tuple[ReshardStep, ...]
    relayout_s: float
    copy_bytes: float
    copy_s: float
    receive: tuple[ReshardStep, ...] = ()
    receive_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.relayout_s + self.copy_s + self.receive_s

    @property
    def relayout_bytes(self) -> float:
        """Bytes per device of the sender's collectives (S of each, summed)."""
        return sum((step.nbytes for step in self.relayout), 0.0)


@dataclasses.dataclass(frozen=True)
class _Route:
    """What one route does: the layout the sender gives the value before the copy (a spec
    over the sender's mesh; from the value's shape and the two layouts), the fraction of
    the value each receiving device gets, and the layout it arrives in (a spec over the
    receiver's mesh)."""

    sent: Callable[[Sequence[int], Layout, Layout], Spec]
    copied: Callable[[Layout], float]
    arrives: Callable[[Layout], Spec]


def _own_shard(dst: Layout) -> float:
    return 1.0 / dst.mesh.shards(dst.spec)


_ROUTES: dict[str, _Route] = {
    "copy": _Route(sent=lambda shape, src, dst: src.spec, copied=_own_shard,
                   arrives=lambda dst: dst.spec),
    "relayout+copy": _Route(sent=lambda shape, src, dst: _same_tiling_on(shape, dst, src.mesh),
                            copied=_own_shard, arrives=lambda dst: dst.spec),
    "whole copies": _Route(sent=lambda shape, src, dst: replicated(len(shape)),
                           copied=lambda dst: 1.0,
                           arrives=lambda dst: replicated(len(dst.spec))),
}


def route(src: Layout, dst: Layout) -> str:
    """The runtime's route from `src` to `dst` (module table)."""
    if src.devices != dst.devices:
        return "whole copies"
    if _tiling(src.spec, src.mesh.shape, src.mesh.axes) == \
            _tiling(dst.spec, dst.mesh.shape, dst.mesh.axes):
        return "copy"
    return "relayout+copy"


def price_transfer(shape: Sequence[int], nbytes: float, src: Layout, dst: Layout, link: Link,
                   then: Spec | None = None) -> TransferPrice:
    """Seconds (and bytes) of moving a value of `shape` and `nbytes` (whole) laid out as
    `src` on the sender's sub-mesh to `dst` on the receiver's, the two sub-meshes joined by
    `link` (module docstring).  `then`: a layout the receiver re-lays the value into once
    it has arrived in `dst` (priced on the receiver; None: it stays in `dst`)."""
    name = route(src, dst)
    how = _ROUTES[name]
    relayout = reshard_steps(src.spec, how.sent(shape, src, dst), nbytes, src.mesh)
    copy_bytes = nbytes * how.copied(dst)
    receive = reshard_steps(how.arrives(dst), dst.spec, nbytes, dst.mesh)
    if then is not None:
        receive += reshard_steps(dst.spec, then, nbytes, dst.mesh)
    return TransferPrice(
        route=name, relayout=relayout,
        relayout_s=sum((s.seconds(src.mesh) for s in relayout), 0.0),
        copy_bytes=copy_bytes, copy_s=send_recv_s(copy_bytes, 2, link),
        receive=receive, receive_s=sum((s.seconds(dst.mesh) for s in receive), 0.0))


def _same_tiling_on(shape: Sequence[int], dst: Layout, mesh: MeshContext) -> Spec:
    """A spec over `mesh` (as many devices as `dst`'s) that cuts a value of `shape` as `dst`
    does, device k holding device k's piece: `dst.spec` itself on a mesh of its shape;
    else one found among `mesh`'s even specs; else replicated (the sender then gathers the
    value whole and slices its pieces: an upper bound on what XLA does)."""
    if mesh.shape == dst.mesh.shape and mesh.axes == dst.mesh.axes:
        return dst.spec
    want = _tiling(dst.spec, dst.mesh.shape, dst.mesh.axes)
    for spec in enumerate_specs(shape, mesh):
        if _tiling(spec, mesh.shape, mesh.axes) == want:
            return spec
    return replicated(len(shape))


@functools.lru_cache(maxsize=4096)
def _tiling(spec: Spec, mesh_shape: tuple[int, ...], axes: tuple[str, ...]
            ) -> tuple[tuple[int, ...], ...]:
    """Per device (row-major over the mesh axes, the order of `Mesh.devices.flat`), the index
    of its block in each dim of a value laid out as `spec`."""
    size = dict(zip(axes, mesh_shape))
    out = []
    for flat in range(math.prod(mesh_shape)):
        coord = dict(zip(axes, _unravel(flat, mesh_shape)))
        blocks = []
        for dim_axes in spec:
            index = 0
            for a in dim_axes:
                index = index * size[a] + coord[a]
            blocks.append(index)
        out.append(tuple(blocks))
    return tuple(out)


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for n in reversed(shape):
        coords.append(flat % n)
        flat //= n
    return tuple(reversed(coords))
