"""Moving arrays between (sub-)meshes, in one process or across processes.

In one process `jax.device_put` moves anything anywhere.  Across processes (multi-
controller JAX) every process runs the same driver loop but only computes on its own
devices; an array computed on another process is known here as a *placeholder*: a global
`jax.Array` with that array's shape, dtype and sharding and no local data.  JAX moves an
array between processes with `jax.device_put` called in every process that holds either
side, when the two shardings have the same number of devices and the same tiling
(docs/multi_process.md; jax 0.10.2 `dispatch._is_supported_cross_host_transfer`), with
`jax_cross_host_transfer_socket_address` set (`autopar.distributed.initialize` does).
`move` reduces every other case to that one:

1. on the source's devices, re-lay the array out with the destination's tiling (same
   device count), or replicated on the first k devices when the counts differ
   (k = the smaller count);
2. the cross-process copy (same count, same tiling);
3. on the destination's devices, re-lay it out as asked (a destination spanning several
   processes: a whole copy to one device of each, which cuts its own shards).

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
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding


def multi_process() -> bool:
    return jax.process_count() > 1


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
        # A cross-process copy: every process of the job makes the call, also those that
        # hold neither side.  JAX pairs a sender's and a receiver's copies by the order of
        # these calls in each process; a process that skipped the copies between two
        # others would pair its next ones wrongly (measured: 3 processes, 0->1 twice then
        # 1->2 hangs unless process 2 also calls the first two).
        return jax.device_put(x, sharding)
    if is_local(x.sharding) or is_local(sharding):
        return jax.device_put(x, sharding)
    return placeholder(x.shape, x.dtype, sharding)


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
        return _from_local_copy(_whole(x), sharding)
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
        mid = with_tiling(sharding, src_devices)
        return _step(_step(x, mid), sharding)
    k = min(len(src_devices), len(dst_devices))
    return move(_step(_narrow(x, src_devices[:k]), _replicated_on(dst_devices[:k])), sharding)


def local_move(x: jax.Array, sharding: Sharding) -> jax.Array:
    """`x` laid out as `sharding` in one process, device to device, asynchronously: a
    re-layout among x's devices (a jitted identity) and/or one copy between equal tilings
    (to a different device count: whole copies, cut on the destination)."""
    if x.sharding == sharding:
        return x
    for op in _route(x.sharding, sharding, x.ndim):
        x = op(x)
    return x


@functools.lru_cache(maxsize=4096)
def _route(src: Sharding, dst: Sharding, ndim: int) -> tuple[Any, ...]:
    """The steps `local_move` takes from `src` to `dst` (each x -> x)."""
    def copy_to(sharding: Sharding) -> Any:
        return functools.partial(jax.device_put, device=sharding)

    if _same_tiling(src, dst, ndim):
        return (copy_to(dst),)
    if src.device_set == dst.device_set:
        return (_reshard(dst),)
    src_devices, dst_devices = _devices(src), _devices(dst)
    if len(src_devices) == len(dst_devices) and isinstance(dst, NamedSharding):
        return (_reshard(with_tiling(dst, src_devices)), copy_to(dst))
    whole = _replicated_on(dst_devices)
    last = copy_to(dst) if dst.is_fully_replicated else _reshard(dst)
    return (_reshard(_replicated_on(src_devices)), copy_to(whole), last)


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
