"""The intra-op pass's problem under construction (`ProblemBuilder`): one ILP node per
group of values that share a decision, with per-strategy compute and communication
seconds, the resharding edges between groups, the memory terms of each value, and the
memos that let equal equations share their strategies and tables (`MEMOIZE`).
`intra_op` builds one per program and mesh, and reads the solver's answer off it."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from autopar.cost_model import collectives
from autopar.passes.ir import Graph, Lit, Value, is_numeric

from . import fallbacks, primitives
from . import memory as mem
from . import strategies as st
from .sharding_spec import (
    COMBINE_BYTES,
    MeshContext,
    Spec,
    enumerate_specs,
    full_rematerialization,
    gather_first,
    is_slice,
    is_valid,
    replicated,
    reshard_s,
)
from .solver import ShardingProblem


@dataclasses.dataclass
class Group:
    """An ILP node under construction: values that share one decision."""

    num_strategies: int
    names: list[str]
    compute_s: np.ndarray
    comm_s: np.ndarray
    members: list[int] = dataclasses.field(default_factory=list)
    label: str = ""
    # (output value, bytes per device of its unreduced partial sum per strategy)
    partials: list[tuple[int, np.ndarray]] = dataclasses.field(default_factory=list)


def bucket_alpha_s(builder: ProblemBuilder, choice: Sequence[int]) -> float:
    """`IntraOpResult.bucket_alpha_s` of the solution `choice`: the α the last, partly
    filled bucket of the lazily reduced (combined) partial sums pays beyond its pro-rated
    share, on the slowest link of the mesh's split axes."""
    lazy = sum(float(p[choice[g]]) for g, grp in enumerate(builder.groups)
               for vid, p in grp.partials if not builder.buffers.urgent[vid])
    axes = tuple(a for a in builder.mesh.axes if builder.mesh.size(a) > 1)
    if lazy <= 0 or not axes:
        return 0.0
    buckets = lazy / COMBINE_BYTES
    return builder.mesh.group_link(axes).alpha_s * (math.ceil(buckets) - buckets)


def cpu_buffers(mesh: MeshContext) -> bool:
    """`memory.analyze`'s `cpu` argument for a problem on `mesh` (and BuildCache's key for
    sharing that analysis)."""
    return mesh.backend == "cpu"


def scatter_as_all_reduce(mesh: MeshContext) -> bool:
    """Whether `mesh`'s backend runs a reduce-scatter as an all-reduce and a slice
    (`collectives.LOWERINGS`): its result then keeps the unscattered size in memory."""
    return collectives.lowered_kind("reduce-scatter", mesh.backend) == "all-reduce"


def peak_memory(problem: ShardingProblem, choice: Sequence[int]) -> float:
    if problem.num_nodes == 0:
        return 0.0
    horizon = int(problem.intervals[:, 1].max()) + 1
    usage = np.zeros(horizon + 1)
    for v, (s, e) in enumerate(problem.intervals):
        if e > s:
            usage[s] += problem.node_usages[v][choice[v]]
            usage[e] -= problem.node_usages[v][choice[v]]
    return float(np.cumsum(usage).max())


