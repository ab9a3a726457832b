"""The first phase of a pipeline search: the forward cut into layers, and everything the
later phases read that the layering and the method fix (`SearchContext`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from autopar import pipeline
from autopar.cost_model import ClusterSpec
from autopar.cost_model.units import format_bytes
from autopar.graph import Graph
from autopar.methods import PipelineMethod, StageLayout
from autopar.passes import inter_op, layering
from autopar.passes.inter_op import NoStageLayoutError

from .layer_cost import LAYER_RETRY_TIME_LIMIT_S, LAYER_TIME_LIMIT_S, diff_values
from .state import StateSplit, state_floor_bytes


@dataclasses.dataclass(frozen=True)
class SearchContext:
    """One pipeline search's fixed facts (`prepare`).

    Attributes:
      graph: the forward graph F of the split step; `diff`: its value ids that carry
        gradients; `params`: its differentiable inputs' value ids.
      layering: the layering pass's result; `ranges`: each layer's equation range
        [start, stop) in F; `programs`: each layer's program.
      method, cluster, layout: the method, the cluster, and the stage search's freedom
        (`PipelineMethod.stage_layout`).
      device_ids: the devices the pipeline runs on; `hosts`, `per_host`: how they sit.
      budget: bytes per device a stage may use.
      modes: the optimizer-state modes a stage is priced under (`StateSplit`), the first
        the layer ILPs' own; `splits`: each mode's `StateSplit`.
      state_bytes_per_param_byte: optimizer state bytes per parameter byte.
      always_remat: every layer recomputes its activations in the backward;
        `search_remat`: the stage search may rematerialize layers where memory needs it.
      layer_kw: the keyword arguments of every layer solve (`start_price_stage`).
    """

    graph: Graph
    diff: frozenset[int]
    params: frozenset[int]
    layering: layering.Layering
    ranges: tuple[tuple[int, int], ...]
    programs: tuple[pipeline.StageProgram, ...]
    method: PipelineMethod
    cluster: ClusterSpec
    layout: StageLayout
    device_ids: tuple[int, ...]
    hosts: int
    per_host: int
    budget: float
    modes: tuple[str, ...]
    splits: Mapping[str, StateSplit]
    state_bytes_per_param_byte: float
    always_remat: bool
    search_remat: bool
    layer_kw: Mapping[str, Any]

    @property
    def num_layers(self) -> int:
        return self.layering.num_layers

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)

    @property
    def micro(self) -> int:
        """Micro-batches per step."""
        return self.method.num_micro_batches

    @property
    def gpipe(self) -> bool:
        """GPipe runs every micro-batch's forward before the first backward: each stage
        holds all of their residuals (1F1B: as many as stages from it to the last)."""
        return self.method.schedule == "gpipe"

    @property
    def link(self):
        """The slowest link of the cluster the pipeline spans."""
        return self.cluster.inter_host if self.hosts > 1 else self.cluster.intra_host

    @property
    def submeshes(self) -> list[tuple[int, int]]:
        """The sub-mesh shapes the stage DP may choose from."""
        return inter_op.submesh_shapes(self.hosts, self.per_host)

    @property
    def priced_submeshes(self) -> list[tuple[int, int]]:
        """Every sub-mesh shape a layer is priced on, sorted: the method's, or the DP's."""
        return sorted(set(self.layout.submesh_shapes) if self.layout.submesh_shapes is not None
                      else self.submeshes)

    @property
    def fixed_shape(self) -> list[tuple[int, ...]] | None:
        """The one logical mesh shape every layer is priced on, or None (each tried)."""
        return [self.layout.logical_shape] if self.layout.logical_shape is not None else None

    def whole(self, i: int, j: int, submesh: tuple[int, int]) -> bool:
        """Whether layers i..j on `submesh` are the whole step on every device."""
        return i == 0 and j == self.num_layers - 1 and submesh[0] * submesh[1] == \
            self.num_devices


def prepare(split: pipeline.SplitStep, method: PipelineMethod, cluster: ClusterSpec,
            device_ids: Sequence[int], *, batch_size: int | None,
            state_bytes_per_param_byte: float) -> SearchContext:
    """Cuts the split step's forward into layers (`passes.layering`) and fixes what the
    search reads; raises `NoStageLayoutError` when the method's stages cannot be had (more
    stages than layers) or no layout can fit (the parameters, their gradients and optimizer
    state over every device exceed the budget), before any layer is priced."""
    graph = split.forward_graph()
    params = frozenset(graph.invars[j] for j in split.diff_inputs)
    n = len(device_ids)
    hosts = cluster.num_hosts if n == cluster.num_devices else 1
    per_host = n // hosts
    layout = method.stage_layout(n, per_host)
    lay = layering.run(graph, layout.layer_num, min_layers=layout.min_layers)
    if layout.num_stages is not None and layout.num_stages > lay.num_layers:
        raise NoStageLayoutError(f"{type(method).__name__}: {layout.num_stages} stages need "
                                 f"at least as many layers, the forward has "
                                 f"{lay.num_layers}")
    ranges = lay.eqn_ranges()
    budget = method.memory_budget_bytes or cluster.memory_bytes
    # Fail now rather than after pricing every stage (minutes on large clusters).
    param_bytes = float(sum(graph.values[v].nbytes for v in params))
    floor = state_floor_bytes(param_bytes, state_bytes_per_param_byte, n)
    if floor > budget:
        raise NoStageLayoutError(
            f"no stage layout fits: the parameters ({format_bytes(param_bytes)}), their "
            f"gradients and the optimizer state ({state_bytes_per_param_byte:.3g} bytes per "
            f"parameter byte) need {format_bytes(floor)} per device even split over all "
            f"{n} devices; the budget is {format_bytes(budget)} per device")
    # The layer ILPs price each parameter's update at its layout: split where that pays
    # (or always, for a fixed layout); a stage may then split every parameter's state when
    # its memory needs it (`StageCosts.options`).
    zero = method.shard_optimizer_state
    modes = (("all",) if zero and layout.fixed_state_split else ("paying", "all") if zero
             else ("none",))
    splits = {m: StateSplit(m, state_bytes_per_param_byte, cluster) for m in modes}
    layer_kw = dict(solver=method.solver, batch_size=batch_size,
                    time_limit_s=min(method.time_limit_s, LAYER_TIME_LIMIT_S),
                    retry_time_limit_s=min(method.time_limit_s, LAYER_RETRY_TIME_LIMIT_S),
                    update=splits[modes[0]])
    # A layer's variants: rematerialized or not (`always_remat`: every layer is; with
    # `search_remat` the stage search may rematerialize some where memory needs it).
    always_remat = split.remat or layout.remat is True
    return SearchContext(
        graph=graph, diff=frozenset(diff_values(split, graph)), params=params, layering=lay,
        ranges=ranges, programs=tuple(pipeline.stage_programs(graph, [a for a, _ in ranges[1:]])),
        method=method, cluster=cluster, layout=layout, device_ids=tuple(device_ids),
        hosts=hosts, per_host=per_host, budget=budget, modes=modes, splits=splits,
        state_bytes_per_param_byte=state_bytes_per_param_byte, always_remat=always_remat,
        search_remat=layout.remat == "auto" and not always_remat, layer_kw=layer_kw)
