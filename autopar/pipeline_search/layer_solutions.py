"""The second phase of a pipeline search: every layer's forward+backward solved on every
sub-mesh and logical mesh the stages may use (`LayerSolutions`), at each memory trade-off
level, and aligned to its neighbours in a stage where that is cheaper.

Identical layers (the same program text, `reuse._program_key`) share one trace and one
solve; the solves run side by side in one `SolvePool`, started ahead and waited on when a
stage's cost asks for them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from autopar import pipeline
from autopar.layer import LayerProgram
from autopar.passes import intra_op
from autopar.passes.sharding_spec import Spec
from autopar.planner import WatchedSubmit
from autopar.solve_pool import SolvePool

from .context import SearchContext
from .layer_cost import LayerCost, Neighbours, _held_bytes, neighbour_reshard_s, start_price_stage
from .reuse import _program_key, _SameProblems
from .stage_memory import updates_s
from .state import KNEE_FRACTIONS, LEAN, _level_name, knee_price

#: What a stage's layers are aligned to on the side of the next layer (`LayerSolutions.
#: aligned`), besides what the layer before made: the layouts the next layer's own
#: solution reads; none (each layer follows what it receives); every value the next layer
#: reads replicated, a boundary every layer can meet.  Where the layers' own layouts agree,
#: the first leaves them as they are and the others are not tried; where they disagree at
#: every boundary (2 rows of a micro-batch split by some layers and not by others), the
#: first can pay a reshard at every layer and another target gives the faster stage.
AFTER_OWN, AFTER_NONE, AFTER_WHOLE = "own", "none", "whole"


AFTER_TARGETS = (AFTER_OWN, AFTER_NONE, AFTER_WHOLE)


#: What a layer's edges are laid out as, per value id: (its spec, its cotangent's or None).
Edges = dict[int, tuple[Spec, Spec | None]]


class LayerSolutions:
    """Every layer's solutions of one search, solved once each and kept.

    A layer is solved per sub-mesh, trade-off level (0 time-optimal, 1.. `KNEE_FRACTIONS`
    memory prices, `LEAN` parameters cut as finely as they go) and variant (rematerialized
    or not); `options` gives its solution per logical mesh shape.  Owns the solver pool:
    `close` it (after the last solve asked for)."""

    def __init__(self, ctx: SearchContext, progress: Callable[[str], None] | None = None):
        self.ctx = ctx
        self._progress = progress
        self._cache: dict[tuple[str, tuple[int, int], int, bool],
                          dict[tuple[int, ...], LayerCost]] = {}
        self._started: dict[tuple[str, tuple[int, int], int, bool], Callable[[], dict]] = {}
        self._seen: set[tuple[int, tuple[int, int]]] = set()
        self._pairs = ctx.num_layers * len(ctx.priced_submeshes)
        self._keys: dict[int, str] = {}
        # Identical layers share one trace of their forward+backward (that of the first),
        # one per variant (rematerialized or not).
        self._traced: dict[tuple[str, bool], tuple[pipeline.StageProgram, LayerProgram]] = {}
        self._pool = SolvePool()
        # waits on answers bounded by the pool's progress; a problem identical to one
        # already handed over shares its answer (`_SameProblems`)
        self._submit = WatchedSubmit(_SameProblems(self._pool.submit))
        # A layer's memory-priced and lean ILPs are its time-optimal twin with other
        # parameter costs: one build each.
        self._builds = intra_op.BuildCache()
        self._leaner: set[tuple[tuple[int, int], int, bool]] = set()
        self._knees: dict[tuple[int, int], float | None] = {}
        # Per (first layer, sub-mesh, level, logical shape, target): the chain's solutions
        # of layers with a next layer in the stage so far (each depends only on those
        # before it and the next layer's own solution, so a longer range extends a shorter
        # one), and what they make.
        self._chains: dict[tuple, tuple[list[LayerCost], Edges]] = {}
        self._neighbour_solves: dict[tuple, LayerCost | None] = {}
        self._updates: dict[tuple[int, tuple[int, int], tuple[int, ...], int], float] = {}
        # Per (first layer, last layer, sub-mesh, logical shape): the range as one program
        # and its key; per key, the call that waits for its solution until `joint` asks,
        # then the solution (as `_started` and `_cache` for layers).
        self._joint: dict[tuple, tuple[pipeline.StageProgram, tuple]] = {}
        self._joint_started: dict[tuple, Callable[[], dict[tuple[int, ...], LayerCost]]] = {}
        self._joint_solved: dict[tuple, dict[tuple[int, ...], LayerCost]] = {}

    @property
    def solves(self) -> int:
        """Distinct layer solves asked for (program, sub-mesh, level, variant)."""
        return len(self._cache)

    def close(self, cancel: bool = False) -> None:
        """Closes the pool: waits for solves still queued (their answers are cached), or
        with `cancel` drops them."""
        self._pool.close(cancel=cancel)

    def start_all(self) -> None:
        """Hands every layer's time-optimal ILPs on every sub-mesh in play to the pool, so
        it solves them while the rest are built (and the stage DP then waits on them)."""
        for submesh in self.ctx.priced_submeshes:
            for layer in range(self.ctx.num_layers):
                self.start(layer, submesh)

    def program_key(self, layer: int) -> str:
        if layer not in self._keys:
            self._keys[layer] = _program_key(self.ctx.graph, self.ctx.programs[layer],
                                             self.ctx.diff)
        return self._keys[layer]

    def start(self, layer: int, submesh: tuple[int, int], level: int = 0, remat: bool = False
              ) -> tuple[str, tuple[int, int], int, bool]:
        """Builds the layer's ILPs on `submesh` at trade-off `level`, rematerialized with
        `remat` (or `always_remat`), and hands them to the pool, once per distinct layer
        program, sub-mesh, level and variant; returns the cache key."""
        pkey = self.program_key(layer)
        remat = remat or self.ctx.always_remat
        key = (pkey, submesh, level, remat)
        if not level and remat == self.ctx.always_remat:
            self._seen.add((layer, submesh))
        if key not in self._cache and key not in self._started:
            if self._progress:
                what = " rematerialized" if remat and not self.ctx.always_remat else ""
                self._progress(
                    f"layer ILP {len(self._seen)}/{self._pairs}: layer {layer} on sub-mesh "
                    f"{submesh}" if not level and not what else
                    f"{_level_name(level)}{what} layer ILP: layer {layer} on sub-mesh "
                    f"{submesh} (the faster stages do not fit)")
            prog, traced = self.traced(layer, remat)
            self._started[key] = self._start_ilps(prog, traced, submesh, level,
                                                  self.ctx.fixed_shape)
        return key

    def traced(self, layer: int, remat: bool) -> tuple[pipeline.StageProgram, LayerProgram]:
        """The first layer with layer `layer`'s program, and its forward+backward traced
        (rematerialized with `remat`)."""
        tkey = (self.program_key(layer), remat)
        if tkey not in self._traced:
            prog = self.ctx.programs[layer]
            self._traced[tkey] = (prog, LayerProgram.build(self.ctx.graph, prog, self.ctx.diff,
                                                           remat=remat))
        return self._traced[tkey]

    def _start_ilps(self, prog: pipeline.StageProgram, traced: LayerProgram,
                    submesh: tuple[int, int], level: int,
                    shapes: Sequence[tuple[int, ...]] | None,
                    neighbours: Neighbours | None = None
                    ) -> Callable[[], dict[tuple[int, ...], LayerCost]]:
        """`start_price_stage` of one layer program at trade-off `level`."""
        ctx = self.ctx
        return start_price_stage(
            ctx.graph, prog, ctx.diff, ctx.cluster, submesh,
            forced_batch_axis=ctx.layout.batch_axis, shapes=shapes, remat=traced.fn.remat,
            num_micro_batches=ctx.micro, layer=traced, submit=self._submit,
            lean=level == LEAN,
            memory_price=(KNEE_FRACTIONS[level - 1] * self.knee(submesh)
                          if 0 < level < LEAN else 0.0),
            builds=self._builds, neighbours=neighbours, **ctx.layer_kw)

    def options(self, layer: int, submesh: tuple[int, int], level: int = 0,
                remat: bool = False) -> dict[tuple[int, ...], LayerCost]:
        """The layer's solutions on `submesh` per logical mesh shape (waits for them)."""
        key = self.start(layer, submesh, level, remat)
        if (level or remat) and (submesh, level, remat) not in self._leaner:
            # The faster stages do not fit on this sub-mesh: the stage DP will ask for this
            # level's options of most layers here, so the pool solves them side by side
            # rather than one at a time as they are asked for.
            self._leaner.add((submesh, level, remat))
            for k in range(self.ctx.num_layers):
                self.start(k, submesh, level, remat)
        if key not in self._cache:
            # A lean solve that cannot cut every parameter finely carries the penalty:
            # that logical shape has no lean option.
            self._cache[key] = {shape: p for shape, p in self._started.pop(key)().items()
                                if not p.penalized}
            if self._progress and self._cache[key]:
                best = min(self._cache[key].values(), key=lambda p: p.cost_s)
                self._progress(f"layer ILP {len(self._cache)} solved: layer {layer} on "
                               f"sub-mesh {submesh}, best {best.cost_s * 1e3:.3f} ms/mb on "
                               f"{best.mesh.shape}")
        return self._cache[key]

    def start_joint(self, i: int, j: int, submesh: tuple[int, int],
                    shape: tuple[int, ...]) -> None:
        """Layers i..j as one program (their equations together), its forward+backward's
        time-optimal ILP on `submesh` as logical mesh `shape` (the stage's variant:
        rematerialized with `always_remat`) handed to the pool (`joint` waits for it):
        once per distinct program, sub-mesh and shape, as for layers
        (`reuse._program_key`)."""
        if (i, j, submesh, shape) in self._joint:
            return
        ctx = self.ctx
        prog = pipeline.program_for_range(ctx.graph, ctx.ranges[i][0], ctx.ranges[j][1])
        key = (_program_key(ctx.graph, prog, ctx.diff), submesh, shape)
        if key not in self._joint_started and key not in self._joint_solved:
            if self._progress:
                self._progress(f"stage ILP: layers {i}-{j} as one program on sub-mesh "
                               f"{submesh}, logical mesh {shape}")
            traced = LayerProgram.build(ctx.graph, prog, ctx.diff, remat=ctx.always_remat)
            self._joint_started[key] = self._start_ilps(prog, traced, submesh, 0, [shape])
        self._joint[(i, j, submesh, shape)] = (prog, key)

    def joint(self, i: int, j: int, submesh: tuple[int, int], shape: tuple[int, ...]
              ) -> tuple[pipeline.StageProgram, dict[tuple[int, ...], LayerCost]]:
        """Layers i..j as one program and its solution on logical mesh `shape` (none
        where it carries a penalty; `start_joint`, waits for it):
        `StageCosts.joint_alternatives`."""
        self.start_joint(i, j, submesh, shape)
        prog, key = self._joint[(i, j, submesh, shape)]
        if key not in self._joint_solved:
            self._joint_solved[key] = {mesh: p for mesh, p
                                       in self._joint_started.pop(key)().items()
                                       if not p.penalized}
        return prog, self._joint_solved[key]

    def knee(self, submesh: tuple[int, int]) -> float | None:
        """`knee_price` of the layers' time-optimal and lean solutions on `submesh` (every
        logical shape both have); solves the lean ones first if they are not yet."""
        if submesh not in self._knees:
            ctx = self.ctx
            update = ctx.splits[ctx.modes[0]]
            pairs = []
            for layer in range(ctx.num_layers):
                fast, lean = self.options(layer, submesh), self.options(layer, submesh, LEAN)
                prog = ctx.programs[layer]
                for shape in fast.keys() & lean.keys():
                    f, m = fast[shape], lean[shape]
                    pairs.append((f.cost_s, _held_bytes(f, prog, ctx.params, ctx.graph, update),
                                  m.cost_s, _held_bytes(m, prog, ctx.params, ctx.graph, update)))
            self._knees[submesh] = knee_price(pairs)
        return self._knees[submesh]

    def aligned(self, i: int, j: int, submesh: tuple[int, int], level: int,
                shape: tuple[int, ...], free: list[LayerCost], after: str) -> list[LayerCost]:
        """Layers i..j's solutions on `shape`, each aligned where that is cheaper (`align`)
        to what the layer before made and to the layouts `after` names for what the next
        layer reads (`AFTER_TARGETS`).

        Each layer's ILP chose the layouts of the values it shares with its neighbours
        freely; where that leaves resharding, the layer is solved again paying for it
        (`start_price_stage`'s `neighbours`), and the stage takes whichever of the two
        costs less with the resharding."""
        programs = self.ctx.programs
        inner, made = self._chains.setdefault((i, submesh, level, shape, after), ([], {}))

        def before(k: int) -> Edges:
            return {vid: made[vid] for vid in programs[k].inputs if vid in made}

        for k in range(i + len(inner), j):
            p = self.align(k, submesh, level, shape, free[k - i], before(k),
                           self._targets(k, submesh, level, shape, after))
            inner.append(p)
            for n, vid in enumerate(programs[k].outputs):
                made[vid] = (p.output_specs[n], p.ct_in_specs[n] if p.ct_in_specs else None)
        last = self.align(j, submesh, level, shape, free[j - i], before(j), {})
        return inner[:j - i] + [last]

    def _reads_after(self, k: int, submesh: tuple[int, int], level: int,
                     shape: tuple[int, ...]) -> Edges:
        """Layer k's outputs that layer k + 1 reads: the spec its own solution reads each
        in and gives its cotangent in."""
        if k + 1 >= self.ctx.num_layers:
            return {}
        nxt = self.options(k + 1, submesh, level).get(shape)
        if nxt is None:
            return {}
        prog = self.ctx.programs[k + 1]
        made = set(self.ctx.programs[k].outputs)
        return {vid: (nxt.input_specs[n], nxt.ct_out_specs[n] if nxt.ct_out_specs else None)
                for n, vid in enumerate(prog.inputs) if vid in made}

    def _targets(self, k: int, submesh: tuple[int, int], level: int, shape: tuple[int, ...],
                 after: str) -> Edges:
        """Layer k's outputs that layer k + 1 reads, with the layouts `after` aligns them
        to (`AFTER_TARGETS`)."""
        ctx = self.ctx
        if after == AFTER_OWN:
            return self._reads_after(k, submesh, level, shape)
        if after == AFTER_NONE or k + 1 >= ctx.num_layers:
            return {}
        made = set(ctx.programs[k].outputs)
        return {vid: (whole, whole if vid in ctx.diff else None)
                for vid in ctx.programs[k + 1].inputs if vid in made
                for whole in [((),) * ctx.graph.values[vid].ndim]}

    def align(self, k: int, submesh: tuple[int, int], level: int, shape: tuple[int, ...],
              free: LayerCost, before: Edges, after: Edges, remat: bool = False) -> LayerCost:
        """`free`, or layer k solved again paying for resharding to `before` and `after`
        (`Neighbours`), whichever costs less with that resharding (the rematerialized
        variant with `remat`)."""
        ctx = self.ctx
        prog = ctx.programs[k]
        sides = Neighbours(before, after)
        if not sides or neighbour_reshard_s(free, prog, ctx.graph, sides) <= 0.0:
            return free
        # Identical layers share the first one's trace and solve: its value ids.
        pkey = self.program_key(k)
        first, traced = self.traced(k, remat or ctx.always_remat)
        renamed = sides.renamed(dict(zip(prog.inputs, first.inputs)),
                                dict(zip(prog.outputs, first.outputs)))
        key = (pkey, submesh, level, shape, renamed.key(), remat or ctx.always_remat)
        if key not in self._neighbour_solves:
            solved = self._start_ilps(first, traced, submesh, level, [shape],
                                      renamed)().get(shape)
            self._neighbour_solves[key] = solved if solved is not None and \
                not solved.penalized else None
        other = self._neighbour_solves[key]
        if other is None:
            return free
        return min((free, other),
                   key=lambda q: q.cost_s + neighbour_reshard_s(q, prog, ctx.graph, sides))

    def updates_s(self, k: int, submesh: tuple[int, int], p: LayerCost) -> float:
        """The updates layer k's ILP charged (under the first mode) on this logical mesh
        (`p`: a solution kept alive by the caches above, so its id is its own)."""
        key = (k, submesh, p.mesh.shape, id(p))
        if key not in self._updates:
            ctx = self.ctx
            self._updates[key] = updates_s([p], [ctx.programs[k]], ctx.params, ctx.graph,
                                           ctx.splits[ctx.modes[0]], ctx.micro, per_layer=True)
        return self._updates[key]
