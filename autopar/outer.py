"""The outer program of a pipelined step: the batch-free work before the compute-grad
equation and everything after it (apply-grad), run once per step.

Its equations are grouped into jitted segments, each on one stage's mesh: an equation runs
on the stage holding most of its input bytes, one round after any input made on another
stage (a transfer happens between rounds), so data only flows forward — a global-norm
clip, say, becomes per-stage partial norms, one combine, per-stage updates.  Tiny values
made only from tiny values that exist before the step's segments run (an optimizer's step
count and Adam's bias corrections) are recomputed by every segment that reads them.

Layouts: every parameter lives on its owner stage (the first that reads it) in that stage's
planned layout; its gradient, and every value computed from them by elementwise equations
of the same shape (optimizer moments, updates, the new parameter) or tied to them as the
step's new state, take the same layout on the same stage (looking inside call equations
such as `jnp.where`'s).  Segments are compiled with those shardings in and out, so state
keeps its layout across steps and nothing is replicated by accident; donated state is
updated in place.  Any other value crossing segments is replicated on its segment's
stage: what the planner assumes for scalars and small values, a fallback (reported,
`unplanned_replica`) for one as large as the split value it is computed from.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np
from jax._src import source_info_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from autopar.interpret import run_eqns
from autopar.passes import primitives

from . import transfer
from .passes import fallbacks


@dataclasses.dataclass(eq=False)
class Segment:
    """Equations of the outer program run as one jit on one stage."""

    stage: int
    eqns: list[int]
    inputs: list[Any] = dataclasses.field(default_factory=list)
    outputs: list[Any] = dataclasses.field(default_factory=list)
    in_shardings: list[Sharding] = dataclasses.field(default_factory=list)
    out_shardings: list[Sharding] = dataclasses.field(default_factory=list)
    donate: tuple[int, ...] = ()
    fn: Any = None
    local: bool = True
    copies: frozenset = frozenset()   # tiny values recomputed here; another segment outputs them


def _nbytes(v: Any) -> int:
    return int(np.prod(v.aval.shape)) * getattr(v.aval.dtype, "itemsize", 4)


class _Classes:
    """Union-find over jaxpr variables."""

    def __init__(self):
        self.parent: dict[Any, Any] = {}

    def find(self, v: Any) -> Any:
        root = v
        while self.parent.get(root, root) is not root:
            root = self.parent[root]
        while v is not root:
            self.parent[v], v = root, self.parent.get(v, v)
        return root

    def union(self, a: Any, b: Any) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[ra] = rb


def state_layouts(jaxpr: jcore.Jaxpr, eqns: Sequence[int], known: Mapping[Any, tuple[int,
                  Sharding]], ties: Sequence[tuple[Any, Any]]) -> dict[Any, tuple[int, Sharding]]:
    """(stage, sharding) of every variable connected to one with a known layout by
    same-shape elementwise equations among `eqns` (also inside call equations, `_connect`)
    or by `ties` (new state, old state)."""
    classes = _Classes()
    _connect((jaxpr.eqns[i] for i in eqns), classes)
    for a, b in ties:
        if not isinstance(a, jcore.Literal) and not isinstance(b, jcore.Literal):
            classes.union(a, b)
    by_class: dict[Any, tuple[int, Sharding]] = {}
    for v, layout in known.items():
        by_class.setdefault(classes.find(v), layout)
    out: dict[Any, tuple[int, Sharding]] = {}
    candidates = set(known) | {v for v in classes.parent if isinstance(v, jcore.Var)}
    for i in eqns:
        candidates.update(v for v in jaxpr.eqns[i].outvars)
        candidates.update(v for v in jaxpr.eqns[i].invars if not isinstance(v, jcore.Literal))
    for v in candidates:
        layout = by_class.get(classes.find(v))
        if layout is not None:
            out[v] = layout
    return out


def _call_body(e: Any) -> Any:
    """The body of `e` if it is a call whose body is connected like the program around it
    (the registry's `connects_body`), else None: `jnp.where` is a `jit` call (`_where`) of
    one `select_n`, and an optimizer that picks per parameter with it (Adafactor's
    parameter-scale floor, RAdam's rectification) would otherwise leave the pick without
    its parameter's layout: made on another stage, replicated, and moved."""
    facts = primitives.info(e.primitive.name)
    return e.params.get(facts.body_param) if facts.connects_body else None


def _connect(eqns: Iterable[Any], classes: _Classes, env: dict[Any, Any] | None = None
             ) -> None:
    """Unions in `classes` each output of a same-shape elementwise equation of `eqns` with
    its inputs of that shape, looking inside call equations (`_call_body`).  `env` names the
    variables of a call's body by the caller's; the body's other variables get fresh
    names (a body traced once may be called for several parameters)."""
    def name(v: Any) -> Any:
        if env is None:
            return v
        if v not in env:
            env[v] = object()
        return env[v]

    for e in eqns:
        sub = _call_body(e)
        if sub is not None:
            body = getattr(sub, "jaxpr", sub)
            inner: dict[Any, Any] = {}
            for a, b in zip(body.invars, e.invars):
                if not isinstance(b, jcore.Literal):
                    inner[a] = name(b)
            for a, b in zip(body.outvars, e.outvars):
                if isinstance(a, jcore.Literal):
                    continue
                if a in inner:   # an input returned as it is
                    classes.union(inner[a], name(b))
                else:
                    inner[a] = name(b)
            _connect(body.eqns, classes, inner)
            continue
        if not primitives.info(e.primitive.name).elementwise or len(e.outvars) != 1:
            continue
        out = e.outvars[0]
        for v in e.invars:
            if not isinstance(v, jcore.Literal) and v.aval.shape == out.aval.shape:
                classes.union(name(v), name(out))


# A value at most this large (bytes), computed only from values as small that exist before
# the segments run (an optimizer's step count), is recomputed on every stage that reads it:
# sending it costs a transfer and a segment boundary (Adam's bias corrections, computed on
# one stage, cut every other stage's update in two programs).
TINY_BYTES = 64


def tiny_eqns(jaxpr: jcore.Jaxpr, indices: Sequence[int]) -> set[int]:
    """The equations among `indices` whose outputs are tiny and whose inputs are tiny values
    made before them (outside `indices`, or by a tiny equation), with no side effects."""
    produced = {v for i in indices for v in jaxpr.eqns[i].outvars}
    tiny: set[int] = set()
    tiny_vars: set[Any] = set()
    for i in indices:
        e = jaxpr.eqns[i]
        ins = [v for v in e.invars if not isinstance(v, jcore.Literal)]
        if (not e.effects and all(_nbytes(v) <= TINY_BYTES for v in e.outvars)
                and all(v in tiny_vars or (v not in produced and _nbytes(v) <= TINY_BYTES)
                        for v in ins)):
            tiny.add(i)
            tiny_vars.update(e.outvars)
    return tiny


def assign(jaxpr: jcore.Jaxpr, indices: Sequence[int], home: dict[Any, int]) -> list[Segment]:
    """Groups equations `indices` into segments (see the module docstring); `home` (variable
    → stage) is read and extended.  Tiny equations (`tiny_eqns`) join every segment that
    reads their outputs; the copy on the outputs' home stage (or the first) owns them."""
    tiny = tiny_eqns(jaxpr, indices)
    producer = {v: i for i in tiny for v in jaxpr.eqns[i].outvars}
    made: dict[Any, tuple[int, int]] = {}   # value -> (round, stage) of its equation
    groups: dict[tuple[int, int], Segment] = {}
    needs: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
    for i in indices:
        if i in tiny:
            continue
        eqn = jaxpr.eqns[i]
        ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
        known = [v for v in ins if v in home and v not in producer]
        stage = home[max(known, key=_nbytes)] if known else 0
        for v in eqn.outvars:
            if v in home:   # a value with a layout of its own decides where it is made
                stage = home[v]
                break
        for v in ins:
            if v not in producer:
                home.setdefault(v, stage)
        # Values made before the segments run are available everywhere at round 0.  A value
        # made on another stage is read a round later: that stage is where its equation ran,
        # which need not be the value's home (one call equation, such as optax's jitted
        # `tree_bias_correction` under jax >= 0.11, makes every stage's moments).
        r = max([made[v][0] + (made[v][1] != stage) for v in ins if v in made], default=0)
        seg = groups.get((r, stage))
        if seg is None:
            seg = groups[(r, stage)] = Segment(stage, [])
        seg.eqns.append(i)
        needs[(r, stage)].update(producer[v] for v in ins if v in producer)
        for v in eqn.outvars:
            home.setdefault(v, stage)
            made[v] = (r, stage)
    _add_tiny(jaxpr, tiny, producer, groups, needs, home)
    for seg in groups.values():
        seg.eqns.sort()
    return [groups[k] for k in sorted(groups)]


def _add_tiny(jaxpr: jcore.Jaxpr, tiny: set[int], producer: Mapping[Any, int],
              groups: dict[tuple[int, int], Segment], needs: dict[tuple[int, int], set[int]],
              home: dict[Any, int]) -> None:
    """Adds to each segment (key (round, stage) in `groups`) the tiny equations it reads
    (`needs`), with their tiny ancestors; one on the outputs' home stage makes them too when
    no reader there does (new state, such as a step count, stays where it lives) and owns
    them, the others recompute them for themselves (`Segment.copies`)."""
    def close(wanted: set[int]) -> None:
        todo = list(wanted)
        while todo:
            for v in jaxpr.eqns[todo.pop()].invars:
                j = None if isinstance(v, jcore.Literal) else producer.get(v)
                if j is not None and j not in wanted:
                    wanted.add(j)
                    todo.append(j)

    for wanted in needs.values():
        close(wanted)
    stage_of: dict[int, int] = {}
    for i in sorted(tiny):
        e = jaxpr.eqns[i]
        readers = [k for k in sorted(groups) if i in needs[k]]
        stage = next((home[v] for v in e.outvars if v in home), None)
        if stage is None:
            known = [v for v in e.invars if not isinstance(v, jcore.Literal) and v in home]
            stage = home[known[0]] if known else readers[0][1] if readers else 0
        stage_of[i] = stage
        if not any(k[1] == stage for k in readers):
            key = min((k for k in groups if k[1] == stage), default=(0, stage))
            if key not in groups:
                groups[key] = Segment(stage, [])
            needs[key].add(i)
            close(needs[key])
    for i in sorted(tiny):
        outs = jaxpr.eqns[i].outvars
        readers = [k for k in sorted(groups) if i in needs[k]]
        owner = next(k for k in readers if k[1] == stage_of[i])
        for k in readers:
            groups[k].eqns.append(i)
            if k != owner:
                groups[k].copies = groups[k].copies | frozenset(outs)
        for v in outs:
            home.setdefault(v, stage_of[i])


def wire(closed: jcore.ClosedJaxpr, segments: list[Segment], needed_later: set[Any],
         layouts: Mapping[Any, tuple[int, Sharding]], meshes: Sequence[Mesh],
         donatable: set[Any]) -> None:
    """Fills each segment's inputs, outputs, shardings, donation and jitted function.

    A value with a layout (`layouts`) takes it on its stage; any other value a segment
    reads or makes is replicated on the segment's stage, reported as a fallback where
    `unplanned_replica` says the plan did not price that.
    `donatable`: step input variables the step may overwrite; each is donated to its last
    reader when that segment makes an output of the same shape, dtype and layout for XLA
    to write into (an optimizer moment's buffer may hold `b1 * mu` in one segment)."""
    jaxpr = closed.jaxpr
    origins = split_origins(jaxpr, sorted({i for seg in segments for i in seg.eqns}), layouts)
    reported: set[Any] = set()
    readers: dict[Any, list[int]] = {}
    for k, seg in enumerate(segments):
        produced = {v for i in seg.eqns for v in jaxpr.eqns[i].outvars}
        reads: list[Any] = []
        for i in seg.eqns:
            for v in jaxpr.eqns[i].invars:
                if not isinstance(v, jcore.Literal) and v not in produced and v not in reads:
                    reads.append(v)
        seg.inputs = reads
        for v in reads:
            readers.setdefault(v, []).append(k)
    for k, seg in enumerate(segments):
        produced = [v for i in seg.eqns for v in jaxpr.eqns[i].outvars]
        used_elsewhere = {v for other in segments if other is not seg for v in other.inputs}
        seg.outputs = [v for v in produced if v not in seg.copies
                       and (v in used_elsewhere or v in needed_later)]
        replicated = NamedSharding(meshes[seg.stage], PartitionSpec())

        def sharding(v: Any, stage: int = seg.stage, default: Sharding = replicated
                     ) -> Sharding:
            layout = layouts.get(v)
            if layout is not None and layout[0] == stage:
                return layout[1]
            return default

        seg.in_shardings = [sharding(v) for v in seg.inputs]
        seg.out_shardings = [sharding(v) for v in seg.outputs]
        _report_replicas(jaxpr, seg, meshes[seg.stage].size, layouts, origins, reported)
        free = collections.Counter((v.aval.shape, v.aval.dtype, sh)
                                   for v, sh in zip(seg.outputs, seg.out_shardings))
        donate = []
        for j, v in enumerate(seg.inputs):
            key = (v.aval.shape, v.aval.dtype, seg.in_shardings[j])
            if v in donatable and readers[v][-1] == k and free[key] > 0:
                free[key] -= 1
                donate.append(j)
        seg.donate = tuple(donate)
        seg.local = transfer.is_local(replicated)
        seg.fn = jax.jit(_segment_fn(closed, seg), in_shardings=seg.in_shardings,
                         out_shardings=seg.out_shardings, donate_argnums=seg.donate)


@dataclasses.dataclass(frozen=True)
class _Origin:
    """The largest value with a split layout that a value is computed from: its shape, its
    bytes, its bytes per device under that layout, and its device count."""

    shape: tuple[int, ...]
    nbytes: int
    block: int
    devices: int


def _split_origin(v: Any, layouts: Mapping[Any, tuple[int, Sharding]]) -> _Origin | None:
    layout = layouts.get(v)
    if layout is None or layout[1].is_fully_replicated:
        return None
    shape = tuple(v.aval.shape)
    block = int(np.prod(layout[1].shard_shape(shape))) * getattr(v.aval.dtype, "itemsize", 4)
    return _Origin(shape, _nbytes(v), block, len(layout[1].device_set))


def split_origins(jaxpr: jcore.Jaxpr, eqns: Sequence[int],
                  layouts: Mapping[Any, tuple[int, Sharding]]) -> dict[Any, _Origin]:
    """For every variable of equations `eqns` (in program order) computed from a value
    whose layout (`layouts`) splits it, the largest such value (`_Origin`)."""
    out: dict[Any, _Origin] = {}

    def origin(v: Any) -> _Origin | None:
        if isinstance(v, jcore.Literal):
            return None
        own, inherited = _split_origin(v, layouts), out.get(v)
        return max((o for o in (own, inherited) if o is not None), default=None,
                   key=lambda o: o.nbytes)

    for i in eqns:
        e = jaxpr.eqns[i]
        best = max((o for o in map(origin, e.invars) if o is not None), default=None,
                   key=lambda o: o.nbytes)
        for v in e.outvars:
            mine = origin(v)
            found = max((o for o in (mine, best) if o is not None), default=None,
                        key=lambda o: o.nbytes)
            if found is not None:
                out[v] = found
    for v in layouts:
        own = _split_origin(v, layouts)
        if own is not None and v not in out:
            out[v] = own
    return out


def unplanned_replica(v: Any, origin: _Origin | None) -> bool:
    """Whether value `v`, replicated at a segment boundary without a planned layout there,
    is a fallback: the plan prices the update elementwise at each parameter's layout, so a
    value computed from a split one (`origin`) and replicated costs an all-gather (or an
    all-reduce) of its bytes and its whole bytes on every device, neither priced.

    Threshold: more than `TINY_BYTES` and at least the split origin's bytes per device
    (`origin.block`).  Below that the replica adds less per device than the plan already
    holds for its origin, and it is what the planner assumes: a scalar (a step count, a
    global norm, a loss scale) or an Adafactor's factored moment, a row or a column of a
    matrix both of whose dims optax factors only from 128 up, so at most 1/128 of the
    matrix: under its block wherever it is split fewer than 128 ways.  At or above it, a
    parameter-sized quantity (a reshaped gradient, a flattened or blocked moment, a
    preconditioner) is gathered whole: at least twice the per-device bytes the plan
    priced for it."""
    return origin is not None and _nbytes(v) > TINY_BYTES and _nbytes(v) >= origin.block


def _report_replicas(jaxpr: jcore.Jaxpr, seg: Segment, devices: int,
                     layouts: Mapping[Any, tuple[int, Sharding]],
                     origins: Mapping[Any, _Origin], reported: set[Any]) -> None:
    """Reports (`fallbacks.report`) the inputs and outputs of `seg` replicated on its stage
    without a planned layout there that `unplanned_replica` flags, each value once (kept
    in `reported`), one report per source line: the equation making the value here, or
    the first reading it."""
    found: dict[tuple[str, str], list[tuple[Any, jcore.JaxprEqn | None]]] = {}
    for v in list(seg.inputs) + list(seg.outputs):
        layout = layouts.get(v)
        if v in reported or (layout is not None and layout[0] == seg.stage):
            continue
        if not unplanned_replica(v, origins.get(v)):
            continue
        reported.add(v)
        eqn = next((jaxpr.eqns[i] for i in seg.eqns if v in jaxpr.eqns[i].outvars), None) or \
            next((jaxpr.eqns[i] for i in seg.eqns if any(x is v for x in jaxpr.eqns[i].invars)),
                 None)
        where = _where(eqn)
        done = "made" if v in seg.outputs else "read"
        reason = (f"laid out on stage {layout[0]}, {done} here whole" if layout is not None
                  else "computed from a split value by equations that are not elementwise, "
                       "it has no planned layout")
        found.setdefault((where, reason), []).append((v, eqn))
    for (where, reason), values in found.items():
        v, eqn = max(values, key=lambda p: _nbytes(p[0]))
        origin = origins[v]
        name = "?" if eqn is None else eqn.params.get("name") or eqn.primitive.name
        total = sum(_nbytes(x) for x, _ in values)
        fallbacks.report(
            "apply-grad",
            f"{len(values)} update value(s) of {total:,} B replicated on stage {seg.stage}'s "
            f"{devices} device(s) between update programs, the largest "
            f"{v.aval.str_short()} ({_nbytes(v):,} B, at {name!r}): {reason}; it comes "
            f"from a split {list(origin.shape)} held as {origin.block:,} B per device on "
            f"{origin.devices} (an unpriced gather and a whole copy per device)", where)


def _where(eqn: jcore.JaxprEqn | None) -> str:
    """The user's source line of `eqn` ("" when unknown)."""
    if eqn is None:
        return ""
    try:
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # source info is best-effort; never fail a report on it
        return ""


def _segment_fn(closed: jcore.ClosedJaxpr, seg: Segment) -> Callable:
    jaxpr = closed.jaxpr
    consts = dict(zip(jaxpr.constvars, closed.consts))

    def fn(*xs):
        env = dict(consts)
        env.update(zip(seg.inputs, xs))
        run_eqns(((i, jaxpr.eqns[i]) for i in seg.eqns), env, keyed=True)
        return [env[v] for v in seg.outputs]

    return fn


def place(x: Any, sharding: Sharding, private: bool = False) -> Any:
    """`x` laid out as `sharding`: itself when it already is, else moved there.  With
    `private` the moved array shares no buffer with `x` (it is about to be donated, and the
    caller's array must stay valid: `jax.device_put` may reuse x's buffer for a shard on
    x's own device)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if transfer.multi_process():
        src = x.sharding if isinstance(x, jax.Array) else None
        return transfer.arrived(transfer.move(x, sharding), src)
    if not isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    if private:
        x = x.copy()
    return transfer.local_move(x, sharding)


def place_all(xs: Sequence[Any], shardings: Sequence[Sharding]) -> list[Any]:
    """Each `x` laid out as its sharding (itself when it already is), sharing no buffer with
    the caller's arrays.  Host values and uncommitted arrays move in one jitted identity:
    `jax.device_put` onto a split layout compiles a slicing program per shape and layout
    (0.1-0.2 s each on CPU, a GPT state has a dozen of them), and a jit's outputs are
    fresh buffers."""
    out = list(xs)
    batch = []
    for k, (x, sh) in enumerate(zip(xs, shardings)):
        if isinstance(x, jax.Array) and x.sharding == sh:
            continue
        if transfer.multi_process() or getattr(x, "committed", False):
            out[k] = place(x, sh, private=True)
        else:
            batch.append(k)
    if batch:
        outs = tuple(shardings[k] for k in batch)
        # Inputs taken replicated (a copy per device; a split layout would slice them one
        # program per shape again), split inside the program.
        ins = tuple(NamedSharding(sh.mesh, PartitionSpec()) if isinstance(sh, NamedSharding)
                    else None for sh in outs)
        moved = jax.jit(_identity, in_shardings=ins, out_shardings=outs)(
            *(xs[k] for k in batch))
        for k, x in zip(batch, moved):
            out[k] = x
    return out


def _identity(*xs: Any) -> tuple[Any, ...]:
    return xs


def run(segments: Sequence[Segment], env: dict[Any, Any]) -> None:
    """Runs `segments` in order on the values of `env` (extended with their outputs); a
    segment on another process's devices leaves placeholders of its outputs."""
    for seg in segments:
        args = [place(env[v], sh, private=j in seg.donate)
                for j, (v, sh) in enumerate(zip(seg.inputs, seg.in_shardings))]
        if seg.local:
            env.update(zip(seg.outputs, seg.fn(*args)))
        else:
            env.update((v, transfer.placeholder(v.aval.shape, v.aval.dtype, sh))
                       for v, sh in zip(seg.outputs, seg.out_shardings))
