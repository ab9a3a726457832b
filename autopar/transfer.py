"""Moving arrays between (sub-)meshes, in one process or across processes.

In one process `jax.device_put` moves anything anywhere.  Across processes (multi-
controller JAX) every process runs the same driver loop but only computes on its own
devices; an array computed on another process is known here as a *placeholder*: a global
`jax.Array` with that array's shape, dtype and sharding and no local data.  An array moves
between processes, between two shardings with the same number of devices and the same
tiling, by one program on both device sets (a collective-permute, `_cross_process_copy`)
run by the processes that hold either side; the receiver checks the copy's signature.
(`jax.device_put` between processes needs `jax_cross_host_transfer_socket_address` on CPU,
and its copies, pulled by the receiver and served behind the sender's later programs,
deadlocked pipelines: see `_cross_process_copy`.)
`move` reduces every other case to that one:

1. on the source's devices, re-lay the array out with the tiling of the destination's
   wire layout (same device count; `wire_sharding`: the destination's layout cut further
   over the mesh axes it leaves unused, so that no byte crosses twice), or replicated on
   the first k devices when the counts differ (k = the smaller count);
2. the cross-process copy (same count, same tiling);
3. on the destination's devices, re-lay it out as asked (the wire pieces all-gathered
   into the copies the destination holds; a destination spanning several processes: a
   whole copy to one device of each, which cuts its own shards).

Steps 1 and 3 are local to the processes that hold the source or the destination; a
process that holds neither only makes a placeholder of the result.

In one process `local_move` does the same without the host.  `jax.device_put` copies device
to device only when every destination shard is a shard the source holds (jax 0.10.2
`array.shard_sharded_device_array_slow_path`); any other re-layout reads the whole array to
the host first, which waits for the producer and stalls the driver: on the MLP's 2-stage
pipeline those reads were a third of the driver thread's time per step.  So a re-layout
runs as a jitted identity on the devices that hold the data, and the copy between device
sets is one between equal tilings.
"""

from __future__ import annotations

import functools
import time
import zlib
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from . import env_settings
from .passes.transfer_cost import wire_spec


def multi_process() -> bool:
    return jax.process_count() > 1


TRANSFER_TIMEOUT_S = 120.0   # default bound on one cross-process copy's arrival (seconds)


class TransferError(RuntimeError):
    """A cross-process copy failed, or did not arrive within the bound
    (`transfer_timeout_s()`)."""


def transfer_timeout_s() -> float:
    """Seconds `arrived` waits for one copy: AUTOPAR_TRANSFER_TIMEOUT_S, else
    TRANSFER_TIMEOUT_S."""
    value = env_settings.positive("AUTOPAR_TRANSFER_TIMEOUT_S")
    return TRANSFER_TIMEOUT_S if value is None else value


def arrived(x: Any, source: Sharding | None = None, what: str = "an array") -> Any:
    """`x` once this process's shards of it hold their data, on CPU devices; `x` at once
    elsewhere, and where this process holds none of it.  The bounded wait on what a step
    received from other processes: past `transfer_timeout_s()`, or when the copy failed,
    `TransferError` names the array, where it came from and the bound (a process that
    stopped, or processes whose copies went out of order, end every process with a named
    error instead of a hang).  Before cross-process copies were programs
    (`_cross_process_copy`), a 2-stage pipeline over 2 processes x 4 devices whose loop did
    not read the loss hung in its third step in 3 of 3 runs, and this wait alone made it
    run (jax 0.10.2)."""
    if not (isinstance(x, jax.Array) and x.addressable_shards
            and x.addressable_shards[0].device.platform == "cpu"):
        return x
    peers = (f"process(es) {sorted(_processes(source))}" if source is not None
             else "another process")
    if x.dtype == np.bool_:
        # A received bool array never reports is_ready() (jax 0.10.2, CPU: 2 processes, a
        # bool[] copy that block_until_ready and programs see arrive), so it is waited for
        # without the poll: unbounded here, bounded by the peers' heartbeats.
        return _checked(x, what, peers)
    bound = transfer_timeout_s()
    start = time.monotonic()
    pause = 1e-4
    while not x.is_ready():
        waited = time.monotonic() - start
        if waited > bound:
            raise TransferError(
                f"process {jax.process_index()} waited {waited:.0f} s for {what} "
                f"{x.dtype}{list(x.shape)} from {peers} and gave up: the sender never made "
                f"the copy, or made its copies in another order (every process must run the "
                f"same steps on the same values in the same order); "
                f"AUTOPAR_TRANSFER_TIMEOUT_S sets the bound ({bound:g} s)")
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    return _checked(x, what, peers)