class ProblemBuilder:
    def __init__(self, graph: Graph, mesh: MeshContext, forced: dict[int, Spec],
                 batch_size: int | None, comm_scale: Mapping[int, float] | None = None,
                 buffers: mem.BufferInfo | None = None, dots: dict | None = None,
                 awaited: Collection[int] = ()):
        self.graph = graph
        self.awaited = frozenset(awaited)  # `memory.analyze`'s
        self.mesh = mesh
        self.forced = forced
        self.batch_size = batch_size
        self.comm_scale = dict(comm_scale or {})
        self.groups: list[Group] = []
        self.group_of: dict[int, int] = {}          # value id → group
        self.specs: dict[int, list[Spec]] = {}       # value id → spec per group strategy
        self.fixed: set[int] = set()                 # values with no decision (replicated)
        self.from_broadcast: set[int] = set()
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        self.nodes_before_merge = 0
        # Memo tables: a group's strategies give its values few distinct specs, so pricing
        # per distinct spec (pair) instead of per strategy (pair) is exact and much faster.
        self._reshard: dict[tuple[Spec, Spec, float], float] = {}
        self._valid: dict[tuple[Spec, tuple[int, ...]], bool] = {}
        # (equation, operand position, value, group, spec per strategy) of enumerated
        # equations: the layouts their chosen strategy reads its operands in.
        self.operand_requirements: list[tuple[int, int, int, int, list]] = []
        # (equation, operand position, operand value, consumer group, spec per strategy)
        # of every operand.
        self.requirements: list[tuple[int, int, int, int, list]] = []
        self._buffers = buffers  # memory.analyze(graph), computed when first asked
        self._dots = {} if dots is None else dots  # see `dot_strategies`
        self._follows: dict[tuple, dict] = {}  # see `add_follower`
        self._tables: dict[tuple, np.ndarray] = {}  # see `require`
        # Answers these three memos gave instead of computing them again (`MEMOIZE`).
        self.memo_hits = {"dot": 0, "follow": 0, "table": 0}
        self.aliased: set[int] = set()   # outputs written into their donated input
        self.tie_pairs: list[tuple[int, int]] = []  # (output value, input value it replaces)

    def fork(self) -> ProblemBuilder:
        """A copy that `add_traffic` / `add_value_costs` can change without touching this
        one (the groups' compute costs are copied; everything else, fixed once built, is
        shared)."""
        out = copy.copy(self)
        out.groups = [dataclasses.replace(g, compute_s=g.compute_s.copy()) for g in self.groups]
        return out

    # -- groups -----------------------------------------------------------------------------

    def new_group(self, names: list[str], compute_s: Sequence[float],
                  comm_s: Sequence[float], label: str) -> int:
        self.groups.append(Group(len(names), names, np.asarray(compute_s, dtype=np.float64),
                                  np.asarray(comm_s, dtype=np.float64), label=label))
        self.nodes_before_merge += 1
        return len(self.groups) - 1

    def add_member(self, gid: int, vid: int, specs: list[Spec]) -> None:
        value = self.graph.values[vid]
        fixed_specs = [s if self._is_valid(s, value.shape) else replicated(value.ndim)
                       for s in specs]
        self.group_of[vid] = gid
        self.specs[vid] = fixed_specs
        self.groups[gid].members.append(vid)

    def _is_valid(self, spec: Spec, shape: tuple[int, ...]) -> bool:
        key = (spec, shape)
        ok = self._valid.get(key)
        if ok is None:
            ok = self._valid[key] = is_valid(spec, shape, self.mesh)
        return ok

    def reshard_cost(self, a: Spec, b: Spec | None, nbytes: float) -> float:
        """`reshard_s(a, b, nbytes)`, memoized (0 when `b` is None: any layout)."""
        if b is None or a == b:
            return 0.0
        key = (a, b, nbytes)
        cost = self._reshard.get(key)
        if cost is None:
            cost = self._reshard[key] = reshard_s(a, b, nbytes, self.mesh)
        return cost

    def require(self, vid: int, consumer_vid_or_gid: int, required: Sequence[Spec | None],
                *, consumer_is_group: bool = False, eqn: int | None = None,
                position: int = -1) -> None:
        """Operand `vid` must arrive in `required[j]` when the consumer's group picks j
        (`eqn`, `position`: the consuming equation and operand, where the resharded copy is
        made)."""
        gv = consumer_vid_or_gid if consumer_is_group else self.group_of[consumer_vid_or_gid]
        if eqn is not None:
            self.requirements.append((eqn, position, vid, gv, list(required)))
        gu = self.group_of[vid]
        nbytes = self.graph.values[vid].nbytes
        src_index, src_specs = _distinct(self.specs[vid])
        req_index, req_specs = _distinct(required)
        tkey = (nbytes, tuple(src_specs), tuple(req_specs))
        table = self._tables.get(tkey) if MEMOIZE else None
        if table is None:
            table = np.array(
                [[self.reshard_cost(a, b, nbytes) for b in req_specs] for a in src_specs],
                dtype=np.float64).reshape(len(src_specs), len(req_specs))
            if MEMOIZE:
                self._tables[tkey] = table
        else:
            self.memo_hits["table"] += 1
        if gu == gv:
            g = self.groups[gu]
            g.comm_s += table[src_index, req_index]
            return
        mat = table[src_index[:, None], req_index[None, :]]
        key = (gu, gv)
        self.edges[key] = self.edges[key] + mat if key in self.edges else mat

    # -- building ---------------------------------------------------------------------------

    def build(self) -> None:
        graph = self.graph
        for v in graph.values:
            if v.const_index is not None:
                self.fixed.add(v.id)
        for vid in graph.invars:
            self.add_input(graph.values[vid])
        for eqn in graph.eqns:
            rule = st.strategy_rules.get(eqn.name)
            operand_ids = [op for op in eqn.inputs if isinstance(op, int)]
            if all(op in self.fixed for op in operand_ids) and (
                    rule is None and primitives.info(eqn.name).source or
                    rule is not None and rule.kind == "follow"):
                self.fixed.update(eqn.outputs)
                continue
            if rule is None:
                rule = st.rule_for(eqn.name, eqn.where())
            info = self.info(eqn)
            lead = rule.leader(info) if rule is not None and rule.kind == "follow" else None
            if rule is not None and rule.kind == "follow" and lead is not None:
                self.add_follower(info, rule, lead)
            else:
                self.add_enumerated(info, rule)
            if eqn.name == "broadcast_in_dim":
                self.from_broadcast.update(eqn.outputs)

    def info(self, eqn) -> st.EqnInfo:
        vals = self.graph.values
        in_shapes, in_bytes, fixed, bcast = [], [], [], []
        for op in eqn.inputs:
            if isinstance(op, Lit):
                in_shapes.append(tuple(op.shape))
                in_bytes.append(0.0)
                fixed.append(True)
                bcast.append(False)
            else:
                in_shapes.append(vals[op].shape)
                in_bytes.append(float(vals[op].nbytes))
                fixed.append(op in self.fixed)
                bcast.append(op in self.from_broadcast)
        outs = [vals[o] for o in eqn.outputs]
        return st.EqnInfo(eqn, tuple(in_shapes), tuple(o.shape for o in outs),
                          tuple(in_bytes), tuple(float(o.nbytes) for o in outs), tuple(fixed),
                          tuple(bcast), self.batch_size,
                          eqn_out_dtype=outs[0].dtype if outs else np.float32,
                          fused_bytes=float(self.buffers.eqn_bytes[eqn.index]))

    def add_input(self, value: Value) -> None:
        if value.id in self.forced:
            specs = [self.forced[value.id]]
        elif not is_numeric(value.dtype):
            specs = [replicated(value.ndim)]
        else:
            specs = list(enumerate_specs(value.shape, self.mesh))
        names = [f"input {s}" for s in specs]
        gid = self.new_group(names, [0.0] * len(specs), [0.0] * len(specs),
                             f"input {value.input_index} {value.shape}")
        self.add_member(gid, value.id, specs)

    def add_follower(self, info: st.EqnInfo, rule: st.StrategyRule, lead: int) -> None:
        eqn = info.eqn
        lead_vid = eqn.inputs[lead]
        gid = self.group_of[lead_vid]
        group = self.groups[gid]
        lead_specs = self.specs[lead_vid]
        self.nodes_before_merge += 1
        # The rule's answer depends only on the leader's spec: once per distinct spec, and
        # for the table's own rules once per equation signature (`_follow_key`: repeated
        # blocks of a model repeat their equations).
        key = _follow_key(info, rule, lead) if MEMOIZE else None
        shared: dict[Spec, tuple[st.FollowResult, float]] = (
            {} if key is None else self._follows.setdefault(key, {}))
        done: dict[Spec, tuple[st.FollowResult, float]] = {}
        for spec in dict.fromkeys(lead_specs):     # distinct, in strategy order
            hit = shared.get(spec)
            if hit is not None:
                self.memo_hits["follow"] += 1
            else:
                try:
                    res = rule.follow(info, lead, spec, self.mesh)
                    ok = True
                except Exception:  # reported, with this equation's line, by _safe_follow
                    res, ok = _safe_follow(rule, info, lead, spec, self.mesh), False
                shards = self.mesh.shards(res.out_specs[0]) if res.out_specs else 1
                hit = (res, st.compute_s(info, shards, self.mesh))
                if ok:
                    shared[spec] = hit
            done[spec] = hit
        rows = [done[spec] for spec in lead_specs]   # per strategy of the group
        group.compute_s += np.fromiter((c for _, c in rows), np.float64, len(rows))
        group.comm_s += np.fromiter((r.comm_s for r, _ in rows), np.float64, len(rows))
        in_specs = [[r.in_specs[k] for r, _ in rows] for k in range(len(eqn.inputs))]
        for k, vid in enumerate(eqn.outputs):
            self.add_member(gid, vid, [r.out_specs[k] for r, _ in rows])
        for k, op in enumerate(eqn.inputs):
            # The leader's own re-layout (dropped axes) is priced by the rule's comm_s.
            if k != lead and isinstance(op, int) and op not in self.fixed:
                self.require(op, gid, in_specs[k], consumer_is_group=True, eqn=eqn.index,
                             position=k)

    def add_enumerated(self, info: st.EqnInfo, rule: st.StrategyRule | None) -> None:
        eqn = info.eqn
        strategies: list[st.Strategy] = []
        if rule is not None and rule.kind == "enumerate":
            try:
                strategies = (self.dot_strategies(info) if rule.enumerate is st.enumerate_dot
                              else rule.enumerate(info, self.mesh))
            except Exception as err:  # a rule bug must never break planning
                fallbacks.report("intra-op", f"the strategy rule for {eqn.name!r} raised "
                                 f"{type(err).__name__}: {err}; replicated", eqn.where())
        if not strategies:
            strategies = [st.replicated_strategy(info, self.mesh)]
        strategies = _dedupe(strategies)
        scale = self.comm_scale.get(eqn.index, 1.0)
        comm = [s.comm_s * scale + self.uncombined_alpha_s(eqn, s) for s in strategies]
        gid = self.new_group([s.name for s in strategies], [s.compute_s for s in strategies],
                             comm, f"{eqn.name} @ {eqn.where()}")
        for k, vid in enumerate(eqn.outputs):
            self.add_member(gid, vid, [s.out_specs[k] for s in strategies])
        partial = np.array([s.partial_bytes for s in strategies])
        if eqn.outputs and partial.any():
            self.groups[gid].partials.append((eqn.outputs[0], partial))
        for k, op in enumerate(eqn.inputs):
            if isinstance(op, int) and op not in self.fixed:
                required = [s.in_specs[k] for s in strategies]
                self.require(op, gid, required, consumer_is_group=True, eqn=eqn.index,
                             position=k)
                self.operand_requirements.append((eqn.index, k, op, gid, required))

    def dot_strategies(self, info: st.EqnInfo) -> list[st.Strategy]:
        """`enumerate_dot(info, mesh)`, memoized on everything it reads (dimension numbers,
        shapes, bytes, FLOPs, output dtype; the mesh is the builder's): a transformer's
        blocks repeat the same matmuls, within a layer and across the layers of a search
        (GPT-39B: a quarter of the layer-ILP build time went to enumerating them again)."""
        eqn = info.eqn
        key = (info.params["dimension_numbers"], info.in_shapes, info.out_shapes,
               info.in_nbytes, info.out_nbytes, eqn.flops, eqn.bytes_accessed,
               info.fused_bytes, info.eqn_out_dtype)
        found = self._dots.get(key) if MEMOIZE else None
        if found is None:
            found = st.enumerate_dot(info, self.mesh)
            if MEMOIZE:
                self._dots[key] = found
        else:
            self.memo_hits["dot"] += 1
        return list(found)

    def uncombined_alpha_s(self, eqn, strategy: st.Strategy) -> float:
        """The latency a partial-sum reduction pays beyond its share of a combined bucket
        when the critical path waits for it (an activation's reduction is not combined with
        others, passes/memory.py `urgent`): rules price α pro-rated to a 30 MiB bucket."""
        if not strategy.partial_axes or not eqn.outputs:
            return 0.0
        if not self.buffers.urgent[eqn.outputs[0]]:
            return 0.0
        link = self.mesh.group_link(strategy.partial_axes)
        return link.alpha_s * max(0.0, 1.0 - strategy.partial_bytes / COMBINE_BYTES)

    def add_traffic(self, traffic: Mapping[int, float]) -> None:
        """`start`'s `traffic`: each value's extra memory traffic, per strategy of its group
        (a value without a decision is replicated: the same cost for every plan)."""
        bandwidth = self.mesh.cluster.memory_bandwidth_bytes_per_s

        def cost(factor: float, nbytes: float) -> Callable[[Spec], float]:
            return lambda spec: factor * nbytes / self.mesh.shards(spec) / bandwidth

        self.add_value_costs({vid: cost(factor, self.graph.values[vid].nbytes)
                              for vid, factor in traffic.items()})

    def add_value_costs(self, costs: Mapping[int, Callable[[Spec], float]]) -> None:
        """`start`'s `value_costs`: seconds per strategy of the value's group (a value
        without a decision is replicated: the same cost for every plan)."""
        for vid, fn in costs.items():
            gid = self.group_of.get(vid)
            if gid is None:
                continue
            self.groups[gid].compute_s += np.array([fn(spec) for spec in self.specs[vid]])

    # -- the problem ------------------------------------------------------------------------

    @property
    def buffers(self) -> mem.BufferInfo:
        if self._buffers is None:
            self._buffers = mem.analyze(self.graph, cpu=cpu_buffers(self.mesh),
                                        awaited=self.awaited)
        return self._buffers

    def problem(self, memory_budget_bytes: float | None) -> ShardingProblem:
        costs, usages, intervals, names = [], [], [], []
        members_by_group: dict[int, list[int]] = defaultdict(list)
        for vid, gid in self.group_of.items():
            members_by_group[gid].append(vid)
        for gid, g in enumerate(self.groups):
            members = members_by_group[gid]
            costs.append(g.compute_s + g.comm_s)
            usage, interval = self.group_usage(members, g)
            usages.append(usage)
            intervals.append(interval)
            names.append(g.label)
        edges = list(self.edges)
        return ShardingProblem(
            node_costs=tuple(costs),
            node_usages=tuple(usages),
            intervals=np.array(intervals, dtype=np.int64).reshape(-1, 2),
            edges=np.array(edges, dtype=np.int64).reshape(-1, 2),
            edge_costs=tuple(self.edges[e] for e in edges),
            usage_limit=memory_budget_bytes,
            node_names=tuple(names),
            name="intra-op",
        )

    def group_usage(self, members: list[int], group: Group
                    ) -> tuple[np.ndarray, tuple[int, int]]:
        """Peak bytes per device of the group's buffers (passes/memory.py: materialized
        members over their fused liveness, inputs over the whole step, outputs aliased to a
        donated input excluded, unreduced partial sums), per strategy, and the interval
        covering them (a bound on the group's footprint at any time of it)."""
        num = group.num_strategies
        info = self.buffers
        vals = self.graph.values
        rows, spans = [], []
        for v in members:
            if not info.materialized[v] or v in self.aliased:
                continue
            index, distinct = _distinct(self.specs[v])
            shards = np.array([self.mesh.shards(sp) for sp in distinct], dtype=np.float64)
            rows.append(float(vals[v].nbytes) / shards[index])
            spans.append((int(info.start[v]), max(int(info.end[v]), int(info.start[v]) + 1)))
        for v, partial in group.partials:
            s0 = int(info.start[v])
            rows.append(np.asarray(partial, dtype=np.float64))
            spans.append((s0, s0 + 1))
        if not rows:
            return np.zeros(num), (0, 0)
        per = np.array(rows)
        sp = np.array(spans, dtype=np.int64)
        starts = np.unique(sp[:, 0])
        alive = (sp[:, 0][None, :] <= starts[:, None]) & (starts[:, None] < sp[:, 1][None, :])
        usage = (alive.astype(np.float64) @ per).max(axis=0)
        return usage, (int(sp[:, 0].min()), int(sp[:, 1].max()))

    def estimate(self, choice: Sequence[int]) -> mem.MemoryEstimate:
        """`passes.memory.estimate` of the layout the strategies `choice` give."""
        return mem.estimate(self.graph, self.buffers, **self.layout_terms(choice))

    def layout_terms(self, choice: Sequence[int]) -> dict:
        """The layout-dependent arguments of `passes.memory.estimate` for `choice`."""
        graph = self.graph
        info = self.buffers
        spec_of = {vid: self.specs[vid][choice[g]] for vid, g in self.group_of.items()}

        def value_bytes(vid: int) -> float:
            spec = spec_of.get(vid)
            return graph.values[vid].nbytes / (self.mesh.shards(spec) if spec else 1)

        partial = {}
        for gid, g in enumerate(self.groups):
            for vid, per in g.partials:
                if per[choice[gid]] > 0:
                    partial[vid] = float(per[choice[gid]])
        reshards = []
        for eqn, _, vid, gid, required in self.requirements:
            want = required[choice[gid]]
            have = spec_of.get(vid)
            if want is None or have is None or want == have:
                continue
            sliced = is_slice(have, want)
            if sliced and primitives.info(graph.eqns[eqn].name).reads_fused:
                continue  # the slice is fused into the reader, which reads the whole value
            # A move XLA would do by replicating is routed through the gathered layout
            # (`gather_first`): that copy for one step, then the target's until the last
            # read.  One-axis moves are all-to-alls straight into the target.
            nbytes = graph.values[vid].nbytes
            gathered = nbytes / self.mesh.shards(gather_first(have, want)) \
                if full_rematerialization(have, want) else 0.0
            reshards.append(mem.Reshard(vid, want, nbytes / self.mesh.shards(want),
                                        int(info.runs_at[eqn]), eqn=eqn, slice=sliced,
                                        gathered=gathered))
        for out, inp in self.tie_pairs:
            want, have = spec_of.get(inp), spec_of.get(out)
            if want is None or have is None or want == have or is_slice(have, want):
                continue
            reshards.append(mem.Reshard(out, want, graph.values[out].nbytes
                                        / self.mesh.shards(want), int(info.start[out]),
                                        until=info.horizon))
        return dict(value_bytes=value_bytes, aliased=self.aliased, partial=partial,
                    reshards=reshards,
                    scatter_as_all_reduce=scatter_as_all_reduce(self.mesh))


