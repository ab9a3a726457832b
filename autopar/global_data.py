"""Data that spans processes: a global batch from each process's rows (`process_rows`,
`global_batch`), the shardings a plan expects for a step's arguments (`input_shardings`),
arguments placed in them (`place_leaves`) and arrays read back whole on every process
(`gather`).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from .kv_store import Store, fixed_timeout_s

# `gather`: how long a process waits for a leaf from a process that holds it, seconds
# (AUTOPAR_PLAN_TIMEOUT_S, when set, instead).
GATHER_TIMEOUT_S = 600.0


def process_rows(sharding: Sharding, global_shape: Sequence[int]) -> slice:
    """The rows (dim 0) of a global array of `global_shape` that this process passes to
    `global_batch`: the rows its devices hold when the sharding splits dim 0 across
    processes in process order (process k of N: rows k·B/N .. (k+1)·B/N for a batch
    split over every device), all rows when dim 0 is replicated across processes, and none
    (`slice(0, 0)`) when none of its devices is in the sharding (e.g. a pipeline stage's
    sub-mesh on other processes): it then holds no part of the array."""
    global_shape = tuple(global_shape)
    if not global_shape:
        return slice(0, 0)
    held = sharding.addressable_devices_indices_map(global_shape)
    if not held:
        return slice(0, 0)
    rows = [idx[0] for idx in held.values()]
    spans = sorted({(r.start or 0, global_shape[0] if r.stop is None else r.stop)
                    for r in rows})
    start, stop = spans[0][0], spans[0][1]
    for a, b in spans[1:]:
        if a > stop:  # this process's rows are not contiguous: it passes all of them
            return slice(0, global_shape[0])
        stop = max(stop, b)
    return slice(start, stop)


def global_batch(local_batch: Any, shardings: Any, batch_size: int) -> Any:
    """The global batch (a pytree of `jax.Array`s over every process's devices) built from
    this process's rows: `local_batch` holds, for every leaf, rows
    `process_rows(sharding, (batch_size, ...))` of the global batch (`jax.make_array_from
    _process_local_data`).  `shardings` is a pytree of shardings matching `local_batch`
    (or one sharding for every leaf); `batch_size` is the global batch size (dim 0).

    A process none of whose devices is in a leaf's sharding passes 0 rows of it (what
    `process_rows` gives; the whole batch is accepted too, and not used) and gets an array
    with no part on this process (`jax.make_array_from_single_device_arrays` of no shards):
    every process calls `global_batch` alike, the holders' rows make the array."""
    leaves, tree = jax.tree_util.tree_flatten(local_batch)
    if isinstance(shardings, Sharding):
        sh_leaves = [shardings] * len(leaves)
    else:
        sh_leaves = tree.flatten_up_to(shardings)
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(local_batch)[0]]
    out = []
    for path, x, sharding in zip(paths, leaves, sh_leaves):
        x = np.asarray(x)
        if x.ndim == 0:
            raise ValueError(f"global_batch: leaf batch{path} is a scalar; batch leaves have "
                             f"the batch as dim 0")
        shape = (batch_size, *x.shape[1:])
        if not sharding.addressable_devices:
            if x.shape[0] not in (0, batch_size):
                owners = sorted({d.process_index for d in sharding.device_set})
                raise ValueError(
                    f"global_batch: process {jax.process_index()} passed {x.shape[0]} rows of "
                    f"batch{path}, whose sharding lies on processes {owners} only: this "
                    f"process holds none of its rows (pass 0 rows: process_rows gives "
                    f"slice(0, 0))")
            out.append(jax.make_array_from_single_device_arrays(
                shape, sharding, [], dtype=jax.dtypes.canonicalize_dtype(x.dtype)))
            continue
        rows = process_rows(sharding, shape)
        if x.shape[0] != rows.stop - rows.start:
            raise ValueError(
                f"global_batch: process {jax.process_index()} passed {x.shape[0]} rows of "
                f"batch{path}, but its devices hold rows {rows.start}:{rows.stop} of the "
                f"global batch of {batch_size} (pass exactly those rows)")
        out.append(jax.make_array_from_process_local_data(sharding, x, shape))
    return jax.tree_util.tree_unflatten(tree, out)