def _checked(x: jax.Array, what: str, peers: str) -> jax.Array:
    """`x` once it has arrived; `TransferError` when its copy failed."""
    try:
        x.block_until_ready()
    except jax.errors.JaxRuntimeError as err:
        raise TransferError(
            f"process {jax.process_index()}: the copy of {what} {x.dtype}{list(x.shape)} "
            f"from {peers} failed ({str(err).splitlines()[0]}): the processes made their "
            f"cross-process copies in different orders, or a peer stopped (every process "
            f"must run the same steps on the same values in the same order)") from None
    return x


def to_every_process(x: jax.Array, whole: NamedSharding) -> jax.Array:
    """`x` (held by some processes: a stage's output) replicated on every device of
    `whole` (a 1-D mesh spanning every process), by one program every process runs: a
    `(devices, *shape)` array whose row on the first device holding `x` is `x` and whose
    other rows are zeros, indexed at that row.  No cross-process `jax.device_put`: one
    sender's copies to several processes in a row were lost (4 processes x 2 devices, a
    4-stage pipeline's loss to every process: 2 of 3 receivers waited forever, jax 0.10.2),
    while collectives among every process run as the single-mesh plans' do."""
    devices = list(whole.mesh.devices.flat)
    x = _whole(x)
    first = _devices(x.sharding)[0]
    row = devices.index(first)
    held = {s.device: s.data for s in x.addressable_shards}
    pieces = [held[d][None] if d == first else
              _zeros((1,) + tuple(x.shape), np.dtype(x.dtype), d)
              for d in devices if d.process_index == jax.process_index()]
    rows = jax.make_array_from_single_device_arrays(
        (len(devices),) + x.shape, NamedSharding(whole.mesh, PartitionSpec(
            whole.mesh.axis_names[0])), pieces, dtype=x.dtype)
    return _row(row, whole)(rows)


@functools.lru_cache(maxsize=256)
def _row(row: int, whole: NamedSharding):
    return jax.jit(lambda a: a[row], out_shardings=whole)


def is_local(sharding: Sharding) -> bool:
    """Whether this process holds at least one device of `sharding`."""
    me = jax.process_index()
    return any(d.process_index == me for d in sharding.device_set)


def placeholder(shape: tuple[int, ...], dtype: Any, sharding: Sharding) -> jax.Array:
    """A global array with no data on this process (its shards live on other processes)."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [],
                                                    dtype=np.dtype(dtype))


def _processes(sharding: Sharding) -> frozenset[int]:
    return frozenset(d.process_index for d in sharding.device_set)


def _devices(sharding: Sharding) -> list[jax.Device]:
    if isinstance(sharding, NamedSharding):
        return list(sharding.mesh.devices.flat)
    return sorted(sharding.device_set, key=lambda d: d.id)


def _replicated_on(devices: list[jax.Device]) -> NamedSharding:
    mesh = Mesh(np.array(devices, dtype=object), ("_copy",))
    return NamedSharding(mesh, PartitionSpec())


def with_tiling(dst: NamedSharding, devices: list[jax.Device]) -> NamedSharding:
    """`dst`'s mesh shape, axes and spec on other devices (the same tiling)."""
    grid = np.array(devices, dtype=object).reshape(dst.mesh.devices.shape)
    return NamedSharding(Mesh(grid, dst.mesh.axis_names,
                              axis_types=dst.mesh.axis_types), dst.spec)


def _step(x: jax.Array, sharding: Sharding) -> jax.Array:
    """One `device_put`: made by every process for a cross-process copy, by the processes
    holding `x` or `sharding` for a local one (elsewhere a placeholder)."""
    if x.sharding == sharding:
        return x
    if _processes(x.sharding) != _processes(sharding):
        return _cross_process_copy(x, sharding)
    if is_local(x.sharding) or is_local(sharding):
        return jax.device_put(x, sharding)
    return placeholder(x.shape, x.dtype, sharding)


