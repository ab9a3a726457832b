"""Plans: what the passes decide, as frozen dataclasses that round-trip through JSON.

A plan found by search has the same type as one a user writes or edits by hand, so a
saved plan can be inspected, edited and replayed (`parallelize(..., plan=path)`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any

from autopar.cost_model.jsonio import write_json_atomic
from autopar.passes.sharding_spec import Spec, format_spec, spec_from_json, spec_to_json

PLAN_FORMAT_VERSION = 2
# Format 1 numbered the values of a pipeline layer's forward+backward program with the
# layer's inputs in value-id order, format 2 in the order the layer first reads them
# (`pipeline.program_for_range`); plans without layer solutions read alike in both.
_READABLE_WITHOUT_LAYER_SOLUTIONS = (1,)


class PlanError(ValueError):
    """A plan file that cannot be used: malformed, invalid, or for another program."""


@dataclasses.dataclass(frozen=True)
class PredictedCost:
    """What the cost model predicts for one step.

    Attributes:
      step_s: seconds per step (compute + communication).
      compute_s: seconds of computation per device (pipelines: the busiest stage's
        micro-batches, forward + backward with its own collectives).
      comm_s: seconds of communication (collectives and resharding); pipelines: the rest
        of the step (the fill and drain bubble and the transfers between stages).
      memory_bytes: peak bytes per device.
      flops: floating-point operations of the whole step (all devices).
    """

    step_s: float
    compute_s: float
    comm_s: float
    memory_bytes: float
    flops: float = 0.0


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One layer of a pipeline stage, run under its own intra-op solution.

    The layer's program is the forward+backward of F's equations `eqn_range` (traced the
    same way by the planner and the runtime, so value ids agree); its specs are on the
    stage's mesh.

    Attributes:
      eqn_range: F's equations [start, stop) of the layer.
      value_specs: (value id, spec) of every value of the layer's forward+backward program.
      operand_specs: (equation, operand position, spec) of operands that a matmul,
        convolution, gather or scatter reads in a layout other than their own.
      num_values: values in the layer's forward+backward program (checked when the runtime
        traces it again).
      predicted_s: predicted seconds of one micro-batch's forward + backward of the layer.
      remat: the forward keeps only the layer's inputs and the backward recomputes the rest
        (`jax.checkpoint` around the layer): chosen by the search where the stage's memory
        needs it, or every layer when the step rematerializes anywhere.
    """

    eqn_range: tuple[int, int]
    value_specs: tuple[tuple[int, Spec], ...]
    operand_specs: tuple[tuple[int, int, Spec], ...]
    num_values: int
    predicted_s: float
    remat: bool = False

    def solution_json(self) -> dict[str, Any]:
        """The part identical layers share (stored once in a plan file)."""
        return {"value_specs": [[v, spec_to_json(s)] for v, s in self.value_specs],
                "operand_specs": [[e, k, spec_to_json(sp)] for e, k, sp in self.operand_specs],
                "num_values": self.num_values}

    @staticmethod
    def from_json(d: dict[str, Any], solution: dict[str, Any]) -> LayerPlan:
        return LayerPlan(
            eqn_range=tuple(int(x) for x in d["eqn_range"]),
            value_specs=tuple((int(v), spec_from_json(s)) for v, s in solution["value_specs"]),
            operand_specs=tuple((int(e), int(k), spec_from_json(sp))
                                for e, k, sp in solution["operand_specs"]),
            num_values=int(solution["num_values"]), predicted_s=float(d["predicted_s"]),
            remat=bool(d.get("remat", False)))


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One pipeline stage.

    Attributes:
      layers: first and last layer (inclusive).
      eqn_range: the forward program's equations [start, stop) the stage runs.
      device_ids: the stage's devices, in mesh order.
      mesh_shape / mesh_axes: the stage's logical mesh.
      input_specs: (forward value id, spec) of every stage input.
      predicted_s: predicted seconds of one micro-batch's forward + backward, resharding
        between its layers and receiving its inputs (and sending their cotangents back)
        included.
      memory_bytes: predicted peak bytes per device.
      layer_plans: the stage's layers, in order, each with its intra-op solution (empty in
        hand-written plans: the runtime then lets XLA lay the stage out).
      transfer_s: of `predicted_s`, seconds per micro-batch spent receiving the stage's
        activations from earlier stages and sending their cotangents back.
      state_specs: (parameter value id, spec) of the layout the stage reduces each
        parameter's gradient into, which is also the layout of its optimizer state and
        update on the owner stage: the parameter's spec cut further over the stage's
        data-parallel axes (ZeRO-2: gradients reduce-scattered, the update done on 1/dp of
        the state, the new parameters all-gathered).  A parameter not listed keeps its
        input spec.
    """

    layers: tuple[int, int]
    eqn_range: tuple[int, int]
    device_ids: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    input_specs: tuple[tuple[int, Spec], ...]
    predicted_s: float
    memory_bytes: float
    layer_plans: tuple[LayerPlan, ...] = ()
    transfer_s: float = 0.0
    state_specs: tuple[tuple[int, Spec], ...] = ()

    def to_json(self, solutions: dict[str, int] | None = None) -> dict[str, Any]:
        """JSON; with `solutions` (solution text → index, filled here), identical layer
        solutions are stored once by the plan and referenced by index."""
        out: dict[str, Any] = {
            "layers": list(self.layers), "eqn_range": list(self.eqn_range),
            "device_ids": list(self.device_ids), "mesh_shape": list(self.mesh_shape),
            "mesh_axes": list(self.mesh_axes),
            "input_specs": [[v, spec_to_json(s)] for v, s in self.input_specs],
            "predicted_s": self.predicted_s, "memory_bytes": self.memory_bytes,
            "transfer_s": self.transfer_s}
        if self.state_specs:
            out["state_specs"] = [[v, spec_to_json(s)] for v, s in self.state_specs]
        if solutions is not None:
            layers = []
            for lp in self.layer_plans:
                key = json.dumps(lp.solution_json(), sort_keys=True)
                index = solutions.setdefault(key, len(solutions))
                layers.append({"eqn_range": list(lp.eqn_range), "predicted_s": lp.predicted_s,
                               "solution": index, **({"remat": True} if lp.remat else {})})
            out["layer_plans"] = layers
        return out

    @staticmethod
    def from_json(d: dict[str, Any], solutions: Sequence[dict[str, Any]] = ()) -> StagePlan:
        layer_plans = []
        for lp in d.get("layer_plans", []):
            k = int(lp["solution"])
            if not 0 <= k < len(solutions):
                raise PlanError(f"stage layer_plans: solution {k} does not exist "
                                f"({len(solutions)} layer solutions in the file)")
            layer_plans.append(LayerPlan.from_json(lp, solutions[k]))
        return StagePlan(
            layers=tuple(int(x) for x in d["layers"]),
            eqn_range=tuple(int(x) for x in d["eqn_range"]),
            device_ids=tuple(int(x) for x in d["device_ids"]),
            mesh_shape=tuple(int(x) for x in d["mesh_shape"]),
            mesh_axes=tuple(str(a) for a in d["mesh_axes"]),
            input_specs=tuple((int(v), spec_from_json(s)) for v, s in d["input_specs"]),
            predicted_s=float(d["predicted_s"]), memory_bytes=float(d["memory_bytes"]),
            layer_plans=tuple(layer_plans), transfer_s=float(d.get("transfer_s", 0.0)),
            state_specs=tuple((int(v), spec_from_json(s))
                              for v, s in d.get("state_specs", [])))


@dataclasses.dataclass(frozen=True)
class Plan:
    """A parallel plan for one traced program on one cluster.

    Attributes:
      fingerprint: hash of (traced program, input avals, cluster); a plan only runs the
        program it was made for.
      method: the method that produced it ("shard", "dp", "zero2", "zero3", ...).
      cluster: name of the cluster spec.
      mesh_shape / mesh_axes: the logical mesh, e.g. (2, 4) and ("x", "y").
      device_ids: ids of the devices, in mesh order (row-major).
      input_names: pytree path of every flattened input.
      in_specs / out_specs: spec of every flattened input and output.
      value_specs: (value id, spec) of every constrained intermediate value.
      predicted: the cost model's prediction.
      solver: solver and pass statistics (sizes, seconds, status).
      candidates: predicted step seconds of every logical mesh shape tried.
      stages: pipeline stages (empty for single-mesh plans).
      num_micro_batches: micro-batches per step.
      schedule: pipeline schedule ("1f1b", "gpipe"), or "" for single-mesh plans.
      operand_specs: (equation, operand position, spec) of operands that a matmul,
        convolution, gather or scatter reads in a layout other than their own.
      format_version: JSON format version.
    """

    fingerprint: str
    method: str
    cluster: str
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    device_ids: tuple[int, ...]
    input_names: tuple[str, ...]
    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    value_specs: tuple[tuple[int, Spec], ...]
    predicted: PredictedCost
    solver: dict = dataclasses.field(default_factory=dict)
    candidates: tuple[tuple[tuple[int, ...], float], ...] = ()
    stages: tuple[StagePlan, ...] = ()
    num_micro_batches: int = 1
    schedule: str = ""
    operand_specs: tuple[tuple[int, int, Spec], ...] = ()
    format_version: int = PLAN_FORMAT_VERSION

    # ---- JSON -----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        solutions: dict[str, int] = {}
        stages = [st.to_json(solutions) for st in self.stages]
        return {
            "format_version": self.format_version,
            "fingerprint": self.fingerprint,
            "method": self.method,
            "cluster": self.cluster,
            "mesh_shape": list(self.mesh_shape),
            "mesh_axes": list(self.mesh_axes),
            "device_ids": list(self.device_ids),
            "input_names": list(self.input_names),
            "in_specs": [spec_to_json(s) for s in self.in_specs],
            "out_specs": [spec_to_json(s) for s in self.out_specs],
            "value_specs": [[vid, spec_to_json(s)] for vid, s in self.value_specs],
            "predicted": dataclasses.asdict(self.predicted),
            "solver": _jsonable(self.solver),
            "candidates": [[list(shape), cost] for shape, cost in self.candidates],
            "stages": stages,
            "layer_solutions": [json.loads(k) for k in solutions],
            "num_micro_batches": self.num_micro_batches,
            "schedule": self.schedule,
            "operand_specs": [[e, k, spec_to_json(sp)] for e, k, sp in self.operand_specs],
        }

    @staticmethod
    def from_json(data: dict[str, Any], source: str = "<plan>") -> Plan:
        try:
            version = data["format_version"]
            if version != PLAN_FORMAT_VERSION and not (
                    version in _READABLE_WITHOUT_LAYER_SOLUTIONS
                    and not data.get("layer_solutions")):
                raise PlanError(
                    f"{source}: plan format_version {version} is not supported (this autopar "
                    f"reads {PLAN_FORMAT_VERSION}, and "
                    f"{', '.join(map(str, _READABLE_WITHOUT_LAYER_SOLUTIONS))} for plans "
                    f"without pipeline layer solutions); plan the step again")
            return Plan(
                fingerprint=str(data["fingerprint"]),
                method=str(data["method"]),
                cluster=str(data["cluster"]),
                mesh_shape=tuple(int(n) for n in data["mesh_shape"]),
                mesh_axes=tuple(str(a) for a in data["mesh_axes"]),
                device_ids=tuple(int(d) for d in data["device_ids"]),
                input_names=tuple(str(n) for n in data["input_names"]),
                in_specs=tuple(spec_from_json(s) for s in data["in_specs"]),
                out_specs=tuple(spec_from_json(s) for s in data["out_specs"]),
                value_specs=tuple((int(v), spec_from_json(s)) for v, s in data["value_specs"]),
                predicted=PredictedCost(**data["predicted"]),
                solver=dict(data.get("solver", {})),
                candidates=tuple((tuple(int(n) for n in shape), float(cost))
                                 for shape, cost in data.get("candidates", [])),
                stages=tuple(StagePlan.from_json(st, data.get("layer_solutions", []))
                             for st in data.get("stages", [])),
                num_micro_batches=int(data.get("num_micro_batches", 1)),
                schedule=str(data.get("schedule", "")),
                operand_specs=tuple((int(e), int(k), spec_from_json(sp))
                                    for e, k, sp in data.get("operand_specs", [])),
            )
        except PlanError:
            raise
        except KeyError as err:
            raise PlanError(f"{source}: plan is missing field {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise PlanError(f"{source}: malformed plan: {err}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the plan as JSON, atomically (no partial file on failure)."""
        write_json_atomic(path, self.to_json(), indent=1)

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Plan:
        path = os.fspath(path)
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as err:
            raise PlanError(f"{path}: not a JSON plan file: {err}") from None
        if not isinstance(data, dict):
            raise PlanError(f"{path}: a plan file holds a JSON object, got {type(data).__name__}")
        return Plan.from_json(data, source=path)

    # ---- reading --------------------------------------------------------------------------

    def summary(self) -> str:
        """The table `autopar plan` and `autopar show` print: stages or the mesh, predicted
        time, TFLOP/s and memory per device, search time, and the split inputs."""
        from autopar import report

        return report.summary(self)

    def schedule_chart(self, path: str | os.PathLike[str]) -> None:
        """Draws the pipeline schedule (stages x time, forward/backward per micro-batch)
        as a PNG, with the predicted stage durations (backward = 2 x forward)."""
        from autopar import schedules

        if not self.stages:
            raise PlanError("schedule_chart needs a pipeline plan (PipeshardParallel or "
                            "Manual3DParallel); this plan has no stages")
        sched = schedules.make(self.schedule or "1f1b", len(self.stages),
                               self.num_micro_batches)
        fwd = [st.predicted_s / 3 for st in self.stages]
        bwd = [st.predicted_s * 2 / 3 for st in self.stages]
        schedules.schedule_chart(sched, path, fwd_s=fwd, bwd_s=bwd,
                                 title=f"{self.method}: {len(self.stages)} stages, "
                                       f"{self.num_micro_batches} micro-batches (seconds)")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, bool | int | str) or obj is None:
        return obj
    if isinstance(obj, float):
        return obj
    try:
        return float(obj)
    except (TypeError, ValueError):
        return str(obj)