def _distinct(specs: Sequence[Spec | None]) -> tuple[np.ndarray, list[Spec | None]]:
    """(index of each entry in the distinct list, the distinct specs in first-seen order)."""
    index: dict[Spec | None, int] = {}
    out = np.fromiter((index.setdefault(s, len(index)) for s in specs), dtype=np.int64,
                      count=len(specs))
    return out, list(index)


def _dedupe(strategies: list[st.Strategy]) -> list[st.Strategy]:
    """One strategy per (output specs, input specs): the cheapest (exact: the rest of the
    problem only sees the specs)."""
    best: dict[tuple, st.Strategy] = {}
    for s in strategies:
        key = (s.out_specs, s.in_specs)
        if key not in best or s.compute_s + s.comm_s < best[key].compute_s + best[key].comm_s:
            best[key] = s
    return list(best.values())


# Whether problem builds reuse the strategies and resharding tables of equal equations
# (`ProblemBuilder.dot_strategies`, `add_follower`, `require`): exact, as the keys hold all
# the rules read; False rebuilds every one (the tests' reference).
MEMOIZE = True

# Follow rules that read only the equation's name, params, shapes and bytes (`_follow_key`).
_PURE_FOLLOWS = frozenset({st.follow_elementwise, st.follow_reduce, st.follow_transpose,
                           st.follow_squeeze, st.follow_broadcast, st.follow_reshape})