def _cross_process_copy(x: jax.Array, sharding: Sharding) -> jax.Array:
    """`x` copied to `sharding`, an equal tiling on other processes' devices: one program
    on the source and destination devices together (a collective-permute of each tile
    from its source device to its destination device, `_pair_permute`), run by the
    processes holding either side; the others only make a placeholder.

    Not `jax.device_put`: JAX's cross-process copy on CPU is pulled by the receiver and
    served from the sender's device queue, behind any program the sender dispatched
    after it; a sender whose next program waited on the receiver never served the copy
    (2 processes x 4 devices, 2-stage pipelines: a stage program waiting for a cotangent,
    or a batch all-gather, behind an activation or a tied weight the other process
    waited for; jax 0.10.2).  A program is ordered with the others on every device, as in
    the single-mesh plans.  Shardings whose device sets overlap fall back to device_put."""
    src, dst = x.sharding, sharding
    if not (isinstance(src, NamedSharding) and isinstance(dst, NamedSharding)
            and src.mesh.devices.shape == dst.mesh.devices.shape
            and src.mesh.axis_names == dst.mesh.axis_names and src.spec == dst.spec
            and not (src.device_set & dst.device_set)):
        return jax.device_put(x, sharding)
    if not (is_local(src) or is_local(dst)):
        return placeholder(x.shape, x.dtype, sharding)
    grid = np.stack([src.mesh.devices, dst.mesh.devices])
    mesh = Mesh(grid, ("_pair",) + tuple(dst.mesh.axis_names))
    pair = NamedSharding(mesh, PartitionSpec("_pair", *dst.spec))
    shape = (2,) + tuple(x.shape)
    held = {s.device: s.data for s in x.addressable_shards}
    sources = set(src.device_set)
    # The copy's signature (shape, dtype and its rank among this pair of process sets'
    # copies) travels with it: copies made in different orders pair the wrong programs,
    # which gloo runs without complaint, and the receiver's check names the mismatch.
    key = (_processes(src), _processes(dst))
    _copies[key] = serial = _copies.get(key, 0) + 1
    signature = zlib.crc32(f"{tuple(x.shape)} {np.dtype(x.dtype)} {serial}".encode()) >> 1
    pieces, signs = [], []
    for device, index in pair.addressable_devices_indices_map(shape).items():
        if device in sources:
            pieces.append(_add_axis(held[device]))
        else:
            tile = tuple(len(range(*i.indices(n))) for i, n in zip(index[1:], x.shape))
            pieces.append(_zeros((1,) + tile, np.dtype(x.dtype), device))
        signs.append(jax.device_put(np.array([signature if device in sources else 0],
                                             np.int32), device))
    both = jax.make_array_from_single_device_arrays(shape, pair, pieces, dtype=x.dtype)
    sign_sharding = NamedSharding(mesh, PartitionSpec("_pair"))
    signed = jax.make_array_from_single_device_arrays((2,), sign_sharding, signs,
                                                      dtype=np.int32)
    moved, got = _pair_permute(mesh, pair.spec)(both, signed)
    if not is_local(dst):
        return placeholder(x.shape, x.dtype, sharding)
    targets = set(dst.device_set)
    out = [_drop_axis(s.data) for s in moved.addressable_shards if s.device in targets]
    y = jax.make_array_from_single_device_arrays(x.shape, sharding, out, dtype=x.dtype)
    if next(iter(targets)).platform == "cpu":
        mark = next(s.data for s in got.addressable_shards if s.device in targets)
        received = int(np.asarray(arrived(mark, src, "a copy's signature"))[0])
        if received != signature:
            raise TransferError(
                f"process {jax.process_index()}: cross-process copy {serial} from "
                f"process(es) {sorted(key[0])} of an array {np.dtype(x.dtype)}"
                f"{list(x.shape)} received another copy (signature {received}, expected "
                f"{signature}): the processes made their cross-process copies in "
                f"different orders (every process must run the same steps on the same "
                f"values in the same order)")
    return y


_copies: dict[tuple[frozenset[int], frozenset[int]], int] = {}   # copies per process pair


@functools.lru_cache(maxsize=1024)
def _pair_permute(mesh: Mesh, spec: PartitionSpec):
    """A jitted program on `mesh` (leading axis `_pair` of size 2) sending each tile of
    row 0 to the device holding the same tile of row 1."""
    def body(a, sign):
        return jax.lax.ppermute((a, sign), "_pair", [(0, 1)])

    signs = PartitionSpec("_pair")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, signs),
                                 out_specs=(spec, signs)))