def verify_plan(plan: Plan, in_shapes: Sequence[tuple[int, ...]],
                out_shapes: Sequence[tuple[int, ...]], value_shapes: dict[int, tuple[int, ...]],
                num_devices: int,
                stage_value_shapes: dict[int, tuple[int, ...]] | None = None) -> None:
    """Checks a (possibly hand-edited) plan against the program; errors name the field.

    Pipeline stages are checked too: each stage's mesh against its devices, no device in
    two stages, and every stage input spec against the stage mesh's axes and (given
    `stage_value_shapes`, the forward program's value id → shape) the value's shape.
    """

    _verify_stages(plan, num_devices, stage_value_shapes)

    if math.prod(plan.mesh_shape) != len(plan.device_ids):
        raise PlanError(f"plan mesh_shape {plan.mesh_shape} needs {math.prod(plan.mesh_shape)} "
                        f"devices but device_ids lists {len(plan.device_ids)}")
    if len(set(plan.device_ids)) != len(plan.device_ids):
        raise PlanError(f"plan device_ids {list(plan.device_ids)} has duplicates")
    if max(plan.device_ids, default=0) >= num_devices:
        raise PlanError(f"plan device_ids {list(plan.device_ids)} name a device this process "
                        f"does not have ({num_devices} devices)")
    if len(plan.mesh_axes) != len(plan.mesh_shape):
        raise PlanError(f"plan mesh_axes {plan.mesh_axes} do not match mesh_shape "
                        f"{plan.mesh_shape}")
    sizes = dict(zip(plan.mesh_axes, plan.mesh_shape))

    def check(field: str, spec: Spec, shape: tuple[int, ...]) -> None:
        _check_spec(f"plan {field}", spec, shape, sizes)

    if len(plan.in_specs) != len(in_shapes):
        raise PlanError(f"plan in_specs has {len(plan.in_specs)} entries, the program has "
                        f"{len(in_shapes)} inputs")
    if len(plan.out_specs) != len(out_shapes):
        raise PlanError(f"plan out_specs has {len(plan.out_specs)} entries, the program has "
                        f"{len(out_shapes)} outputs")
    for i, (spec, shape) in enumerate(zip(plan.in_specs, in_shapes)):
        check(f"in_specs[{i}] ({plan.input_names[i] if i < len(plan.input_names) else i})",
              spec, shape)
    for i, (spec, shape) in enumerate(zip(plan.out_specs, out_shapes)):
        check(f"out_specs[{i}]", spec, shape)
    for e, k, spec in plan.operand_specs:
        _check_spec(f"plan operand_specs[equation {e}, operand {k}]", spec, None, sizes)
    for vid, spec in plan.value_specs:
        if vid not in value_shapes:
            raise PlanError(f"plan value_specs: value {vid} does not exist in this program")
        check(f"value_specs[{vid}]", spec, value_shapes[vid])