def input_shardings(step, *args) -> tuple:
    """The sharding each argument should have on every process (a pytree of
    `NamedSharding`s per non-static argument).  `args` may be `jax.ShapeDtypeStruct`s.
    Create the state in place with `jax.jit(init, out_shardings=state_sharding)()` and the
    batch with `global_batch(rows, batch_sharding, batch_size)`: nothing is gathered on one
    host.

    Single-mesh plans (ShardParallel, DataParallel, ZeRO): the plan's own input layouts.
    Pipeline plans, whose stages hold their parts on sub-meshes that may lie on some
    processes only: every non-batch argument replicated over the step's devices and every
    batch leaf (`batch_argnums`) split by rows over them (replicated when its rows do not
    divide); the first step copies each stage's part onto its sub-mesh, and the state it
    returns is laid out by stage from then on."""
    from .constraints import build_mesh, to_pspec

    traced = step.trace(*args)
    plan = traced.plan
    if not plan.stages:
        mesh = build_mesh(plan, step.devices)
        leaves = [NamedSharding(mesh, to_pspec(s)) for s in plan.in_specs]
        return tuple(jax.tree_util.tree_unflatten(traced.in_tree, leaves))
    devices = step._devices()
    mesh = Mesh(np.array(devices), ("all",))
    whole = NamedSharding(mesh, PartitionSpec())
    rows = NamedSharding(mesh, PartitionSpec("all"))
    out = []
    for pos, arg in enumerate(args):
        if pos in step.static_argnums:
            continue
        split = pos in step.batch_argnums
        out.append(jax.tree.map(
            lambda x, split=split: rows if split and _splits(np.shape(x), len(devices))
            else whole, arg))
    return tuple(out)


def place_leaves(leaves: Sequence[Any], shardings: Sequence[Sharding],
                 names: Sequence[str]) -> list[Any]:
    """Each leaf laid out as its sharding, across processes; every process calls it with
    the same leaves in the same order (`autopar.place`).

    A leaf is, on each process, one of: a host value (numpy, Python scalar), a *local*
    array (on this process's devices only: `init_state()` run on every process), or a
    *global* array (a `jax.Array` over some other process's devices).  Host values and local
    arrays are this process's copy of the value: each process cuts its own shards from it,
    device to device for arrays, and no data crosses processes (every process must pass the
    same value, as with `jax.device_put` of a numpy array).  Global arrays move device to
    device (`transfer.move`), each received piece waited for within the transfer bound.
    The processes first agree on each leaf's kind through the key-value store (one
    exchange, bounded like `gather`): an array held by one process only is local there and
    global elsewhere, and moving it would pair no copies; it raises instead, naming it."""
    from . import transfer

    global _placements
    _placements += 1
    me, count = jax.process_index(), jax.process_count()
    kinds = [_leaf_kind(x, me) for x in leaves]
    store = Store()
    key = f"autopar/place/{_placements}"
    store.put(f"{key}/{me}", {"kinds": kinds})
    timeout_s = fixed_timeout_s() or GATHER_TIMEOUT_S
    seen = {p: (kinds if p == me else
                store.get(f"{key}/{p}", timeout_s, f"process {p}'s arguments to autopar.place")
                ["kinds"]) for p in range(count)}
    for k, name in enumerate(names):
        by_process = {p: seen[p][k] for p in range(count)}
        if len(set(by_process.values())) > 1:
            raise ValueError(
                f"autopar.place: argument leaf {name} is {_kinds_text(by_process)}; pass "
                f"every process either its own copy of the value (numpy, or an array on its "
                f"own devices) or one global array over the processes' devices "
                f"(`jax.jit(init, out_shardings=dist.input_shardings(step, ...)[0])()`)")
    out = []
    for x, sh, kind in zip(leaves, shardings, kinds):
        if kind == "host":
            out.append(jax.device_put(x, sh))
        elif kind == "local":
            out.append(transfer.from_local_copy(x, sh))
        else:
            src = x.sharding
            out.append(transfer.arrived(transfer.move(x, sh), src, "an argument of place"))
    return out


