"""A train step traced for planning (`trace_step`): its jaxpr as a `Graph` with the
micro-batches accumulated, the step at micro-batch size for pipelines, the batch inputs and
the (new state <-> state) ties between outputs and inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from autopar.graph import Graph

from . import inline, markers, microbatch, planner
from .traced import leaf_positions


def _is_weak(x: Any) -> bool:
    """Python scalars trace as weakly typed values, as under jax.jit."""
    return isinstance(x, int | float | complex) or bool(getattr(x, "weak_type", False))


@dataclasses.dataclass(frozen=True, eq=False)
class StepTrace:
    """A traced step, before planning.

    Attributes:
      program: the whole step (micro-batches accumulated) for single-mesh planning.
      out_tree: the step's output treedef.
      micro: the step traced at micro-batch size (before accumulation), for pipelines.
      batch_positions: flattened input positions of the batch leaves.
      args_info: abstract value of every flattened input (full batch).
    """

    program: planner.Program
    out_tree: Any
    micro: Any
    batch_positions: frozenset[int]
    args_info: tuple[jax.ShapeDtypeStruct, ...]


def trace_step(fun: Callable, dynamic: list, static: tuple, positions: list[int], in_tree,
          batch_argnums: Sequence[int], num_micro_batches: int = 1,
          accumulate: bool = True) -> StepTrace:
    """Traces `fun` on abstract values; with `num_micro_batches` > 1 the step is traced at
    micro-batch size and its batch-dependent part accumulates over micro-batches."""
    leaves = jax.tree_util.tree_leaves(dynamic)
    nargs = len(positions) + len(static)

    def flat_fun(*flat):
        dyn = jax.tree_util.tree_unflatten(in_tree, list(flat))
        full: list[Any] = [None] * nargs
        for pos, value in zip(positions, dyn):
            full[pos] = value
        for pos, value in static:
            full[pos] = value
        return fun(*full)

    abstract = [x if isinstance(x, jax.ShapeDtypeStruct) else
                jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x),
                                     weak_type=_is_weak(x))
                for x in leaves]
    paths = [planner.describe_path(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(
                 {f"arg{pos}": sub for pos, sub in zip(positions, dynamic)})[0]]
    leaf_pos = leaf_positions(in_tree, positions)
    batch_positions = {i for i, p in enumerate(leaf_pos) if p in batch_argnums}
    batch_sizes = [jax.numpy.shape(leaves[i])[0] for i in sorted(batch_positions)
                   if jax.numpy.shape(leaves[i])]
    if num_micro_batches > 1:
        microbatch.check_divisible(
            [(paths[i], tuple(jax.numpy.shape(leaves[i]))) for i in sorted(batch_positions)],
            num_micro_batches)
        if not batch_sizes:
            raise microbatch.MicroBatchError(
                f"num_micro_batches={num_micro_batches} needs batch arguments: none of "
                f"batch_argnums={tuple(batch_argnums)} holds an array")
        traced_avals = microbatch.micro_avals(abstract, batch_positions, num_micro_batches)
    else:
        traced_avals = abstract
    with markers.recording():
        closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*traced_avals)
    closed = inline.run(closed)
    micro = closed
    if num_micro_batches > 1 and accumulate:
        # Single-mesh plans see every micro-batch (unrolled); pipelines only need one.
        closed = microbatch.rewrite(closed, abstract, batch_positions, num_micro_batches)
    graph = Graph.from_jaxpr(closed)
    out_tree = jax.tree_util.tree_structure(out_shape)
    roles = planner.input_roles(graph, batch_positions)
    ties = _find_ties(dynamic, positions, out_shape, leaf_pos, batch_argnums)
    program = planner.Program(graph, tuple(paths), roles, ties,
                              batch_sizes[0] if batch_sizes else None)
    return StepTrace(program, out_tree, micro, frozenset(batch_positions), tuple(abstract))


def _find_ties(dynamic: list, positions: list[int], out_shape, leaf_pos: list[int],
               batch_argnums: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(output leaf, input leaf) pairs where a non-batch argument's whole pytree appears,
    with the same structure and avals, as a subtree of the output (new state ↔ state)."""
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    out_index = jax.tree_util.tree_unflatten(out_tree, list(range(len(out_leaves))))
    ties: list[tuple[int, int]] = []
    used: set[int] = set()
    first_leaf = 0
    for pos, arg in zip(positions, dynamic):
        arg_leaves, arg_tree = jax.tree_util.tree_flatten(arg)
        in_ids = list(range(first_leaf, first_leaf + len(arg_leaves)))
        first_leaf += len(arg_leaves)
        if pos in batch_argnums or not arg_leaves:
            continue
        for sub in _subtrees(out_index):
            sub_leaves, sub_tree = jax.tree_util.tree_flatten(sub)
            if sub_tree != arg_tree or any(i in used for i in sub_leaves):
                continue
            if all(_same_aval(out_leaves[o], a) for o, a in zip(sub_leaves, arg_leaves)):
                ties.extend(zip(sub_leaves, in_ids))
                used.update(sub_leaves)
                break
    return tuple(ties)


def _subtrees(tree):
    yield tree
    children, _ = jax.tree_util.tree_flatten(tree, is_leaf=lambda n: n is not tree)
    if len(children) == 1 and children[0] is tree:
        return
    for child in children:
        if isinstance(child, int):
            continue
        yield from _subtrees(child)


def _same_aval(a, b) -> bool:
    return (tuple(jax.numpy.shape(a)) == tuple(jax.numpy.shape(b))
            and jax.numpy.result_type(a) == jax.numpy.result_type(b))
