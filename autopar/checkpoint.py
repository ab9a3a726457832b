"""Checkpoints of parallel training state, with Orbax.

`Checkpoints` wraps `orbax.checkpoint.CheckpointManager`: it saves the state a step returns
(asynchronously by default, keeping the last K steps) and restores it straight into the
layouts a parallelized step expects (`restore_target`), whatever plan wrote it: Orbax and
tensorstore read, on each process, only the shards that process's devices hold in the
target layout, so a checkpoint written by a 2-stage pipeline on 8 devices restores into a
4-device mesh without passing through one host.  Saves are atomic (Orbax writes into a
temporary directory and renames it when every process has finished): a killed save leaves
the previous checkpoints readable and is ignored.

Multi-process: create `Checkpoints` and call `save` / `restore` on every process, on a
directory every process sees; Orbax coordinates the processes (the primary process writes
the metadata, each process its own shards).

    ckpts = autopar.Checkpoints("/ckpt", max_to_keep=3)
    state = ckpts.restore(autopar.checkpoint.restore_target(step, abstract_state, batch))
    ckpts.save(i, state)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import transfer
from .api import ParallelizedFunction

_ITEM = ocp.checkpoint_manager.DEFAULT_ITEM_NAME


class CheckpointMismatchError(ValueError):
    """A restore target whose tree, shapes or dtypes differ from the checkpoint's."""


def restore_target(step: ParallelizedFunction, *args, argnum: int = 0) -> Any:
    """Argument `argnum` of `step(*args)` as a pytree of `jax.ShapeDtypeStruct`s carrying
    the shardings `step`'s program expects for it: what `Checkpoints.restore` reads a
    checkpoint into.  `args` may be `jax.ShapeDtypeStruct`s (e.g. `jax.eval_shape(init)`
    after a restart): nothing is allocated."""
    if argnum in step.static_argnums or not 0 <= argnum < len(args):
        raise ValueError(f"restore_target(argnum={argnum}): expected the position of a "
                         f"dynamic argument of the {len(args)} given (static_argnums="
                         f"{step.static_argnums})")
    index = argnum - sum(1 for i in step.static_argnums if i < argnum)
    shardings = step.input_shardings(*args)[index]
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x), sharding=s),
        args[argnum], shardings)


def _spanning_every_process(state: Any) -> Any:
    """`state` with each `jax.Array` leaf held by some processes only replaced by a copy
    replicated over every device of every process (the other leaves as they are)."""
    from . import global_data

    leaves, tree = jax.tree_util.tree_flatten(state)
    everyone = set(range(jax.process_count()))
    partial = [k for k, x in enumerate(leaves) if isinstance(x, jax.Array)
               and {d.process_index for d in x.sharding.device_set} != everyone]
    if partial:
        whole = NamedSharding(Mesh(np.array(jax.devices()), ("all",)), PartitionSpec())
        values = global_data.gather([leaves[k] for k in partial])
        for k, value in zip(partial, values):
            leaves[k] = jax.make_array_from_process_local_data(whole, value, value.shape)
    return jax.tree_util.tree_unflatten(tree, leaves)