_placements = 0   # place_leaves calls so far (the same count on every process)


def _leaf_kind(x: Any, me: int) -> str:
    if not isinstance(x, jax.Array):
        return "host"
    if all(d.process_index == me for d in x.sharding.device_set):
        return "local"
    return "global"


def _kinds_text(by_process: Mapping[int, str]) -> str:
    words = {"host": "a host value", "local": "an array on its own devices",
             "global": "an array on other processes' devices"}
    return ", ".join(f"{words[kind]} on process {p}" for p, kind in by_process.items())


def _splits(shape: tuple[int, ...], n: int) -> bool:
    return len(shape) >= 1 and shape[0] % n == 0


def gather(tree: Any) -> Any:
    """Every leaf as a full numpy array on every process (for checks and logging: it copies
    the whole pytree to every host).  Every process must call it, the same number of times.
    Leaves spread over every process: one program per mesh replicates them.  Leaves on some
    processes only (a pipeline stage's): made whole among their own processes, then the
    first of those publishes the bytes (.npy) in the `jax.distributed` key-value store and
    the others read them (no cross-process device copy, whose matching depends on every
    process issuing the same transfers in the same order)."""
    global _gathers
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    everyone = set(range(jax.process_count()))
    me = jax.process_index()
    by_mesh: dict[Any, list[int]] = {}
    _gathers += 1
    for k, x in enumerate(leaves):
        if not isinstance(x, jax.Array):
            continue
        # Decided from the sharding alone (the same on every process): a leaf held whole by
        # this process may still be missing on the others.
        holders = {d.process_index for d in x.sharding.device_set}
        if holders == everyone:
            if not x.is_fully_addressable:
                by_mesh.setdefault(_replicated(x).mesh, []).append(k)
            continue
        leaves[k] = _publish(x, holders, f"autopar/gather/{_gathers}/{k}", me)
    for mesh, todo in by_mesh.items():
        whole = NamedSharding(mesh, PartitionSpec())
        copies = jax.jit(lambda *xs: xs, out_shardings=(whole,) * len(todo))(
            *[leaves[k] for k in todo])
        for k, x in zip(todo, copies):
            leaves[k] = x
    return jax.tree_util.tree_unflatten(treedef, [np.asarray(x) for x in leaves])


_gathers = 0   # gather calls so far (the same count on every process: keys never repeat)


def _publish(x: jax.Array, holders: set[int], key: str, me: int) -> np.ndarray:
    """`x` (held by the processes `holders`) as a numpy array on this process."""

    if me in holders:
        if x.is_fully_addressable:
            value = np.asarray(x)
        else:   # spread over several holders: a whole copy on each first
            if not x.is_fully_replicated:
                x = jax.jit(lambda a: a, out_shardings=_replicated(x))(x)
            value = np.asarray(x.addressable_data(0))
        if me == min(holders):
            buf = io.BytesIO()
            np.save(buf, value, allow_pickle=False)
            Store().put_bytes(key, buf.getvalue())
        return value
    timeout_s = fixed_timeout_s() or GATHER_TIMEOUT_S
    data = Store().get_bytes(key, timeout_s, f"leaf {key} from process {min(holders)}")
    return np.load(io.BytesIO(data), allow_pickle=False)


def _replicated(x: jax.Array) -> Sharding:
    if isinstance(x.sharding, NamedSharding):
        return NamedSharding(x.sharding.mesh, PartitionSpec())
    raise TypeError(f"gather: a {type(x.sharding).__name__} array of shape {x.shape}; "
                    f"gather takes arrays with a NamedSharding (what autopar steps return)")
