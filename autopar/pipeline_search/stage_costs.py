"""The stage DP's cost of a layer range on a sub-mesh (`StageCosts`): the range's layers'
solutions on one logical mesh, aligned to each other, under each optimizer-state mode,
the fastest that fits the device's memory at the first trade-off level where one does
(or by rematerializing some layers), and its received activations.  What the DP priced is
kept for the micro-batch bound (`StageCostTable`)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autopar import pipeline

from .context import SearchContext
from .layer_cost import LayerCost, _own_edges
from .layer_solutions import AFTER_OWN, AFTER_TARGETS, LayerSolutions
from .stage_memory import internal_reshard_s, stage_memory_bytes, updates_s
from .state import LEAN, StateSplit
from .transfers import least_transfer_s, transfer_s

#: A layer range (first, last layer) on a sub-mesh shape (hosts, devices per host).
RangeKey = tuple[int, int, tuple[int, int]]


#: The most equations of F a stage may have to be solved as one program
#: (`StageCosts.joint_alternatives`): a bound on that ILP's size, about one layer ILP of
#: the zoo's GPTs (their layers: 206-363 equations), so a joint solve costs about one more
#: such solve per stage; larger stages (GPT-39B's of 2 layers: 618 equations and up) keep
#: their layer solutions, whose identical layers share one solve.
JOINT_MAX_EQNS = 400


@dataclasses.dataclass(frozen=True)
class StageCostTable:
    """What one pipeline search's stage DP priced (`recording`), for `num_micro_batches`
    micro-batches of the step: per layer range and sub-mesh it asked, the seconds per
    micro-batch of the range's fastest time-optimal layouts on it (memory not checked) with
    its activations received as fast as they can be (None: no such layout), and the step
    seconds of the plan of layer solutions (`Plan.predicted` unless the assembly solved a
    stage's layers as one program: `SearchReport.layered_step_s`).  Every stage of layer
    solutions a plan can hold takes at least that long.

    `fixed_s`: per layer range and sub-mesh, seconds per micro-batch of that least time
    that no layout goes below and no micro-batch count changes (its layers'
    `LayerCost.fixed_floor_s`; absent: 0), which a bound for more micro-batches keeps
    unscaled (`micro_batches.lower_bound_s`).  `cross_s`: per range on a sub-mesh inside
    one host of a cluster of several, its least time when the stage before it is on
    another host (what the range reads from the layer before it arrives over the link
    between hosts); absent: the same as `least_s`.  `tied_s`: per sub-mesh of the last
    stage of a pipeline of several, the least seconds per step of moving the parameters
    the first and the last layer both read to it and their gradients back (absent: 0)."""

    num_micro_batches: int
    num_layers: int
    num_devices: int
    submeshes: tuple[tuple[int, int], ...]
    num_stages: int | None
    least_s: Mapping[RangeKey, float | None]
    step_s: float
    fixed_s: Mapping[RangeKey, float] = dataclasses.field(default_factory=dict)
    cross_s: Mapping[RangeKey, float] = dataclasses.field(default_factory=dict)
    tied_s: Mapping[tuple[int, int], float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"num_micro_batches": self.num_micro_batches, "num_layers": self.num_layers,
                "num_devices": self.num_devices, "submeshes": [list(s) for s in self.submeshes],
                "num_stages": self.num_stages, "step_s": self.step_s,
                "least_s": [[i, j, *sub, c] for (i, j, sub), c in self.least_s.items()],
                "fixed_s": [[i, j, *sub, c] for (i, j, sub), c in self.fixed_s.items()],
                "cross_s": [[i, j, *sub, c] for (i, j, sub), c in self.cross_s.items()],
                "tied_s": [[*sub, c] for sub, c in self.tied_s.items()]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> StageCostTable:
        return StageCostTable(
            d["num_micro_batches"], d["num_layers"], d["num_devices"],
            tuple((h, m) for h, m in d["submeshes"]), d["num_stages"],
            {(i, j, (h, m)): c for i, j, h, m, c in d["least_s"]}, d["step_s"],
            {(i, j, (h, m)): c for i, j, h, m, c in d.get("fixed_s", [])},
            {(i, j, (h, m)): c for i, j, h, m, c in d.get("cross_s", [])},
            {(h, m): c for h, m, c in d.get("tied_s", [])})


@dataclasses.dataclass(frozen=True)
class StageEstimate:
    """Layers of a stage priced on one logical mesh: their solutions, programs and the
    stage's seconds per micro-batch (layers + resharding between them + amortized update,
    transfers from other stages not included).  `zero`: which parameters' optimizer state
    is split (ZeRO-2), their parameters all-gathered after the update."""

    priced: list[LayerCost]
    programs: list[pipeline.StageProgram]
    cost_s: float
    zero: StateSplit | None = None
    # Per layer, whether it is rematerialized (the variant `priced` solved).
    remat: tuple[bool, ...] = ()


def _same_solutions(a: Sequence[LayerCost], b: Sequence[LayerCost]) -> bool:
    """Whether two chains of a stage's layer solutions are the same solutions."""
    return all(x is y for x, y in zip(a, b, strict=True))


