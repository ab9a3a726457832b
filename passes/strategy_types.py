"""What a sharding strategy rule works with (`passes.strategies`): a strategy, the facts
of an equation a rule reads, a follow rule's answer, a rule, and the compute seconds of
an equation split over a mesh.  Units: seconds for costs, bytes for sizes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

from autopar.cost_model import compute
from autopar.passes.ir import Eqn

from .sharding_spec import MeshContext, Spec, replicated


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
                                  info.eqn_out_dtype, mesh.cluster,
                                  compute.kernel_of(info.eqn.name))


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
                                  info.eqn_out_dtype, mesh.cluster,
                                  compute.kernel_of(info.eqn.name))


def replicated_strategy(info: EqnInfo, mesh: MeshContext, name: str = "replicated") -> Strategy:
    return Strategy(name, tuple(replicated(len(s)) for s in info.out_shapes),
                    tuple(replicated(len(s)) for s in info.in_shapes),
                    compute_s(info, 1, mesh), 0.0)


