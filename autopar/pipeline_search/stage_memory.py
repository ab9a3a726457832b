"""A stage's memory and per-step work from its layers' solutions: where each parameter and
its optimizer state live (`param_layouts`, `state_layouts`), bytes per device
(`stage_memory_bytes`), the updates once per step (`updates_s`) and the resharding between
the stage's layers (`internal_reshard_s`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from autopar import pipeline
from autopar.graph import Graph
from autopar.passes.sharding_spec import (
    MeshContext,
    Spec,
    reshard_s,
    state_split,
)

from .layer_cost import LayerCost, _memoized
from .state import StateSplit


def updates_s(priced: Sequence[LayerCost], programs: Sequence[pipeline.StageProgram],
              params: set[int], graph: Graph, split: StateSplit, num_micro_batches: int,
              per_layer: bool = False) -> float:
    """Seconds per micro-batch of the parameter updates of a stage under `split`: each
    parameter once, at the layout of its first reader (where `stage_memory_bytes` holds it
    and the runtime updates it).  With `per_layer`, as the layer ILPs price them
    (`start_price_stage(update=...)`): once per layer reading it, so a tied embedding read
    by the first and the last layer is charged twice."""
    if per_layer:
        held = [(spec, p.mesh, vid) for p, prog in zip(priced, programs)
                for vid, spec in zip(prog.inputs, p.input_specs) if vid in params]
        return sum(split.cost_s(spec, graph.values[vid].shape, graph.values[vid].nbytes,
                                mesh) for spec, mesh, vid in held) / num_micro_batches
    return _once_each(_layer_updates_s(p, prog, params, graph, split)
                      for p, prog in zip(priced, programs)) / num_micro_batches


def internal_reshard_s(priced: Sequence[LayerCost], programs: Sequence[pipeline.StageProgram],
                       graph: Graph) -> float:
    """Seconds per micro-batch of resharding between the layers of one stage: a value one
    layer makes in one layout and a later one reads in another (and its cotangent on the
    way back), and a stage input read by several layers in different layouts."""
    out_spec: dict[int, Spec] = {}
    ct_in_spec: dict[int, Spec] = {}
    first: dict[int, Spec] = {}
    total = 0.0
    for p, prog in zip(priced, programs):
        for vid, spec, ct_spec in zip(prog.inputs, p.input_specs, p.ct_out_specs):
            nbytes = graph.values[vid].nbytes
            if vid in out_spec:
                total += reshard_s(out_spec[vid], spec, nbytes, p.mesh)
                if ct_spec is not None and vid in ct_in_spec:
                    total += reshard_s(ct_spec, ct_in_spec[vid], nbytes, p.mesh)
            elif vid in first:
                total += reshard_s(first[vid], spec, nbytes, p.mesh)
            else:
                first[vid] = spec
        out_spec.update(zip(prog.outputs, p.output_specs))
        ct_in_spec.update((v, c) for v, c in zip(prog.outputs, p.ct_in_specs) if c is not None)
    return total


def param_layouts(priced: Sequence[LayerCost], programs: Sequence[pipeline.StageProgram],
                  params: set[int]) -> dict[int, tuple[Spec, MeshContext]]:
    """(spec, mesh) of every parameter a stage of these layer solutions reads: the layout
    of the first layer reading it (the stage's input spec)."""
    out: dict[int, tuple[Spec, MeshContext]] = {}
    for p, prog in zip(priced, programs):
        for vid, spec in zip(prog.inputs, p.input_specs):
            if vid in params:
                out.setdefault(vid, (spec, p.mesh))
    return out


def state_layouts(priced: Sequence[LayerCost], programs: Sequence[pipeline.StageProgram],
                  params: set[int], graph: Graph, shard: bool | StateSplit | None
                  ) -> dict[int, tuple[Spec, MeshContext]]:
    """(spec, mesh) of each parameter's reduced gradient and optimizer state on the stage:
    its spec cut over the data-parallel axes (`state_split`) where `shard` splits it (True:
    every parameter), else its spec."""
    def cut(vid: int, spec: Spec, mesh: MeshContext) -> bool:
        if isinstance(shard, StateSplit):
            v = graph.values[vid]
            return shard.splits(spec, v.shape, v.nbytes, mesh)
        return bool(shard)

    return {vid: (state_split(spec, graph.values[vid].shape, mesh)
                  if cut(vid, spec, mesh) else spec, mesh)
            for vid, (spec, mesh) in param_layouts(priced, programs, params).items()}


def held_param_bytes(priced: Sequence[LayerCost], programs: Sequence[pipeline.StageProgram],
                     params: set[int], graph: Graph,
                     shard_state: bool | StateSplit | None = False) -> float:
    """Parameter bytes per device of a stage made of these layer solutions (a parameter
    read by several layers counts once, at the layout of the first); with `shard_state`,
    at its state layout (the bytes of parameter the device updates and holds state for)."""
    return _once_each(_layer_param_bytes(p, prog, params, graph, shard_state)
                      for p, prog in zip(priced, programs))


def _once_each(layers: Iterable[list[tuple[int, float]]]) -> float:
    """The sum of the layers' (parameter, amount) terms, each parameter counted once: at
    the first layer listing it."""
    seen: set[int] = set()
    total = 0.0
    for terms in layers:
        for vid, amount in terms:
            if vid not in seen:
                seen.add(vid)
                total += amount
    return total


def _layer_param_bytes(p: LayerCost, prog: pipeline.StageProgram, params: set[int],
                       graph: Graph, shard: bool | StateSplit | None
                       ) -> list[tuple[int, float]]:
    """(parameter, bytes per device) of each parameter layer solution `p` reads in `prog`,
    in input order: at its input layout, or at its state layout where `shard` splits it (as
    `state_layouts` does).  Memoized on `p` (the same solution serves identical layers:
    the key holds their program)."""
    return _memoized(p, "param bytes", (prog, params, graph, shard), lambda: [
        (vid, graph.values[vid].nbytes / mesh.shards(spec))
        for vid, (spec, mesh) in state_layouts([p], [prog], params, graph, shard).items()])


def _layer_updates_s(p: LayerCost, prog: pipeline.StageProgram, params: set[int], graph: Graph,
                     split: StateSplit) -> list[tuple[int, float]]:
    """(parameter, seconds per step of its update under `split`) of each parameter layer
    solution `p` reads in `prog`, at its input layout, in input order; memoized on `p`."""
    return _memoized(p, "updates", (prog, params, graph, split), lambda: [
        (vid, split.cost_s(spec, graph.values[vid].shape, graph.values[vid].nbytes, mesh))
        for vid, (spec, mesh) in param_layouts([p], [prog], params).items()])


def _layer_memory_terms(p: LayerCost, prog: pipeline.StageProgram, params: set[int],
                        graph: Graph) -> tuple[float, list[tuple[int, float]],
                                               list[tuple[int, tuple[Spec, float]]]]:
    """`stage_memory_bytes`'s terms of one layer solution that need no other layer: the
    bytes per device of the parameters and gradients it reads and writes (`own`), the
    (parameter, gradient accumulator bytes) it would hold, and (input, (its spec, bytes per
    device)) of every input as this layer reads it; memoized on `p`."""
    def compute():
        own = 0.0
        grads = []
        acc = p.accumulator_bytes or (None,) * len(prog.inputs)
        for vid, spec, ct, a in zip(prog.inputs, p.input_specs, p.ct_out_specs or
                                    (None,) * len(prog.inputs), acc):
            if vid not in params:
                continue
            nbytes = graph.values[vid].nbytes
            own += nbytes / p.mesh.shards(spec)
            if ct is not None:
                g = nbytes / p.mesh.shards(ct)
                own += g
                grads.append((vid, g if a is None else a))
        inputs = [(vid, (spec, graph.values[vid].nbytes / p.mesh.shards(spec)))
                  for vid, spec in zip(prog.inputs, p.input_specs)]
        return own, grads, inputs

    return _memoized(p, "memory terms", (prog, params, graph), compute)


def stage_memory_bytes(priced: Sequence[LayerCost], programs: Sequence[pipeline.StageProgram],
                       params: set[int], graph: Graph, micro: int, in_flight: int,
                       state_bytes_per_param_byte: float,
                       shard_state: bool | StateSplit | None = False,
                       whole_step: bool = False) -> float:
    """Bytes per device of a stage made of these layer solutions at its peak, as the runtime
    holds them (`PipelineCompiled.stage_memory_bytes` measures the same terms):

    * the parameters, each once, at the layout of its first reader;
    * the gradient accumulators, one per parameter at the layout its first reader's
      backward gives it, unreduced over the data-parallel axes as the runtime keeps them
      (`LayerCost.accumulator_bytes`; gradients are added in place, as Megatron-LM's
      main_grad);
    * the optimizer state (split over the data-parallel axes with `shard_state`);
    * the residuals of every micro-batch in flight (the schedule's `in_flight`, at most
      `micro`) but the one running, whole; a layer input among them once, at the layout
      the runtime holds it in (its producer's, `LayerCost.input_residuals`), not the reading
      layer's: a layer that reads its input in another layout (replicated, say) makes that
      copy when it runs, a transient of that layer (wrn-2b on 8 H100s, one micro-batch:
      a 32 GiB all-gather of the input of its fifth layer);
    * for the micro-batch running, the largest, over the layers, of a layer's transient
      (its forward+backward's predicted peak less the parameters, gradients and residuals
      counted here) plus the residuals of that layer and the layers before it.  Layers run
      one after the other, so their temporaries never coexist (summing the layers' peaks
      counted each layer's parameters-sized temporaries and attention scores once per
      layer); and while layer k runs forward, later layers have no residuals yet, while it
      runs backward theirs are freed (a convolutional net's largest transients are in its
      first, widest layers, where few residuals are held);
    * with `whole_step` (the stage is the whole pipeline, which the runtime runs as one
      program, `StageRunner.fused_step`): the reduced gradients, at their state layout,
      which are that program's outputs and so held through the step."""
    held = held_param_bytes(priced, programs, params, graph, False)
    state = held_param_bytes(priced, programs, params, graph, shard_state)
    grads: dict[int, float] = {}
    residuals = running = 0.0
    # Where the runtime keeps a layer input it saves for the backward: as the earlier layer
    # producing it laid it out, or a stage input as its first reader does (the stage's
    # input layout); once however many layers read it.
    holder: dict[int, tuple[Spec, float]] = {}
    kept: set[int] = set()
    for p, prog in zip(priced, programs):
        own, layer_grads, inputs_held = _layer_memory_terms(p, prog, params, graph)
        for vid, entry in inputs_held:
            holder.setdefault(vid, entry)
        for vid, g in layer_grads:
            grads.setdefault(vid, g)
        residuals += p.residual_bytes
        transient = p.memory_bytes - own - p.residual_bytes
        for k, nbytes in p.input_residuals:
            vid = prog.inputs[k]
            spec, held_bytes = holder[vid]
            residuals += (held_bytes if vid not in kept else 0.0) - nbytes
            kept.add(vid)
            if p.input_specs[k] != spec:
                transient += nbytes  # the copy in this layer's layout, made when it runs
        running = max(running, residuals + transient)
        for vid, spec in zip(prog.outputs, p.output_specs):
            holder[vid] = (spec, graph.values[vid].nbytes / p.mesh.shards(spec))
    return (held + sum(grads.values()) + (state_bytes_per_param_byte + whole_step) * state
            + (min(in_flight, micro) - 1) * residuals + running)
