"""Parameter updates and optimizer state in the pipeline search: which parameters' state a
stage splits (`StateSplit`, ZeRO-2), what an update and the all-gather after it cost, and
the memory prices of the layer solves between time-optimal and lean (`KNEE_FRACTIONS`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from autopar.cost_model import ClusterSpec
from autopar.cost_model.collectives import combined_alpha_share
from autopar.cost_model.compute import compute_time_s
from autopar.passes.sharding_spec import (
    MeshContext,
    Spec,
    enumerate_specs,
    reshard_s,
    state_split,
)


@dataclasses.dataclass(frozen=True)
class StateSplit:
    """Which parameters' optimizer state a stage splits over its unused mesh axes (ZeRO-2,
    `state_split`), and what each parameter's update costs.

    `mode`: "none"; "all"; or "paying": where updating the split and all-gathering the
    updated parameter back to its layout is faster than updating it whole at its layout."""

    mode: str
    state_bytes_per_param_byte: float
    cluster: ClusterSpec
    # (spec, shape, nbytes, mesh shape, mesh links) -> _costs_s: the stage DP asks for the
    # same parameters' costs once per layer range.
    _memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def _costs_s(self, spec: Spec, shape: tuple[int, ...], nbytes: float,
                 mesh: MeshContext) -> tuple[float, float]:
        """(whole update, split update + all-gather) seconds per step."""
        key = (spec, shape, nbytes, mesh.shape, mesh.links)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = self._compute_costs_s(spec, shape, nbytes, mesh)
        return found

    def _compute_costs_s(self, spec: Spec, shape: tuple[int, ...], nbytes: float,
                         mesh: MeshContext) -> tuple[float, float]:
        whole = update_time_s(nbytes / mesh.shards(spec), self.state_bytes_per_param_byte,
                              self.cluster)
        if self.mode == "none":
            return whole, math.inf
        state = state_split(spec, shape, mesh)
        split = (update_time_s(nbytes / mesh.shards(state), self.state_bytes_per_param_byte,
                               self.cluster)
                 + gather_after_update_s(state, spec, nbytes, mesh))
        return whole, split

    def _chooses_split(self, whole: float, split: float) -> bool:
        return self.mode == "all" or (self.mode == "paying" and split < whole)

    def splits(self, spec: Spec, shape: tuple[int, ...], nbytes: float,
               mesh: MeshContext) -> bool:
        return self._chooses_split(*self._costs_s(spec, shape, nbytes, mesh))

    def cost_s(self, spec: Spec, shape: tuple[int, ...], nbytes: float,
               mesh: MeshContext) -> float:
        """Seconds per step of updating a parameter held as `spec` (and gathering it)."""
        whole, split = self._costs_s(spec, shape, nbytes, mesh)
        return split if self._chooses_split(whole, split) else whole


# Seconds added to a parameter layout that is not cut as finely as it can be, in a lean
# layer solve (`start_price_stage(lean=True)`): larger than any layer's time.
LEAN_PENALTY_S = 1e4


#: The memory-priced layer solves between the time-optimal and the lean ends of a layer's
#: trade-off, as fractions of the sub-mesh's knee price (`knee_price`: the seconds per
#: byte at which its layers' time-optimal and lean solutions cost the same): a stage whose
#: time-optimal layouts do not fit tries them in this order before the lean ones, all its
#: layers at one price (a Lagrangian sweep of the stage's memory constraint: each price
#: gives a stage on its time/memory frontier).  The knee comes from the two solutions the
#: search has anyway, so the prices follow the model and the device, not a fixed scale.
KNEE_FRACTIONS = (0.25, 1.0)


#: The trade-off level of the lean layer solves (after the time-optimal level 0 and the
#: memory-priced levels 1..len(KNEE_FRACTIONS)).
LEAN = len(KNEE_FRACTIONS) + 1


def _level_name(level: int) -> str:
    return "lean" if level == LEAN else f"memory-priced ({KNEE_FRACTIONS[level - 1]:g} x knee)"


def knee_price(pairs: Sequence[tuple[float, float, float, float]]) -> float | None:
    """Seconds per byte at which the lean end of a layer's trade-off pays: the median, over
    (time-optimal s, time-optimal bytes, lean s, lean bytes) pairs of solutions, of the
    time the lean one adds per byte it saves; None where no pair trades time for bytes."""
    rates = sorted((lean_s - fast_s) / (fast_b - lean_b)
                   for fast_s, fast_b, lean_s, lean_b in pairs
                   if lean_s > fast_s and fast_b > lean_b)
    return rates[len(rates) // 2] if rates else None


def _finest_shards(shape: tuple[int, ...], mesh: MeshContext) -> int:
    """The most pieces an even split of a value of `shape` on `mesh` cuts it into (what a
    lean solve's parameters must reach)."""
    return max(mesh.shards(s) for s in enumerate_specs(shape, mesh))


def _lean_penalty(shape: tuple[int, ...], mesh: MeshContext) -> Callable[[Spec], float]:
    """`LEAN_PENALTY_S` seconds on a spec with fewer shards than the finest even split of a
    value of `shape` on `mesh` (`_finest_shards`), 0 on the others."""
    finest = _finest_shards(shape, mesh)
    return lambda spec: LEAN_PENALTY_S if mesh.shards(spec) < finest else 0.0


def _param_cost(update: StateSplit | None, lean: Callable[[Spec], float] | None,
                shape: tuple[int, ...], nbytes: float, mesh: MeshContext,
                num_micro_batches: int, memory_price: float = 0.0
                ) -> Callable[[Spec], float]:
    """A parameter input's extra seconds per spec: its update amortized over the
    micro-batches (`update`), the lean penalty `lean` (`_lean_penalty` of `shape` on
    `mesh`) if given, and `memory_price` (s/byte) times the bytes per device the spec
    keeps of the parameter, its gradient and optimizer state."""
    def cost(spec: Spec) -> float:
        seconds = 0.0 if update is None else (
            update.cost_s(spec, shape, nbytes, mesh) / num_micro_batches)
        if lean is not None:
            seconds += lean(spec)
        if memory_price:
            seconds += _memory_charge_s(memory_price, update, nbytes, mesh.shards(spec))
        return seconds
    return cost


def _memory_charge_s(memory_price: float, update: StateSplit | None, nbytes: float,
                     shards: int) -> float:
    """The memory price (s/byte) of a parameter of `nbytes` cut into `shards` per device:
    its bytes there, its gradient's and its optimizer state's (`update`'s bytes per
    parameter byte; none without)."""
    held_per_byte = 2.0 + (update.state_bytes_per_param_byte if update is not None else 0.0)
    return memory_price * held_per_byte * nbytes / shards


def state_floor_bytes(param_bytes: float, state_bytes_per_param_byte: float,
                      num_devices: int) -> float:
    """Bytes per device that no plan goes below: the parameters, their gradient
    accumulators and the optimizer state, split evenly over all `num_devices`."""
    return param_bytes * (2.0 + state_bytes_per_param_byte) / num_devices


def gather_after_update_s(state: Spec, spec: Spec, nbytes: float, mesh: MeshContext) -> float:
    """Seconds of all-gathering a parameter of `nbytes` (whole) updated at its state layout
    `state` back to its layout `spec`.  The stage's update gathers every such parameter at
    once, so XLA:GPU combines the gathers (`collectives.combined_alpha_share`, by the mesh's
    device kind): each pays the bandwidth of its own bytes and its share of a combined op's
    latency."""
    if state == spec:
        return 0.0
    latency = reshard_s(state, spec, 0.0, mesh)
    share = combined_alpha_share(nbytes / mesh.shards(spec), mesh.cluster.device_kind)
    return reshard_s(state, spec, nbytes, mesh) - (1.0 - share) * latency


def update_time_s(param_bytes: float, state_bytes_per_param_byte: float,
                  cluster: ClusterSpec) -> float:
    """Seconds of the optimizer update over `param_bytes` of parameters on one device:
    memory-bound — read parameters, gradients and state, write parameters and state
    (~3 FLOPs per byte of parameter, AdamW's dozen per float32 element)."""
    nbytes = param_bytes * (3 + 2 * state_bytes_per_param_byte)
    return compute_time_s(3 * param_bytes, nbytes, "float32", cluster)