class Checkpoints:
    """Numbered checkpoints of a training state in one directory (an Orbax
    `CheckpointManager`, available as `.manager`).

    Args:
      directory: where the checkpoints live (created if missing); one subdirectory per
        step.  Every process of a multi-process job must see the same directory.
      max_to_keep: how many of the latest checkpoints to keep (None: all).
      save_interval_steps: `save(step, ...)` writes only when `step` is a multiple of this
        (unless `force=True`).
      async_save: `save` returns once the arrays are copied off the devices and writes in
        the background (the next `save`, `wait_until_finished` or `close` waits for it).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 save_interval_steps: int = 1, async_save: bool = True):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"Checkpoints(max_to_keep={max_to_keep}): expected None or >= 1")
        if save_interval_steps < 1:
            raise ValueError(f"Checkpoints(save_interval_steps={save_interval_steps}): "
                             f"expected >= 1")
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save, cleanup_tmp_directories=True, create=True)
        # The state is the manager's one unnamed item, saved and read by Orbax's standard
        # pytree handler; registered up front so that a fresh process reads its metadata.
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for args in (ocp.args.StandardSave, ocp.args.StandardRestore):
            registry.add(_ITEM, args, ocp.handlers.StandardCheckpointHandler)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             handler_registry=registry)

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Saves `state` (a pytree of arrays, e.g. what a parallelized step returns, with
        leaves on any meshes) as checkpoint `step`; returns whether it wrote (see
        `save_interval_steps`).  Call it on every process.

        With several processes, a leaf held by some processes only (a pipeline stage's
        state on sub-meshes of some hosts, which Orbax cannot write: it writes arrays that
        span every process) is first copied to every process (`distributed.gather`, through
        the `jax.distributed` key-value store: meant for states of up to some hundred MB)
        and saved replicated; it restores into any layout like every other leaf."""
        if jax.process_count() > 1 and (force or self.manager.should_save(step)):
            state = _spanning_every_process(state)
        return self.manager.save(step, args=ocp.args.StandardSave(state), force=force)

    def restore(self, target: Any, step: int | None = None) -> Any:
        """Checkpoint `step` (default: the latest) read into `target`'s layouts.

        `target` is a pytree like the saved state whose leaves are arrays or
        `jax.ShapeDtypeStruct`s with a `sharding` (`restore_target(step, ...)` builds it for
        a parallelized step); every leaf is read straight into its sharding, each process
        reading only its own shards.  Raises `CheckpointMismatchError`, naming the first
        differing leaf, when the target's tree, shapes or dtypes differ from the
        checkpoint's, and `FileNotFoundError` when there is no such checkpoint."""
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(f"no checkpoint step {step} in {self.directory} "
                                    f"(it holds steps {list(steps)})")
        abstract = _abstract(target)
        saved = self.manager.item_metadata(step)
        check_matches(getattr(saved, "tree", saved), abstract,
                      f"checkpoint step {step} in {self.directory}")
        if jax.process_count() == 1:
            return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        # Leaves whose layout leaves some process without a shard (a pipeline stage's
        # state): Orbax creates arrays that span every process, so read them replicated
        # over every device, then each process cuts its own shards.
        leaves, tree = jax.tree_util.tree_flatten(abstract)
        everyone = set(range(jax.process_count()))
        whole = NamedSharding(Mesh(np.array(jax.devices()), ("all",)), PartitionSpec())
        partial = [k for k, x in enumerate(leaves)
                   if {d.process_index for d in x.sharding.device_set} != everyone]
        wide = list(leaves)
        for k in partial:
            wide[k] = jax.ShapeDtypeStruct(leaves[k].shape, leaves[k].dtype, sharding=whole)
        restored = jax.tree_util.tree_leaves(self.manager.restore(
            step, args=ocp.args.StandardRestore(jax.tree_util.tree_unflatten(tree, wide))))
        for k in partial:
            restored[k] = transfer.move(restored[k], leaves[k].sharding)
        return jax.tree_util.tree_unflatten(tree, restored)

    def restore_into(self, train_step: ParallelizedFunction, *args, argnum: int = 0,
                     step: int | None = None) -> Any:
        """`restore(restore_target(train_step, *args, argnum=argnum), step)`: the checkpoint
        laid out as `train_step`'s argument `argnum` (default: the state) must be."""
        return self.restore(restore_target(train_step, *args, argnum=argnum), step)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, None when there is none."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (interrupted saves excluded)."""
        return sorted(self.manager.all_steps())

    def wait_until_finished(self) -> None:
        """Blocks until the background save, if any, is committed."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's resources."""
        self.manager.close()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _abstract(target: Any) -> Any:
    def leaf(path, x) -> jax.ShapeDtypeStruct:
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):
            raise ValueError(f"restore target leaf {jax.tree_util.keystr(path)} "
                             f"({type(x).__name__}) has no sharding: give arrays or "
                             f"jax.ShapeDtypeStruct(shape, dtype, sharding=...) leaves "
                             f"(autopar.checkpoint.restore_target builds them for a step)")
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(leaf, target)


# Key kinds in a pytree path → the name Orbax stores for them (a namedtuple's field is
# saved as a dict key, a tuple's index as a list index).
_KEY_NAMES: dict[type, Callable[[Any], str]] = {
    jax.tree_util.DictKey: lambda k: str(k.key),
    jax.tree_util.GetAttrKey: lambda k: k.name,
    jax.tree_util.SequenceKey: lambda k: str(k.idx),
    jax.tree_util.FlattenedIndexKey: lambda k: str(k.key),
}


def _key_path(path) -> tuple[str, ...]:
    return tuple(_KEY_NAMES.get(type(k), str)(k) for k in path)


def check_matches(saved: Any, target: Any, where: str) -> None:
    """Raises `CheckpointMismatchError` naming the first leaf (in `target`'s order, then
    leaves only the checkpoint has) whose presence, shape or dtype differs between the
    saved tree's metadata (leaves with `.shape` and `.dtype`) and `target`."""
    stored = {_key_path(p): (p, m) for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]}
    seen: set[tuple[str, ...]] = set()
    for path, x in jax.tree_util.tree_flatten_with_path(target)[0]:
        key = _key_path(path)
        name = jax.tree_util.keystr(path)
        if key not in stored:
            raise CheckpointMismatchError(
                f"restore target leaf {name} {_describe(x)} is not in {where} "
                f"({len(stored)} leaves saved)")
        seen.add(key)
        meta = stored[key][1]
        if _describe(meta) != _describe(x):
            raise CheckpointMismatchError(
                f"restore target leaf {name} is {_describe(x)}, but {where} holds "
                f"{_describe(meta)} there")
    for key, (path, meta) in stored.items():
        if key not in seen:
            raise CheckpointMismatchError(
                f"{where} holds leaf {jax.tree_util.keystr(path)} {_describe(meta)}, which "
                f"the restore target does not have")


def _describe(x: Any) -> str:
    """dtype[shape] of an array, a `ShapeDtypeStruct` or Orbax's metadata of one."""
    return f"{getattr(x, 'dtype', '?')}{list(getattr(x, 'shape', ()))}"


__all__ = ["CheckpointMismatchError", "Checkpoints", "check_matches", "restore_target"]