def _follow_key(info: st.EqnInfo, rule: st.StrategyRule, lead: int) -> tuple | None:
    """Everything a pure follow rule and `st.compute_s` read of `info` (None: not a pure
    rule, or params that do not hash): equations with equal keys follow alike."""
    if rule.follow not in _PURE_FOLLOWS:
        return None
    eqn = info.eqn
    key = (rule.follow, eqn.name, tuple(sorted(eqn.params.items())), lead, info.in_shapes,
           info.out_shapes, info.in_nbytes, info.out_nbytes, info.in_fixed,
           info.in_from_broadcast, info.batch_size, eqn.flops, eqn.bytes_accessed,
           info.fused_bytes, info.eqn_out_dtype)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _safe_follow(rule: st.StrategyRule, info: st.EqnInfo, lead: int, spec: Spec,
                 mesh: MeshContext) -> st.FollowResult:
    try:
        return rule.follow(info, lead, spec, mesh)
    except Exception as err:  # a rule bug must never break planning: replicate
        fallbacks.report("intra-op", f"the follow rule for {info.eqn.name!r} raised "
                         f"{type(err).__name__}: {err}; replicated", info.eqn.where())
        rep_in = tuple(replicated(len(s)) for s in info.in_shapes)
        cost = reshard_s(spec, replicated(len(spec)), info.in_nbytes[lead], mesh)
        return st.FollowResult(tuple(replicated(len(s)) for s in info.out_shapes), rep_in, cost)
