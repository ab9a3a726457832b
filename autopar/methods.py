"""Parallelization methods: typed options, validated once, behind one protocol.

Every method is a frozen dataclass that satisfies `Method` (the shape of optax's
`GradientTransformation`: a small declared interface, no base class to inherit).  The
planner reads only that interface:

* `MeshMethod` (one SPMD program on one mesh): `mesh_shapes(n)` lists the logical meshes to
  try and `forced_specs(...)` fixes input layouts.  `ShardParallel` searches a sharding for
  every value (intra-op ILP); `DataParallel`, `Zero2Parallel` and `Zero3Parallel` are the
  classic hand-written strategies expressed as forced input specs on a 1-D mesh —
  everything else goes through the same search, so the baselines and the automatic plan
  share one cost model and one code path.
* `PipelineMethod` (stages on sub-meshes): `stage_layout(n, devices_per_host)` says what
  the stage search may choose.  `PipeshardParallel` searches stages with Alpa's DP;
  `Manual3DParallel` fixes equal stages on (dp, tp) meshes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar, Literal, Protocol, runtime_checkable

from autopar.passes.sharding_spec import MeshContext, Spec, replicated
from autopar.passes.solver import BACKENDS, DEFAULT_BACKEND, Backend

Role = Literal["batch", "param", "state"]
ScheduleName = Literal["1f1b", "gpipe"]
# Rematerialization of a pipeline's layers: True every layer, False none (beyond the step's
# own `jax.checkpoint`, which makes every layer rematerialize), "auto" the stage search
# chooses per layer where a stage's memory needs it.
RematPolicy = bool | Literal["auto"]
_SCHEDULES = ("1f1b", "gpipe")


@runtime_checkable
class Method(Protocol):
    """What every parallelization method gives the planner.

    Attributes:
      name: short name recorded in the plan ("shard", "dp", "pipeshard", ...).
      pipelined: whether the plan has pipeline stages (a `PipelineMethod`) or is one SPMD
        program on one mesh (a `MeshMethod`).
      num_micro_batches: gradient-accumulation steps per step (the batch is split on dim 0);
        "auto" (PipeshardParallel only): the search tries counts and keeps the fastest.
      memory_budget_bytes: the most bytes one device may hold at the peak of the compiled
        step (None: the cluster's device memory): what the compiled program's
        ``memory_analysis()`` reports, argument + output - alias + temp, with the step's
        donation (donated inputs' buffers reused by the outputs they alias); for pipelined
        plans, per stage device.  The planner meets it with its memory model of the compiled
        program (`autopar.passes.memory`), re-solving under tighter caps until the
        estimate fits, and raises `MemoryBudgetError` (budget and smallest need) if none does.
      solver: sharding-solver backend (`autopar.passes.solver.BACKENDS`).
      time_limit_s: solver wall-clock limit per ILP, seconds.
    """

    name: ClassVar[str]
    pipelined: ClassVar[bool]

    @property
    def num_micro_batches(self) -> int | Literal["auto"]: ...

    @property
    def memory_budget_bytes(self) -> float | None: ...

    @property
    def solver(self) -> Backend: ...

    @property
    def time_limit_s(self) -> float: ...


@runtime_checkable
class MeshMethod(Method, Protocol):
    """A method that runs the whole step as one SPMD program on one mesh.

    Optional: `batch_mesh_axis(mesh) -> str | None`, the only axis of `mesh` that may
    split a batch dim of any value computed from the batch (None: any axis); the planner
    reads it where a method has it (`ShardParallel.batch_axis`).
    """

    def mesh_shapes(self, num_devices: int) -> list[tuple[int, ...]]:
        """The logical mesh shapes to try, each with `num_devices` devices."""
        ...

    def forced_specs(self, shapes: Sequence[tuple[int, ...]], roles: Sequence[Role],
                     mesh: MeshContext) -> dict[int, Spec]:
        """Input position → the only spec that input may take on `mesh`."""
        ...


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """What a pipeline method lets the stage search choose.

    Attributes:
      num_stages: the number of stages, or None (the stage DP chooses).
      layer_num: layers the forward is clustered into, or "auto".
      min_layers: at least this many layers (one per stage at least).
      submesh_shapes: (hosts, devices per host) of every stage, in order, or None (the DP
        chooses sub-meshes).
      equal_layers: stages get equal layer counts (no search over the cuts).
      logical_shape: the one logical mesh shape every stage uses, or None (searched).
      batch_axis: the batch dim of per-micro-batch inputs, and of every value computed
        from them, is split over the first logical mesh axis and no other (data
        parallelism inside each stage; the other axes split the model).
      fixed_state_split: with `shard_optimizer_state`, every stage splits its optimizer
        state (a fixed layout); otherwise each stage splits it where that is faster or
        where its memory needs it.
      remat: which layers recompute their activations in the backward instead of keeping
        them (`RematPolicy`).
    """

    num_stages: int | None
    layer_num: int | Literal["auto"] = "auto"
    min_layers: int = 1
    submesh_shapes: tuple[tuple[int, int], ...] | None = None
    equal_layers: bool = False
    logical_shape: tuple[int, ...] | None = None
    batch_axis: bool = False
    fixed_state_split: bool = False
    remat: RematPolicy = False


@runtime_checkable
class PipelineMethod(Method, Protocol):
    """A method that runs the step as pipeline stages on sub-meshes."""

    schedule: ScheduleName
    shard_optimizer_state: bool

    def stage_layout(self, num_devices: int, devices_per_host: int) -> StageLayout:
        """The stage search's freedom on `num_devices` devices (`devices_per_host` each)."""
        ...


def _check_common(name: str, memory_budget_bytes, solver, time_limit_s) -> None:
    if solver not in BACKENDS:
        raise ValueError(f"{name}(solver={solver!r}): valid solvers are {list(BACKENDS)}")
    if not time_limit_s > 0:
        raise ValueError(f"{name}(time_limit_s={time_limit_s!r}) must be positive")
    if memory_budget_bytes is not None and not memory_budget_bytes > 0:
        raise ValueError(f"{name}(memory_budget_bytes={memory_budget_bytes!r}) must be positive "
                         f"(or None for the device's memory)")


def _check_flag(name: str, field: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}({field}={value!r}) must be True or False")


def _check_count(name: str, field: str, value, allow_auto: bool = False) -> None:
    if allow_auto and value == "auto":
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        extra = ' or "auto"' if allow_auto else ""
        raise ValueError(f"{name}({field}={value!r}) must be a positive int{extra}")


def _check_remat(name: str, remat) -> None:
    if not (isinstance(remat, bool) or remat == "auto"):
        raise ValueError(f"{name}(remat={remat!r}) must be True, False or \"auto\"")


def _check_schedule(name: str, schedule: str) -> None:
    if schedule not in _SCHEDULES:
        raise ValueError(f"{name}(schedule={schedule!r}): valid schedules are "
                         f"{list(_SCHEDULES)}")


def batch_input_spec(shape: Sequence[int], mesh: MeshContext) -> Spec:
    """Dim 0 split over every split axis (or the largest subset) that divides it."""
    if not shape:
        return ()
    axes = mesh.split_axes
    for k in range(len(axes), 0, -1):
        for start in range(len(axes) - k + 1):
            chosen = axes[start:start + k]
            if shape[0] % mesh.dim_shards(chosen) == 0:
                return (tuple(chosen),) + replicated(len(shape) - 1)
    return replicated(len(shape))


@dataclasses.dataclass(frozen=True)
class ShardParallel:
    """Automatic intra-op parallelism on one mesh.

    Attributes:
      mesh_shape: logical mesh, e.g. (2, 4); None tries (n,) and every 2-D factorization
        of the device count and keeps the cheapest.  A fixed 2-D mesh is also solved as
        (n,) over the same devices in the same order (`autopar.flat_view`: a split over
        that one axis is a split over both axes of the 2-D mesh), and the cheaper plan is
        kept: the plan's ``mesh_shape`` then reads (n,) and ``plan.solver["flat_view"]``
        says so.  Not with `batch_axis` set.
      memory_budget_bytes: per-device peak of the compiled step the plan must fit, bytes
        (``memory_analysis()``: argument + output - alias + temp, with donation; see
        `Method`); None: the device memory.
      solver: sharding-solver backend, one of `autopar.passes.solver.BACKENDS`; "auto"
        picks the best installed one.
      time_limit_s: solver wall-clock limit per mesh shape, seconds.
      num_micro_batches: gradient accumulation steps (the batch is split on dim 0; each
        gradient is reduced once per step, after the last micro-batch).
      batch_axis: None (the search lays the batch out freely), or the index of the logical
        mesh axis the batch belongs to (Alpa's ``force_batch_dim_to_mesh_dim``): the batch
        inputs arrive split on dim 0 over that axis only (replicated where its size does
        not divide the batch), and no value computed from the batch may split a batch dim
        over another axis (a layout doing so is priced
        `autopar.planner.BATCH_AXIS_PENALTY_S` seconds, so the search takes none while
        another exists, and the planner rejects a plan with one; a value may still gather
        its batch dim).  The other axis is left to split the model.  A dim of a batch-derived value
        counts as a batch dim when its size is the batch size (or the micro-batch size),
        so a model dim of the same size is held to it too.  With `mesh_shape=None` only
        meshes that have the axis are tried (`batch_axis=1`: the 2-D ones).
    """

    mesh_shape: tuple[int, ...] | None = None
    memory_budget_bytes: float | None = None
    solver: Backend = DEFAULT_BACKEND
    time_limit_s: float = 60.0
    num_micro_batches: int = 1
    batch_axis: int | None = None
    name: ClassVar[str] = "shard"
    pipelined: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_common("ShardParallel", self.memory_budget_bytes, self.solver, self.time_limit_s)
        _check_count("ShardParallel", "num_micro_batches", self.num_micro_batches)
        if self.mesh_shape is not None:
            shape = tuple(self.mesh_shape)
            if not 1 <= len(shape) <= 2 or any(not isinstance(n, int) or n < 1 for n in shape):
                raise ValueError(f"ShardParallel(mesh_shape={self.mesh_shape!r}): a logical mesh "
                                 f"is 1 or 2 positive ints, e.g. (8,) or (2, 4)")
            object.__setattr__(self, "mesh_shape", shape)
        axis = self.batch_axis
        if axis is not None:
            ndim = len(self.mesh_shape) if self.mesh_shape is not None else 2
            if not isinstance(axis, int) or isinstance(axis, bool) or not 0 <= axis < ndim:
                where = (f"mesh_shape={self.mesh_shape} has axes {list(range(ndim))}"
                         if self.mesh_shape is not None else "a logical mesh has axes 0 and 1")
                raise ValueError(f"ShardParallel(batch_axis={axis!r}) must be None or a mesh "
                                 f"axis index: {where}")

    def mesh_shapes(self, num_devices: int) -> list[tuple[int, ...]]:
        if self.mesh_shape is not None:
            if math.prod(self.mesh_shape) != num_devices:
                raise ValueError(f"ShardParallel(mesh_shape={self.mesh_shape}) needs "
                                 f"{math.prod(self.mesh_shape)} devices, {num_devices} are used")
            return [self.mesh_shape]
        shapes = [(num_devices,)] + [(a, num_devices // a) for a in range(2, num_devices)
                                     if num_devices % a == 0]
        if self.batch_axis is None:
            return shapes
        shapes = [s for s in shapes if len(s) > self.batch_axis]
        if not shapes:
            raise ValueError(f"ShardParallel(batch_axis={self.batch_axis}): {num_devices} "
                             f"devices have no 2-D logical mesh (give mesh_shape, e.g. "
                             f"(1, {num_devices}), or batch_axis=0)")
        return shapes

    def forced_specs(self, shapes: Sequence[tuple[int, ...]], roles: Sequence[Role],
                     mesh: MeshContext) -> dict[int, Spec]:
        """Batch inputs arrive split on dim 0 over as many mesh axes as divide it (over
        `batch_axis` only, if set), as a data-parallel input pipeline delivers them; the
        search may re-lay them out, paying for it.  Everything else is free."""
        if self.batch_axis is None:
            return {pos: batch_input_spec(shape, mesh) for pos, (shape, role)
                    in enumerate(zip(shapes, roles)) if role == "batch"}
        axis = mesh.axes[self.batch_axis]
        out: dict[int, Spec] = {}
        for pos, (shape, role) in enumerate(zip(shapes, roles)):
            if role != "batch":
                continue
            spec = replicated(len(shape))
            if shape and axis in mesh.split_axes and shape[0] % mesh.size(axis) == 0:
                spec = ((axis,),) + spec[1:]
            out[pos] = spec
        return out

    def batch_mesh_axis(self, mesh: MeshContext) -> str | None:
        """The name of the only axis of `mesh` that may split a batch dim (`batch_axis`),
        or None (any axis may)."""
        return None if self.batch_axis is None else mesh.axes[self.batch_axis]


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Batch split over all devices; parameters and optimizer state replicated.
    `num_micro_batches`: gradient accumulation steps (the batch is split on dim 0; the
    gradients are reduced once per step)."""

    memory_budget_bytes: float | None = None
    solver: Backend = DEFAULT_BACKEND
    time_limit_s: float = 60.0
    num_micro_batches: int = 1
    name: ClassVar[str] = "dp"
    pipelined: ClassVar[bool] = False
    _sharded_roles: ClassVar[tuple[Role, ...]] = ()

    def __post_init__(self) -> None:
        _check_common(type(self).__name__, self.memory_budget_bytes, self.solver,
                      self.time_limit_s)
        _check_count(type(self).__name__, "num_micro_batches", self.num_micro_batches)

    def mesh_shapes(self, num_devices: int) -> list[tuple[int, ...]]:
        return [(num_devices,)]

    def forced_specs(self, shapes: Sequence[tuple[int, ...]], roles: Sequence[Role],
                     mesh: MeshContext) -> dict[int, Spec]:
        """Spec of every input position: batch dim 0 split; `_sharded_roles` split on
        their largest evenly divisible dim (ZeRO); the rest replicated."""
        n = mesh.num_devices
        axis = mesh.axes[0]
        out: dict[int, Spec] = {}
        for pos, (shape, role) in enumerate(zip(shapes, roles)):
            spec = replicated(len(shape))
            if role == "batch" and shape and shape[0] % n == 0:
                spec = ((axis,),) + spec[1:]
            elif role in self._sharded_roles and math.prod(shape) >= self._min_split():
                dims = [d for d in range(len(shape)) if shape[d] % n == 0]
                if dims:
                    d = max(dims, key=lambda i: (shape[i], -i))
                    spec = tuple((axis,) if i == d else () for i in range(len(shape)))
            out[pos] = spec
        return out


    def _min_split(self) -> int:
        """Elements below which a leaf of a split role stays whole (ZeRO's threshold)."""
        return 0


#: ZeRO's default threshold, elements: leaves smaller than this are not split (their
#: gather or reduce-scatter costs a collective's latency for a few bytes saved).  The
#: value of DeepSpeed's `stage3_param_persistence_threshold` default (1e5,
#: deepspeed/runtime/zero/config.py).
ZERO_MIN_SPLIT_ELEMENTS = 100_000


@dataclasses.dataclass(frozen=True)
class _ZeroParallel(DataParallel):
    """Data parallel with some leaves split over the devices.  `min_split_elements`:
    leaves with fewer elements stay replicated (biases, norms' scales: default
    `ZERO_MIN_SPLIT_ELEMENTS`; 0 splits every leaf that divides)."""

    min_split_elements: int = ZERO_MIN_SPLIT_ELEMENTS

    def __post_init__(self) -> None:
        super().__post_init__()
        v = self.min_split_elements
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{type(self).__name__}(min_split_elements={v!r}) must be an "
                             f"int >= 0")

    def _min_split(self) -> int:
        return self.min_split_elements


@dataclasses.dataclass(frozen=True)
class Zero2Parallel(_ZeroParallel):
    """Data parallel with optimizer state (and so gradient reduction) split (ZeRO-2)."""

    name: ClassVar[str] = "zero2"
    _sharded_roles: ClassVar[tuple[Role, ...]] = ("state",)


@dataclasses.dataclass(frozen=True)
class Zero3Parallel(_ZeroParallel):
    """Data parallel with parameters and optimizer state split (ZeRO-3 / FSDP)."""

    name: ClassVar[str] = "zero3"
    _sharded_roles: ClassVar[tuple[Role, ...]] = ("state", "param")


@dataclasses.dataclass(frozen=True)
class PipeshardParallel:
    """Pipeline stages on sub-meshes (inter-op DP), each sharded by the intra-op ILP.

    Attributes:
      num_micro_batches: micro-batches per step (the batch is split on dim 0), or "auto":
        the search tries divisors of the batch (`autopar.micro_batches`) and keeps the
        fastest predicted plan that fits memory; the tries are in the plan's
        `solver["micro_batch_tries"]`.
      num_stages: number of pipeline stages, or "auto" (the DP chooses).
      layer_num: layers the forward is clustered into, or "auto"; user cuts from
        `autopar.mark_pipeline_boundary()` take precedence.
      schedule: "1f1b" (bounded activation memory) or "gpipe".
      submesh_shapes: explicit (hosts, devices) sub-mesh of every stage, in order; the
        search then only chooses the layer ranges.
      memory_budget_bytes / solver / time_limit_s: as in ShardParallel, per stage.
      shard_optimizer_state: let a stage split each parameter's optimizer state, and its
        update, over the stage's unused mesh axes (ZeRO-2 inside a stage: the gradients
        are reduce-scattered instead of all-reduced and the updated parameters
        all-gathered, while each device holds and updates 1/dp of the state).  The search
        splits a stage's state where that is faster (the all-gather is priced per
        parameter layout) or where the stage would not fit its memory otherwise.  False
        keeps the state laid out like its parameter.
      remat: "auto" (default): where a stage's time-optimal layouts do not fit its memory
        with the micro-batches 1F1B keeps in flight, the search also tries rematerializing
        some of its layers (the forward keeps a layer's inputs only and the backward
        recomputes the rest, `jax.checkpoint`), those that free the most memory per second
        of recomputation first, and keeps the fastest stage that fits, whether it
        rematerializes or lays its parameters out leaner.  True rematerializes every layer,
        False none.  A step that uses `jax.checkpoint`/`nn.remat` itself rematerializes
        every layer whatever this says (the flattened step no longer shows which).  The
        plan records each layer's choice (`LayerPlan.remat`).
    """

    num_micro_batches: int | Literal["auto"] = 1
    num_stages: int | Literal["auto"] = "auto"
    layer_num: int | Literal["auto"] = "auto"
    schedule: ScheduleName = "1f1b"
    submesh_shapes: tuple[tuple[int, int], ...] | None = None
    memory_budget_bytes: float | None = None
    solver: Backend = DEFAULT_BACKEND
    time_limit_s: float = 20.0
    shard_optimizer_state: bool = True
    remat: RematPolicy = "auto"
    name: ClassVar[str] = "pipeshard"
    pipelined: ClassVar[bool] = True

    def __post_init__(self) -> None:
        n = type(self).__name__
        _check_common(n, self.memory_budget_bytes, self.solver, self.time_limit_s)
        _check_count(n, "num_micro_batches", self.num_micro_batches, allow_auto=True)
        _check_count(n, "num_stages", self.num_stages, allow_auto=True)
        _check_count(n, "layer_num", self.layer_num, allow_auto=True)
        _check_schedule(n, self.schedule)
        _check_flag(n, "shard_optimizer_state", self.shard_optimizer_state)
        _check_remat(n, self.remat)
        if self.submesh_shapes is not None:
            shapes = tuple(tuple(int(x) for x in s) for s in self.submesh_shapes)
            if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
                raise ValueError(f"{n}(submesh_shapes={self.submesh_shapes!r}): give one "
                                 f"(hosts, devices per host) pair per stage")
            object.__setattr__(self, "submesh_shapes", shapes)

    def stage_layout(self, num_devices: int, devices_per_host: int) -> StageLayout:
        fixed = None if self.num_stages == "auto" else self.num_stages
        if self.submesh_shapes is not None:
            covered = sum(h * d for h, d in self.submesh_shapes)
            if covered != num_devices:
                raise ValueError(f"PipeshardParallel(submesh_shapes={self.submesh_shapes}) "
                                 f"covers {covered} devices, {num_devices} are used")
        if fixed is not None and fixed > num_devices:
            raise ValueError(f"PipeshardParallel: {fixed} stages need at least {fixed} "
                             f"devices, {num_devices} are used")
        min_layers = (fixed if fixed is not None else
                      len(self.submesh_shapes) if self.submesh_shapes is not None else 1)
        return StageLayout(num_stages=fixed, layer_num=self.layer_num, min_layers=min_layers,
                           submesh_shapes=self.submesh_shapes, remat=self.remat)


@dataclasses.dataclass(frozen=True)
class Manual3DParallel:
    """A fixed 3-D layout (a baseline): `pp` stages with equal layer counts, each on
    `dp` x `tp` devices as a (dp, tp) logical mesh with the batch split over dp and never
    over tp (Alpa's force_batch_dim_to_mesh_dim); the sharding of the model over tp is then
    searched on that mesh.  `shard_optimizer_state` as in
    `PipeshardParallel`, except that every stage splits its state (ZeRO-2 over the
    stage's data-parallel axes), as a hand-written plan would.  `remat`: True
    rematerializes every layer (a hand-written plan's all-on), False only where the step
    itself does."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    num_micro_batches: int = 1
    schedule: ScheduleName = "1f1b"
    solver: Backend = DEFAULT_BACKEND
    time_limit_s: float = 20.0
    memory_budget_bytes: float | None = None
    shard_optimizer_state: bool = True
    remat: bool = False
    name: ClassVar[str] = "3d"
    pipelined: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for field in ("dp", "tp", "pp", "num_micro_batches"):
            _check_count("Manual3DParallel", field, getattr(self, field))
        _check_common("Manual3DParallel", self.memory_budget_bytes, self.solver,
                      self.time_limit_s)
        _check_schedule("Manual3DParallel", self.schedule)
        _check_flag("Manual3DParallel", "shard_optimizer_state", self.shard_optimizer_state)
        _check_flag("Manual3DParallel", "remat", self.remat)

    def stage_layout(self, num_devices: int, devices_per_host: int) -> StageLayout:
        if self.dp * self.tp * self.pp != num_devices:
            raise ValueError(f"Manual3DParallel(dp={self.dp}, tp={self.tp}, pp={self.pp}) "
                             f"needs {self.dp * self.tp * self.pp} devices, {num_devices} "
                             f"are used")
        per = num_devices // self.pp
        submesh = (1, per) if per <= devices_per_host else (per // devices_per_host,
                                                            devices_per_host)
        return StageLayout(num_stages=self.pp, min_layers=self.pp,
                           submesh_shapes=(submesh,) * self.pp, equal_layers=True,
                           logical_shape=(self.dp, self.tp), batch_axis=True,
                           fixed_state_split=True, remat=self.remat)