@functools.lru_cache(maxsize=1024)
def _zeros_fn(shape: tuple[int, ...], dtype: np.dtype, device: jax.Device):
    return jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=jax.sharding.
                   SingleDeviceSharding(device))


def _zeros(shape: tuple[int, ...], dtype: np.dtype, device: jax.Device) -> jax.Array:
    return _zeros_fn(shape, dtype, device)()


def _add_axis(a: jax.Array) -> jax.Array:
    return a.reshape((1,) + a.shape)


def _drop_axis(a: jax.Array) -> jax.Array:
    return a.reshape(a.shape[1:])


def move(x: Any, sharding: Sharding) -> Any:
    """`x` laid out as `sharding`, wherever its data lives (see the module docstring).
    Every process of the job calls it for the same values in the same order."""
    if not isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    if x.sharding == sharding:
        return x
    if not multi_process():
        return local_move(x, sharding)
    if x.is_fully_addressable and sharding.is_fully_addressable:
        if len(x.sharding.device_set) == len(sharding.device_set):
            return jax.device_put(x, sharding)
        # jax 0.10.2 takes a multi-process device_put between device lists of different
        # sizes for a cross-host copy (and fails): cut the shards from a whole copy instead
        return from_local_copy(x, sharding)
    if x.sharding.device_set == sharding.device_set:   # a re-layout among the same devices
        return _relayout(x, sharding)
    if len(_processes(x.sharding)) > 1 and not x.is_fully_replicated:
        # Spread over several processes: first a whole copy on each of them (an
        # all-gather among x's own devices), then as below.
        x = _relayout(x, NamedSharding(Mesh(np.array(_devices(x.sharding), dtype=object),
                                            ("_all",)), PartitionSpec()))
    if x.is_fully_replicated and _processes(sharding) <= _processes(x.sharding):
        # Every process of the destination holds a whole copy: it cuts its own shards.
        return _from_local_copy(x, sharding)
    src_devices, dst_devices = _devices(x.sharding), _devices(sharding)
    if len(_processes(sharding)) > 1 and len(src_devices) != len(dst_devices):
        return _to_processes(x, sharding)
    if len(src_devices) == len(dst_devices) and isinstance(sharding, NamedSharding):
        # As `local_move`: the wire pieces cross, the destination gathers its copies.
        on_wire = wire_sharding(sharding, tuple(x.shape))
        y = _step(_step(x, with_tiling(on_wire, src_devices)), on_wire)
        return y if on_wire is sharding else _relayout(y, sharding)
    k = min(len(src_devices), len(dst_devices))
    return move(_step(_narrow(x, src_devices[:k]), _replicated_on(dst_devices[:k])), sharding)


def local_move(x: jax.Array, sharding: Sharding) -> jax.Array:
    """`x` laid out as `sharding` in one process, device to device, asynchronously: a
    re-layout among x's devices (a jitted identity) and/or one copy between equal tilings,
    that of the destination's wire layout (`wire_sharding`), all-gathered on the
    destination where it holds copies (to a different device count: whole copies, cut on
    the destination).  `passes.transfer_cost` prices these steps."""
    if x.sharding == sharding:
        return x
    for op in _route(x.sharding, sharding, tuple(x.shape)):
        x = op(x)
    return x