def _verify_stages(plan: Plan, num_devices: int,
                   value_shapes: dict[int, tuple[int, ...]] | None) -> None:


    owner: dict[int, int] = {}
    for k, st in enumerate(plan.stages):
        where = f"plan stages[{k}]"
        if math.prod(st.mesh_shape) != len(st.device_ids):
            raise PlanError(f"{where}.mesh_shape {st.mesh_shape} needs "
                            f"{math.prod(st.mesh_shape)} devices but its device_ids lists "
                            f"{len(st.device_ids)}")
        if len(st.mesh_axes) != len(st.mesh_shape) or len(set(st.mesh_axes)) != len(
                st.mesh_axes):
            raise PlanError(f"{where}.mesh_axes {st.mesh_axes} do not name the dims of "
                            f"mesh_shape {st.mesh_shape} (one distinct name per dim)")
        for d in st.device_ids:
            if d in owner:
                raise PlanError(f"{where}.device_ids: device {d} is also in stage "
                                f"{owner[d]} (stages must use disjoint devices)")
            if not 0 <= d < num_devices:
                raise PlanError(f"{where}.device_ids: device {d} does not exist "
                                f"({num_devices} devices)")
            owner[d] = k
        if len(st.layers) != 2 or st.layers[0] > st.layers[1]:
            raise PlanError(f"{where}.layers {st.layers} is not a (first, last) range")
        if len(st.eqn_range) != 2 or st.eqn_range[0] > st.eqn_range[1]:
            raise PlanError(f"{where}.eqn_range {st.eqn_range} is not a [start, stop) range")
        if k and st.eqn_range[0] != plan.stages[k - 1].eqn_range[1]:
            raise PlanError(f"{where}.eqn_range {st.eqn_range} does not start where stage "
                            f"{k - 1} stops ({plan.stages[k - 1].eqn_range[1]})")
        sizes = dict(zip(st.mesh_axes, st.mesh_shape))
        if st.layer_plans:
            bounds = [lp.eqn_range for lp in st.layer_plans]
            if (bounds[0][0], bounds[-1][1]) != tuple(st.eqn_range) or any(
                    a[1] != b[0] or a[0] >= a[1] for a, b in zip(bounds, bounds[1:])):
                raise PlanError(f"{where}.layer_plans: layer ranges {bounds} do not cut the "
                                f"stage's eqn_range {st.eqn_range} into contiguous layers")
            for j, lp in enumerate(st.layer_plans):
                for vid, spec in lp.value_specs:
                    _check_spec(f"{where}.layer_plans[{j}].value_specs[v{vid}]", spec, None,
                                sizes)
                for e, k, spec in lp.operand_specs:
                    _check_spec(f"{where}.layer_plans[{j}].operand_specs[equation {e}, "
                                f"operand {k}]", spec, None, sizes)
        inputs = {vid for vid, _ in st.input_specs}
        for vid, _ in st.state_specs:
            if vid not in inputs:
                raise PlanError(f"{where}.state_specs[v{vid}]: value {vid} is not an input of "
                                f"the stage (a parameter's state layout needs its input spec)")
        for name, specs in (("input_specs", st.input_specs), ("state_specs", st.state_specs)):
            for vid, spec in specs:
                _check_value_spec(f"{where}.{name}[v{vid}]", vid, spec, value_shapes, sizes)


