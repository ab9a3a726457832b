"""A zoo model traced for layer-by-layer pricing: the forward program F at one micro-batch
size, cut into layers, with what each layer reads (parameters, batch, activations).

`Workload.build(model, global_batch, num_micro_batches, overrides)` traces the train step
(the zoo model with `overrides` of its config, e.g. the suite's optimizer) once at
micro-batch size with `jax.ShapeDtypeStruct`s (no memory for weights), splits it around its
`autopar.value_and_grad` call (`autopar.pipeline.split`), and layers F the way the pipeline
planner does (`passes.layering.run(F, "auto")`, cuts aligned with repeated blocks), so a
hand-written plan and autopar's plan are priced on the same layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np

from autopar import markers, pipeline
from autopar import models as zoo
from autopar.graph import Graph
from autopar.passes import layering
from autopar.pipeline_search import diff_values
from autopar.pipeline_search.reuse import _program_key
from autopar.planner import describe_path


@dataclasses.dataclass(frozen=True, eq=False)
class Workload:
    """One model at one micro-batch count.

    Attributes:
      model / global_batch / num_micro_batches: what was traced (micro-batch size =
        global_batch // num_micro_batches); overrides: the config fields replaced
        ((field, value) pairs, `autopar.models.config`).
      split / graph / diff: the split step, F flattened, and F's values carrying gradients.
      layers: F's layers (`StageProgram`s) in order; `layer_keys[i]` identifies layer i's
        program text (equal keys = identical layers, priced once).
      names: flattened step-input name of every F input value that is a step input.
      batch_ids: F input values that are batch leaves (dim 0 = micro-batch size).
      param_ids: F input values that are differentiated (the parameters).
      state_bytes_per_param_byte: optimizer-state bytes per parameter byte (AdamW: 2).
    """

    model: str
    global_batch: int
    num_micro_batches: int
    overrides: Overrides
    split: pipeline.SplitStep
    graph: Graph
    diff: frozenset[int]
    layers: tuple[pipeline.StageProgram, ...]
    layer_keys: tuple[str, ...]
    names: dict[int, str]
    batch_ids: frozenset[int]
    param_ids: frozenset[int]
    state_bytes_per_param_byte: float

    @property
    def micro_batch(self) -> int:
        return self.global_batch // self.num_micro_batches

    @staticmethod
    def build(model: str, global_batch: int, num_micro_batches: int,
              overrides: Overrides = ()) -> Workload:
        return _build(model, global_batch, num_micro_batches, tuple(overrides))

    def value_bytes(self, vid: int) -> int:
        v = self.graph.values[vid]
        return math.prod(v.shape) * np.dtype(v.dtype).itemsize

    def layer_params(self, layer: int) -> list[int]:
        """Parameter values layer `layer` reads."""
        return [v for v in self.layers[layer].inputs if v in self.param_ids]


# A zoo config's replaced fields as hashable (field, value) pairs.
Overrides = tuple[tuple[str, object], ...]


@functools.lru_cache(maxsize=32)
def _build(model: str, global_batch: int, num_micro_batches: int,
           overrides: Overrides) -> Workload:
    if global_batch % num_micro_batches:
        raise ValueError(f"{model}: global batch {global_batch} is not divisible into "
                         f"{num_micro_batches} micro-batches")
    step, (state, batch) = zoo.train_step_and_args(model, global_batch,
                                                   overrides=dict(overrides))
    micro = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((a.shape[0] // num_micro_batches,) + a.shape[1:],
                                       a.dtype), batch)
    flat, tree = jax.tree_util.tree_flatten_with_path({"arg0": state, "arg1": micro})
    paths = [describe_path(p) for p, _ in flat]
    leaves = [x for _, x in flat]
    batch_positions = {i for i, p in enumerate(paths) if p.startswith("['arg1']")}

    def flat_step(*xs):
        args = jax.tree_util.tree_unflatten(tree, xs)
        return step(args["arg0"], args["arg1"])

    with markers.recording():
        closed = jax.make_jaxpr(flat_step)(*leaves)
    split = pipeline.split(closed, batch_positions)
    graph = split.forward_graph()
    invar_pos = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    names, batch_ids = {}, set()
    for vid, src in zip(graph.invars, split.forward_inputs):
        pos = invar_pos.get(src)
        if pos is not None:
            names[vid] = paths[pos]
            if pos in batch_positions:
                batch_ids.add(vid)
    params = frozenset(graph.invars[j] for j in split.diff_inputs)
    lay = layering.run(graph, "auto")
    ranges = lay.eqn_ranges()
    layers = tuple(pipeline.stage_programs(graph, [a for a, _ in ranges[1:]]))
    param_bytes = sum(math.prod(x.shape) * x.dtype.itemsize
                      for x in jax.tree_util.tree_leaves(state["params"]))
    opt_bytes = sum(math.prod(x.shape) * x.dtype.itemsize
                    for x in jax.tree_util.tree_leaves(state["opt_state"]))
    diff = frozenset(diff_values(split, graph))
    return Workload(model, global_batch, num_micro_batches, overrides, split, graph, diff, layers,
                    tuple(_program_key(graph, p, diff) for p in layers), names,
                    frozenset(batch_ids), params, opt_bytes / param_bytes)