@functools.lru_cache(maxsize=4096)
def _route(src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """The steps `local_move` takes from `src` to `dst` for an array of `shape` (each
    x -> x)."""
    def copy_to(sharding: Sharding) -> Any:
        return functools.partial(jax.device_put, device=sharding)

    ndim = len(shape)
    if src.device_set == dst.device_set:
        return (copy_to(dst),) if _same_tiling(src, dst, ndim) else (_reshard(dst),)
    src_devices, dst_devices = _devices(src), _devices(dst)
    if len(src_devices) == len(dst_devices) and isinstance(dst, NamedSharding):
        # Each receiving device is copied its piece of the wire layout, which the
        # destination then gathers (none when `dst` holds no two equal pieces).
        on_wire = wire_sharding(dst, shape)
        mid = with_tiling(on_wire, src_devices)
        steps = () if _same_tiling(src, mid, ndim) else (_reshard(mid),)
        steps += (copy_to(on_wire),)
        return steps if on_wire is dst else steps + (_reshard(dst),)
    if _same_tiling(src, dst, ndim):
        return (copy_to(dst),)
    whole = _replicated_on(dst_devices)
    last = copy_to(dst) if dst.is_fully_replicated else _reshard(dst)
    return (_reshard(_replicated_on(src_devices)), copy_to(whole), last)


def wire_sharding(dst: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """The layout an array of `shape` crosses into `dst` from other devices in: `dst` cut
    further over the mesh axes its spec leaves unused (`transfer_cost.wire_spec`, which
    the planner prices the move by), so that the slow link between two device sets
    carries each byte once and the copies `dst` holds are made by an all-gather among its
    own devices.  `dst` itself where it holds no two equal pieces."""
    spec = tuple(_axes_of(entry) for entry in tuple(dst.spec) + (None,) * (
        len(shape) - len(dst.spec)))
    mesh = dst.mesh
    cut = wire_spec(shape, spec, mesh.devices.shape, mesh.axis_names)
    if cut == spec:
        return dst
    return NamedSharding(mesh, PartitionSpec(*(
        None if not axes else axes[0] if len(axes) == 1 else axes for axes in cut)))


def _axes_of(entry: Any) -> tuple[str, ...]:
    """A `PartitionSpec` entry as the tuple of mesh axes it splits its dim over."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _same_tiling(a: Sharding, b: Sharding, ndim: int) -> bool:
    """Whether `a` and `b` cut an array alike, device k of one holding device k's piece of
    the other (`jax.device_put` then copies shard by shard)."""
    if len(a.device_set) != len(b.device_set):
        return False
    try:
        return a._to_xla_hlo_sharding(ndim) == b._to_xla_hlo_sharding(ndim)
    except (NotImplementedError, AttributeError):
        return False


@functools.lru_cache(maxsize=4096)
def _reshard(sharding: Sharding):
    """A jitted identity onto `sharding` (its input on the same devices), one per layout."""
    return jax.jit(_identity, out_shardings=sharding)


def _identity(a: jax.Array) -> jax.Array:
    return a


def _whole(x: jax.Array) -> jax.Array:
    """`x` replicated on its own devices."""
    if x.is_fully_replicated:
        return x
    return _relayout(x, _replicated_on(_devices(x.sharding)))


def _narrow(x: jax.Array, devices: list[jax.Device]) -> jax.Array:
    """`x` replicated on `devices` (some of its own devices), from the shards it has there."""
    x = _whole(x)
    pieces = [s.data for s in x.addressable_shards if s.device in devices]
    return jax.make_array_from_single_device_arrays(x.shape, _replicated_on(devices), pieces,
                                                    dtype=x.dtype)


def _to_processes(x: jax.Array, sharding: Sharding) -> jax.Array:
    """`x` laid out as `sharding`, which spans several processes: a whole copy moved onto
    the first destination device of each of those processes, then each cuts its shards."""
    firsts: dict[int, jax.Device] = {}
    for d in _devices(sharding):
        firsts.setdefault(d.process_index, d)
    me = jax.process_index()
    pieces = []
    for d in firsts.values():
        y = move(x, NamedSharding(Mesh(np.array([d], dtype=object), ("_copy",)),
                                  PartitionSpec()))
        if d.process_index == me:
            pieces.append(y.addressable_data(0))
    whole = jax.make_array_from_single_device_arrays(
        x.shape, _replicated_on(list(firsts.values())), pieces, dtype=x.dtype)
    return _from_local_copy(whole, sharding)


def _relayout(x: jax.Array, sharding: Sharding) -> jax.Array:
    """`x` re-laid out among its own devices (every process holding some takes part)."""
    if not is_local(x.sharding):
        return placeholder(x.shape, x.dtype, sharding)
    return _reshard(sharding)(x)


def from_local_copy(x: jax.Array, sharding: Sharding) -> jax.Array:
    """`x`, an array on this process's own devices holding the whole value (each process
    its own copy), laid out as `sharding` (possibly over several processes): each process
    cuts its own shards, device to device, and no data crosses processes."""
    return _from_local_copy(_whole(x), sharding)


def _from_local_copy(x: jax.Array, sharding: Sharding) -> jax.Array:
    """A fully replicated `x` laid out as `sharding`, each process cutting its shards from
    its own copy (no data crosses processes)."""
    pieces = []
    targets = sharding.addressable_devices_indices_map(x.shape)
    if targets:
        whole = x.addressable_data(0)
        pieces = [jax.device_put(whole[index], device) for device, index in targets.items()]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, pieces,
                                                    dtype=x.dtype)