def _least(count: int, ok: Callable[[int], bool]) -> int | None:
    """The least r in 1..`count` with `ok(r)`, `ok` taken as monotone (false, then true:
    bisected); None when `ok(count)` is false."""
    if count < 1 or not ok(count):
        return None
    lo, hi = 1, count
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


class StageCosts:
    """Layer ranges as stages on sub-meshes, priced from `layers`' solutions."""

    def __init__(self, ctx: SearchContext, layers: LayerSolutions):
        self.ctx = ctx
        self.layers = layers
        self._range_costs: dict[RangeKey, float | None] = {}
        # Per layer range and sub-mesh: its fastest time-optimal option's seconds per
        # micro-batch, memory not checked (None: no option), for `StageCostTable`.
        self._free_costs: dict[RangeKey, float | None] = {}
        self._activations = {o for e in ctx.graph.eqns for o in e.outputs}
        self._received: dict[tuple[int, int], list[int]] = {}

    def options(self, i: int, j: int, submesh: tuple[int, int], level: int = 0
                ) -> list[StageEstimate]:
        """Layers i..j on `submesh`, one estimate per logical shape (all layers of a stage
        share its mesh) and optimizer-state mode: their solutions at trade-off `level`."""
        progs = list(self.ctx.programs[i:j + 1])
        options = [self.layers.options(k, submesh, level) for k in range(i, j + 1)]
        out = []
        for shape in options[0]:
            if any(shape not in o for o in options):
                continue
            free = [o[shape] for o in options]
            chained = [self.layers.aligned(i, j, submesh, level, shape, free, AFTER_OWN)]
            if not _same_solutions(chained[0], free):
                # The look-ahead chain re-solved a layer: its neighbours' own layouts
                # disagree, so also try the other targets (`AFTER_TARGETS`), each chain
                # that differs from those before it once.
                for after in AFTER_TARGETS[1:]:
                    chain = self.layers.aligned(i, j, submesh, level, shape, free, after)
                    if not any(_same_solutions(seen, chain) for seen in chained):
                        chained.append(chain)
            for priced in chained:
                out += self._estimates(i, submesh, priced, progs,
                                       (self.ctx.always_remat,) * len(priced))
        return out

    def _estimates(self, i: int, submesh: tuple[int, int], priced: list[LayerCost],
                   progs: list[pipeline.StageProgram], remat: tuple[bool, ...]
                   ) -> list[StageEstimate]:
        """The stage of layers i.. with these solutions, one estimate per optimizer-state
        mode.  The layer ILPs priced the updates under the first mode (splitting where it
        pays), once per layer reading a parameter: the stage takes theirs off and prices
        its own, each parameter once, under each mode ("all": every state split, for
        memory)."""
        layers_s = (sum(p.cost_s for p in priced) + internal_reshard_s(priced, progs,
                                                                       self.ctx.graph)
                    - sum(self.layers.updates_s(k, submesh, p)
                          for k, p in enumerate(priced, start=i)))
        return self._per_mode(priced, progs, layers_s, remat)

    def _per_mode(self, priced: list[LayerCost], progs: list[pipeline.StageProgram],
                  layers_s: float, remat: tuple[bool, ...]) -> list[StageEstimate]:
        """The stage of these solutions, `layers_s` seconds per micro-batch without its
        updates, under each optimizer-state mode (its updates priced under that mode)."""
        ctx = self.ctx
        return [StageEstimate(priced, progs,
                               layers_s + updates_s(priced, progs, ctx.params, ctx.graph,
                                                    ctx.splits[m], ctx.micro),
                               ctx.splits[m], remat) for m in ctx.modes]

    def joinable(self, i: int, j: int) -> bool:
        """Whether layers i..j may be solved as one program (`joint_alternatives`)."""
        return i < j and self.ctx.ranges[j][1] - self.ctx.ranges[i][0] <= JOINT_MAX_EQNS

    def joint_alternatives(self, i: int, j: int, submesh: tuple[int, int], in_flight: int,
                           shape: tuple[int, ...]) -> list[StageEstimate]:
        """Layers i..j solved as one program by one ILP on logical mesh `shape`
        (`LayerSolutions.joint`), which sees all the stage's equations at once where each
        layer's own ILP saw only its part: its fastest optimizer-state mode that fits with
        `in_flight` micro-batches in flight.  None for one layer, or for a range of more
        than `JOINT_MAX_EQNS` equations."""
        ctx = self.ctx
        if not self.joinable(i, j):
            return []
        prog, solved = self.layers.joint(i, j, submesh, shape)
        whole = ctx.whole(i, j, submesh)
        out = []
        for p in solved.values():
            charged = updates_s([p], [prog], ctx.params, ctx.graph, ctx.splits[ctx.modes[0]],
                                ctx.micro, per_layer=True)
            fit = [o for o in self._per_mode([p], [prog], p.cost_s - charged,
                                             (ctx.always_remat,))
                   if self.fits(o, in_flight, whole)]
            if fit:
                out.append(min(fit, key=lambda o: o.cost_s))
        return sorted(out, key=lambda o: o.cost_s)

    def _rematerialized(self, i: int, j: int, submesh: tuple[int, int], level: int,
                        options: list[StageEstimate], in_flight: int, whole: bool
                        ) -> StageEstimate | None:
        """The fastest stage of layers i..j at trade-off `level` (`options`: its `options`
        there) that fits by rematerializing some of its layers: per logical shape and
        optimizer-state mode, the layers ranked by the residual bytes their
        rematerialization frees per second it adds, the fewest of the first of them that
        make the stage fit (memory falls as more are rematerialized: bisected)."""
        progs = list(self.ctx.programs[i:j + 1])
        # Per logical shape, the layers' solutions in the stage's fastest option on it.
        plain: dict[tuple[int, ...], StageEstimate] = {}
        for o in options:
            shape = o.priced[0].mesh.shape
            if shape not in plain or o.cost_s < plain[shape].cost_s:
                plain[shape] = o
        again = [self.layers.options(k, submesh, level, remat=True) for k in range(i, j + 1)]
        best = None
        for shape, fastest in plain.items():
            if any(shape not in o for o in again):
                continue
            kept = fastest.priced
            # Each layer's rematerialized solution aligned to its own kept one at the
            # layer's edges (its neighbours may keep theirs).
            redone = [self.layers.align(k, submesh, level, shape, o[shape],
                                        *_own_edges(kept[k - i], progs[k - i], self.ctx.params),
                                        remat=True)
                      for k, o in enumerate(again, start=i)]
            freed = [(k, kept[k].residual_bytes - redone[k].residual_bytes,
                      redone[k].cost_s - kept[k].cost_s) for k in range(len(kept))]
            order = [k for k, b, _ in sorted((f for f in freed if f[1] > 0),
                                             key=lambda f: -f[1] / max(f[2], 1e-12))]
            for m in range(len(self.ctx.modes)):
                option = functools.partial(self._mixed, i, submesh, progs, kept, redone,
                                           order, m)
                r = _least(len(order), lambda r, option=option: self.fits(
                    option(r), in_flight, whole))
                found = option(r) if r is not None else None
                if found is not None and (best is None or found.cost_s < best.cost_s):
                    best = found
        return best

    def _mixed(self, i: int, submesh: tuple[int, int], progs: list[pipeline.StageProgram],
               kept: list[LayerCost], redone: list[LayerCost], order: list[int], mode: int,
               r: int) -> StageEstimate:
        """The stage of layers i.. with the first `r` layers of `order` rematerialized
        (`redone`'s solutions) and the rest not (`kept`'s), under optimizer-state mode
        `modes[mode]`."""
        chosen = set(order[:r])
        priced = [redone[k] if k in chosen else kept[k] for k in range(len(kept))]
        return self._estimates(i, submesh, priced, progs,
                               tuple(k in chosen for k in range(len(kept))))[mode]

    def fits(self, o: StageEstimate, in_flight: int, whole: bool) -> bool:
        """Whether the stage fits the budget with `in_flight` micro-batches' residuals
        (`whole`: it is the whole step on every device)."""
        ctx = self.ctx
        return stage_memory_bytes(o.priced, o.programs, ctx.params, ctx.graph, ctx.micro,
                                  in_flight, ctx.state_bytes_per_param_byte, o.zero,
                                  whole_step=whole) <= ctx.budget

    def _fitting(self, options: list[StageEstimate], in_flight: int, whole: bool
                 ) -> StageEstimate | None:
        # The fastest first (ties in the given order): the memory of the faster options
        # only is estimated, where the first usually fits.
        return next((o for o in sorted(options, key=lambda o: o.cost_s)
                     if self.fits(o, in_flight, whole)), None)

    def fitting(self, i: int, j: int, submesh: tuple[int, int], in_flight: int
                ) -> StageEstimate | None:
        """The fastest option of layers i..j that fits at the first trade-off level where
        one does (time-optimal, then each memory price, then lean); with `search_remat`,
        at each level before it, the fastest that fits by rematerializing some layers
        (`_rematerialized`) too, while such an option is faster than the level's fastest
        option memory unchecked."""
        whole = self.ctx.whole(i, j, submesh)
        found: list[StageEstimate] = []
        for level in range(LEAN + 1):
            if 0 < level < LEAN and self.layers.knee(submesh) is None:
                continue    # no layer trades time for memory here: nothing in between
            options = self.options(i, j, submesh, level)
            if not level:
                self._free_costs.setdefault((i, j, submesh),
                                            min((o.cost_s for o in options), default=None))
            if found and min((o.cost_s for o in options), default=math.inf) >= min(
                    o.cost_s for o in found):
                break   # nothing at this level or leaner beats the rematerialized stage
            best = self._fitting(options, in_flight, whole)
            if best is not None:
                found.append(best)
                break
            if self.ctx.search_remat:
                best = self._rematerialized(i, j, submesh, level, options, in_flight, whole)
                if best is not None:
                    found.append(best)
        return min(found, key=lambda o: o.cost_s) if found else None

    def alternatives(self, i: int, j: int, submesh: tuple[int, int], in_flight: int
                     ) -> list[StageEstimate]:
        """Layers i..j's time-optimal options on `submesh` that fit with `in_flight`
        micro-batches in flight, the fastest on each logical mesh."""
        whole = self.ctx.whole(i, j, submesh)
        per_mesh: dict[tuple[int, ...], StageEstimate] = {}
        for o in self.options(i, j, submesh):
            shape = o.priced[0].mesh.shape
            if (shape not in per_mesh or o.cost_s < per_mesh[shape].cost_s) \
                    and self.fits(o, in_flight, whole):
                per_mesh[shape] = o
        return sorted(per_mesh.values(), key=lambda o: o.cost_s)

    def range_cost(self, i: int, j: int, submesh: tuple[int, int]) -> float | None:
        """Seconds per micro-batch of layers i..j as one stage on `submesh` (the stage DP's
        cost; asked again by the DPs over one sub-mesh shape).

        The stage's position is not known here: it assumes as many stages in flight as
        stages of this size would fill the devices, and its inputs arriving over the
        slowest link of the cluster."""
        key = (i, j, submesh)
        if key not in self._range_costs:
            ctx = self.ctx
            size = submesh[0] * submesh[1]
            best = self.fitting(i, j, submesh,
                                ctx.micro if ctx.gpipe else max(1, ctx.num_devices // size))
            self._range_costs[key] = None if best is None else best.cost_s + sum(
                transfer_s(ctx.graph.values[v].nbytes, size, size, ctx.link) * (1 + (v in ctx.diff))
                for v in self._received_values(i, j))
        return self._range_costs[key]

    def _received_values(self, i: int, j: int) -> list[int]:
        """The activations layers i..j read from the layers before them."""
        if (i, j) not in self._received:
            ranges = self.ctx.ranges
            prog = pipeline.program_for_range(self.ctx.graph, ranges[i][0], ranges[j][1])
            self._received[(i, j)] = [v for v in prog.inputs if v in self._activations]
        return self._received[(i, j)]

    def _least_stage_s(self, i: int, j: int, submesh: tuple[int, int], cross: bool = False
                       ) -> float | None:
        """Seconds per micro-batch layers i..j take at least as a stage on `submesh`: its
        fastest time-optimal option (None: none) and its received activations and their
        cotangents arriving as fast as they can (`least_transfer_s`); with `cross`, those
        made by layer i - 1 (the stage before's last) from another host."""
        ctx = self.ctx
        layers_s = self._free_costs.get((i, j, submesh))
        if layers_s is None:
            return None
        before = range(*ctx.ranges[i - 1]) if cross and i > 0 else range(0)
        return layers_s + sum(
            least_transfer_s(submesh, ctx.graph.values[v].nbytes, ctx.hosts, ctx.per_host,
                             ctx.cluster, cross=ctx.graph.values[v].producer in before)
            * (1 + (v in ctx.diff)) for v in self._received_values(i, j))

    def _tied_step_s(self, submesh: tuple[int, int]) -> float:
        """Seconds per step a pipeline of several stages, its last on `submesh`, spends at
        least moving the parameters that the first and the last layer both read (a tied
        embedding) from the first stage to the last, and their gradients back: each device
        of the receiving stage copies at least its share (`least_transfer_s`; the first
        stage has at most the devices the last leaves)."""
        ctx = self.ctx
        n, size = ctx.num_devices, submesh[0] * submesh[1]
        shared = set(ctx.programs[0].inputs) & set(ctx.programs[-1].inputs) & ctx.params
        if ctx.num_layers < 2 or size >= n:
            return 0.0
        return sum(
            least_transfer_s(submesh, ctx.graph.values[v].nbytes, ctx.hosts, ctx.per_host,
                             ctx.cluster)
            + (least_transfer_s(submesh, ctx.graph.values[v].nbytes * size / (n - size),
                                ctx.hosts, ctx.per_host, ctx.cluster) if v in ctx.diff else 0.0)
            for v in sorted(shared))

    def _crossing(self, i: int, j: int, submesh: tuple[int, int]) -> bool:
        """Whether layers i..j on `submesh` can receive from the stage before on the same
        host or on another (`StageCostTable.cross_s`)."""
        return (self.ctx.hosts > 1 and submesh[1] < self.ctx.per_host and i > 0
                and self._free_costs.get((i, j, submesh)) is not None)

    def _fixed_stage_s(self, i: int, j: int, submesh: tuple[int, int]) -> float:
        """Seconds per micro-batch of `_least_stage_s(i, j, submesh)` that no layout and no
        micro-batch count changes: the layers' `LayerCost.fixed_floor_s` (the least over
        the logical shapes of each layer's time-optimal solutions; 0 where none)."""
        return sum(min((p.fixed_floor_s for p in self.layers.options(k, submesh).values()),
                       default=0.0) for k in range(i, j + 1))

    def table(self, step_s: float) -> StageCostTable:
        """What the stage DP priced, for a plan predicted at `step_s` seconds per step."""
        ctx = self.ctx
        keys = list(self._free_costs)
        return StageCostTable(
            ctx.micro, ctx.num_layers, ctx.num_devices, tuple(ctx.submeshes),
            ctx.layout.num_stages, {key: self._least_stage_s(*key) for key in keys},
            step_s, {key: self._fixed_stage_s(*key) for key in keys},
            {key: self._least_stage_s(*key, cross=True) for key in keys
             if self._crossing(*key)},
            {sub: t for sub in ctx.submeshes if (t := self._tied_step_s(sub))})