def _check_value_spec(field: str, vid: int, spec: Spec,
                      value_shapes: dict[int, tuple[int, ...]] | None,
                      sizes: dict[str, int]) -> None:
    """A stage spec of forward value `vid` (its shape known when `value_shapes` is)."""
    if value_shapes is None:
        _check_spec(field, spec, None, sizes)
        return
    if vid not in value_shapes:
        raise PlanError(f"{field}: value {vid} does not exist in this program")
    _check_spec(field, spec, value_shapes[vid], sizes)


def _check_spec(field: str, spec: Spec, shape: tuple[int, ...] | None,
                sizes: dict[str, int]) -> None:
    """A spec must name known axes, each once, and (given the shape) split evenly."""
    used = [a for axes in spec for a in axes]
    for a in used:
        if a not in sizes:
            raise PlanError(f"{field}: unknown mesh axis {a!r} (axes: {list(sizes)})")
    if len(used) != len(set(used)):
        raise PlanError(f"{field}: spec {format_spec(spec)} uses an axis twice")
    if shape is None:
        return
    if len(spec) != len(shape):
        raise PlanError(f"{field}: spec {format_spec(spec)} has {len(spec)} dims, "
                        f"the value has shape {shape}")
    for d, (n, axes) in enumerate(zip(shape, spec)):
        k = math.prod(sizes[a] for a in axes)
        if n % k:
            raise PlanError(f"{field}: dim {d} of size {n} cannot be split {k} ways "
                            f"by {format_spec(spec)}")
