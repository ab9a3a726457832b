"""Sharding specs on a logical mesh, and what it costs to move between them.

A `Spec` gives, for every tensor dim, the tuple of logical mesh axes that split it
(`()` = not split), e.g. `(("x",), ())` shards dim 0 over axis x.  It maps 1:1 onto a
`jax.sharding.PartitionSpec`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator, Sequence

from autopar.cost_model import ClusterSpec, Link, collectives
from autopar.cost_model.cluster import Backend
from autopar.cost_model.collectives import CollectiveKind

Spec = tuple[tuple[str, ...], ...]

AXIS_NAMES = ("x", "y")

# XLA combines independent all-reduces (and reduce-scatters) into buckets of up to 30 MiB
# (kDefaultAllReduceCombineThreshold in xla/service/collective_utils.h): a small gradient
# reduction shares one latency α with the rest of its bucket.
COMBINE_BYTES = 30 * 2**20


def replicated(ndim: int) -> Spec:
    return ((),) * ndim


@dataclasses.dataclass(frozen=True)
class MeshContext:
    """A logical 1-D or 2-D mesh with the links of its axes.

    Attributes:
      shape: devices along each logical axis, e.g. (2, 4).
      axes: names of the axes, ("x",) or ("x", "y").
      links: α-β link of each axis.
      cluster: the cluster the mesh lives on (peak FLOP/s, memory bandwidth).
    """

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    links: tuple[Link, ...]
    cluster: ClusterSpec

    @staticmethod
    def build(shape: Sequence[int], cluster: ClusterSpec) -> MeshContext:
        shape = tuple(int(s) for s in shape)
        if not 1 <= len(shape) <= 2:
            raise ValueError(f"logical mesh must be 1-D or 2-D, got shape {shape}")
        return MeshContext(shape, AXIS_NAMES[: len(shape)], cluster.mesh_axis_links(shape),
                           cluster)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def size(self, axis: str) -> int:
        return self.shape[self.axes.index(axis)]

    def link(self, axis: str) -> Link:
        return self.links[self.axes.index(axis)]

    @property
    def split_axes(self) -> tuple[str, ...]:
        """Axes with more than one device (the only ones worth splitting over)."""
        return tuple(a for a, n in zip(self.axes, self.shape) if n > 1)

    def shards(self, spec: Spec) -> int:
        """Number of pieces a value with `spec` is cut into."""
        n = self._shards.get(spec)
        if n is None:
            n = self._shards[spec] = math.prod(self.size(a) for dim in spec for a in dim)
        return n

    @functools.cached_property
    def _shards(self) -> dict[Spec, int]:
        """`shards` memo (the stage search asks it millions of times)."""
        return {}

    def dim_shards(self, axes: Sequence[str]) -> int:
        return math.prod(self.size(a) for a in axes)

    def divides(self, shape: Sequence[int], spec: Spec) -> bool:
        """Whether every dim of `shape` splits evenly under `spec`."""
        return all(n % self.dim_shards(axes) == 0 for n, axes in zip(shape, spec))

    def axes_used(self, spec: Spec) -> set[str]:
        return {a for dim in spec for a in dim}

    # ---- collectives over a set of axes (α-β, DESIGN §6) ----------------------------------

    def group_link(self, axes: Sequence[str], nbytes: float | None = None) -> Link:
        """The link of one collective over all of `axes` (XLA emits one collective over the
        product of the axes, not one per axis): the slowest axis' link; with `nbytes`, α is
        pro-rated to the share of a 30 MiB combined bucket."""
        link = max((self.link(a) for a in axes), key=lambda k: (k.beta_s_per_byte, k.alpha_s))
        if nbytes is None:
            return link
        return dataclasses.replace(link, alpha_s=link.alpha_s * min(1.0, nbytes / COMBINE_BYTES))

    @functools.cached_property
    def backend(self) -> Backend:
        """The XLA backend of the mesh's devices: which collectives run as which
        (`collectives.LOWERINGS`)."""
        return self.cluster.backend

    def collective_s(self, kind: CollectiveKind, nbytes: float, n: int, link: Link) -> float:
        """Seconds of collective `kind` of S = `nbytes` over `n` devices on `link`, as the
        mesh's backend runs it (`collectives.collective_s`: a CPU reduce-scatter is an
        all-reduce)."""
        return collectives.collective_s(kind, nbytes, n, link, self.backend)

    def all_reduce_s(self, nbytes: float, axes: Sequence[str]) -> float:
        """All-reduce of `nbytes` over `axes` (partial sums; combined by XLA)."""
        if not axes:
            return 0.0
        return self.collective_s("all-reduce", nbytes, self.dim_shards(axes),
                                 self.group_link(axes, nbytes))

    def all_gather_s(self, nbytes: float, axes: Sequence[str]) -> float:
        """Gathering a value whose full size is `nbytes` over `axes`."""
        if not axes:
            return 0.0
        return self.collective_s("all-gather", nbytes, self.dim_shards(axes),
                                 self.group_link(axes))

    def reduce_scatter_s(self, nbytes: float, axes: Sequence[str]) -> float:
        """Reduce-scattering partial sums of `nbytes` (the whole input per device) over
        `axes`, as the backend runs it: on XLA:CPU an all-reduce of the whole input and a
        local slice (`collectives.LOWERINGS`), elsewhere the native ring (half the
        all-reduce's volume)."""
        if not axes:
            return 0.0
        return self.collective_s("reduce-scatter", nbytes, self.dim_shards(axes),
                                 self.group_link(axes, nbytes))

    def all_to_all_s(self, nbytes: float, axes: Sequence[str]) -> float:
        """All-to-all of a group tensor of `nbytes` over each of `axes` in turn."""
        return sum(self.collective_s("all-to-all", nbytes, self.size(a), self.link(a))
                   for a in axes)


def enumerate_specs(shape: Sequence[int], mesh: MeshContext) -> Iterator[Spec]:
    """Every spec of `shape` that splits dims only evenly: replicated first, then each
    split axis on one dim, then both axes on two different dims or together on one."""
    ndim = len(shape)
    axes = mesh.split_axes
    yield replicated(ndim)
    choices = [None, *range(ndim)]
    seen = {replicated(ndim)}
    for assign in itertools.product(choices, repeat=len(axes)):
        dims: list[list[str]] = [[] for _ in range(ndim)]
        for axis, dim in zip(axes, assign):
            if dim is not None:
                dims[dim].append(axis)
        spec = tuple(tuple(d) for d in dims)
        if spec in seen:
            continue
        if all(shape[d] % mesh.dim_shards(spec[d]) == 0 for d in range(ndim)):
            seen.add(spec)
            yield spec


def is_valid(spec: Spec, shape: Sequence[int], mesh: MeshContext) -> bool:
    """Whether `spec` splits `shape` evenly and uses each axis at most once."""
    if len(spec) != len(shape):
        return False
    used = [a for dim in spec for a in dim]
    if len(used) != len(set(used)) or any(a not in mesh.axes for a in used):
        return False
    return all(n % mesh.dim_shards(axes) == 0 for n, axes in zip(shape, spec))


def state_split(spec: Spec, shape: Sequence[int], mesh: MeshContext) -> Spec:
    """`spec` cut further over the mesh axes it leaves whole: the layout of a parameter's
    optimizer state and reduced gradient when the state is split over the data-parallel
    axes (ZeRO-2).  Each unused axis (more than one device) joins the largest dim it still
    divides evenly, after the axes already there (`spec` → result is a local slice); an
    axis that divides no dim stays unused."""
    dims = [list(axes) for axes in spec]
    used = mesh.axes_used(spec)
    for axis in mesh.split_axes:
        if axis in used:
            continue
        fits = [d for d, n in enumerate(shape)
                if n % (mesh.dim_shards(dims[d]) * mesh.size(axis)) == 0]
        if fits:
            best = max(fits, key=lambda d: (shape[d] // mesh.dim_shards(dims[d]), -d))
            dims[best].append(axis)
    return tuple(tuple(d) for d in dims)


@dataclasses.dataclass(frozen=True)
class ReshardStep:
    """One collective of a re-layout, over the mesh axes `axes`.

    Attributes:
      kind: HLO spelling: "all-gather", "all-to-all" or "collective-permute".
      nbytes: S as `cost_model.hlo_audit` counts it, per device: an all-gather's result,
        an all-to-all's group tensor, a permute's sent shard.
      axes: the logical mesh axes the collective runs over.
    """

    kind: str
    nbytes: float
    axes: tuple[str, ...]

    def seconds(self, mesh: MeshContext) -> float:
        return _STEP_PRICES[self.kind](mesh, self.nbytes, self.axes)


_STEP_PRICES = {
    "collective-permute": lambda mesh, s, axes: mesh.collective_s(
        "send-recv", s, 2, mesh.group_link(axes)),
    "all-gather": lambda mesh, s, axes: mesh.all_gather_s(s, axes),
    "all-to-all": lambda mesh, s, axes: mesh.all_to_all_s(s, axes),
}
"""Seconds of a `ReshardStep` per kind: (mesh, S bytes, axes) -> seconds."""


def reshard_s(src: Spec, dst: Spec, nbytes: float, mesh: MeshContext) -> float:
    """Seconds to turn a value of `nbytes` (whole) laid out as `src` into `dst`: its
    `reshard_steps` priced on `mesh`."""
    if src == dst:
        return 0.0
    return sum((step.seconds(mesh) for step in reshard_steps(src, dst, nbytes, mesh)), 0.0)


def reshard_steps(src: Spec, dst: Spec, nbytes: float, mesh: MeshContext
                  ) -> tuple[ReshardStep, ...]:
    """The collectives that turn a value of `nbytes` (whole) laid out as `src` into `dst`.

    Per mesh axis: dropped → all-gather; added → a local slice (free) when it goes after
    the axes its dim keeps, else the devices' blocks are reordered (`reorders`: XLA sends
    each device its new block: a collective-permute of the finer of the two shards); moved to
    another dim → all-to-all when it is the only axis involved, else an all-gather (the
    emitter routes such a move through `gather_first`, because XLA's partitioner would
    otherwise replicate the whole value: `full_rematerialization`).  Each collective
    moves the part of the value still split on the other axes.
    """
    if src == dst:
        return ()
    steps = []
    involved = mesh.axes_used(src) | mesh.axes_used(dst)
    if reorders(src, dst):
        finer = max(mesh.shards(src), mesh.shards(dst))   # permuted at the finer split
        steps.append(ReshardStep("collective-permute", nbytes / finer,
                                 tuple(sorted(involved))))
    several = len(involved) > 1
    split = mesh.shards(src)   # pieces of the value before the next collective
    for axis in mesh.split_axes:
        s_dim = _dim_of(src, axis)
        d_dim = _dim_of(dst, axis)
        if s_dim == d_dim or s_dim is None:
            continue
        # Bytes of the group the collective runs in: the value as split by the axes not yet
        # gathered.  Gathering axes one after another costs what one gather over all of
        # them does (a 2x2 split gathered: S/4 over the first axis, then S/2 over the
        # second = 3S/4, the 4-way all-gather's bytes).
        others = split // mesh.size(axis)
        group_bytes = nbytes / max(others, 1)
        kind = "all-gather" if d_dim is None or several else "all-to-all"
        steps.append(ReshardStep(kind, group_bytes, (axis,)))
        if kind == "all-gather":
            split = max(others, 1)
    return tuple(steps)


def full_rematerialization(src: Spec, dst: Spec) -> bool:
    """Whether XLA's partitioner reshards `src` → `dst` by replicating the whole value (its
    "involuntary full rematerialization"): with more than one mesh axis involved, a split
    moves to another dim, or one axis is gathered while another is newly split.  Pure
    gathers, pure slices and a one-axis move (all-to-all) are done with collectives."""
    axes = {a for d in src for a in d} | {a for d in dst for a in d}
    if len(axes) < 2 or src == dst:
        return False
    moves = gathers = adds = False
    for a in axes:
        s, d = _dim_of(src, a), _dim_of(dst, a)
        if s == d:
            continue
        if s is None:
            adds = True
        elif d is None:
            gathers = True
        else:
            moves = True
    return moves or (gathers and adds)


def gather_first(src: Spec, dst: Spec) -> Spec:
    """The layout between `src` and `dst` that avoids a full rematerialization: `src` keeping
    only the axes that stay on their dim in `dst` — reached by all-gathers, and from which
    `dst` is a slice."""
    return tuple(tuple(a for a in axes if _dim_of(dst, a) == d) for d, axes in enumerate(src))


def is_slice(src: Spec, dst: Spec) -> bool:
    """Whether `dst` only cuts `src` finer: every dim of `dst` starts with the axes that
    split it in `src`, in order (a local slice, no communication, fused into the consumer
    by XLA).  A new axis ahead of them is not: on a 2x4 mesh, rows split 4 ways over y and
    then 8 ways over (x, y) give device (x, y) block 4x + y of 8, which it does not hold."""
    return all(tuple(d_axes[:len(s_axes)]) == tuple(s_axes) for s_axes, d_axes in zip(src, dst))


def reorders(src: Spec, dst: Spec) -> bool:
    """Whether the blocks the devices hold must move between devices beyond what the
    gathers and all-to-alls of the axes that leave a dim do: in some dim, the axes it keeps
    are not the leading axes of `src`'s (a major axis leaves, a minor one stays) or not the
    leading axes of `dst`'s (a new axis goes ahead of them)."""
    for s_axes, d_axes in zip(src, dst):
        kept = tuple(a for a in s_axes if a in d_axes)
        if kept and (tuple(s_axes[:len(kept)]) != kept or tuple(d_axes[:len(kept)]) != kept):
            return True
    return False


def _dim_of(spec: Spec, axis: str) -> int | None:
    for d, axes in enumerate(spec):
        if axis in axes:
            return d
    return None


def format_spec(spec: Spec) -> str:
    """PartitionSpec-like text: P('x', None, ('x','y'))."""
    parts = []
    for axes in spec:
        if not axes:
            parts.append("None")
        elif len(axes) == 1:
            parts.append(repr(axes[0]))
        else:
            parts.append("(" + ", ".join(repr(a) for a in axes) + ")")
    return "P(" + ", ".join(parts) + ")"


def spec_to_json(spec: Spec) -> list[list[str]]:
    return [list(d) for d in spec]


def spec_from_json(data: Sequence[Sequence[str]]) -> Spec:
    return tuple(tuple(str(a) for a in d) for d in data)
