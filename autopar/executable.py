"""What runs a plan on this process's devices: one `Executable` protocol for both kinds —
a single mesh's `jax.jit` program (`MeshExecutable`, made by `emit.emit`) and the pipeline's
`runtime.PipelineRuntime` — so the step and its `Traced` ask the executable (its layouts,
its lowering, its compiled peak memory, whether a call is one program) instead of
branching on `plan.stages`.  `api.ParallelizedFunction._build` is the one place that
chooses the kind."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from jax.sharding import Sharding

from autopar.cost_model import hlo_audit


@runtime_checkable
class Executable(Protocol):
    """Runs a planned step on the flattened arguments (the traced step's dynamic leaves).

    Attributes:
      one_program: whether a call is one `jax.jit` program, which a caller may trace into
        its own jit (`Traced.fast_call`); False where the call drives several programs from
        Python (the pipeline's schedule).
    """

    one_program: ClassVar[bool]

    def __call__(self, *flat_args: Any) -> Sequence[Any]:
        """The step's flattened outputs."""
        ...

    def lower(self, *args_info: Any) -> Any:
        """The lowered program(s) for these argument shapes; `.compile()` compiles them."""
        ...

    def input_shardings(self) -> list[Sharding]:
        """Where the step expects each flattened argument."""
        ...

    def output_shardings(self) -> list[Sharding | None]:
        """Where the step leaves each flattened output."""
        ...

    def compiled_peak_bytes(self, compiled: Any) -> float:
        """Bytes per device at the peak of `lower(...).compile()`'s program(s): the
        largest any one device holds."""
        ...


@dataclasses.dataclass(frozen=True)
class MeshExecutable:
    """A single-mesh plan's step: `fn`, the jitted program of the flattened arguments, and
    the layouts it was jitted with."""

    fn: Any
    in_shardings: tuple[Sharding, ...]
    out_shardings: tuple[Sharding, ...]
    one_program: ClassVar[bool] = True

    def __call__(self, *flat_args: Any) -> Sequence[Any]:
        return self.fn(*flat_args)

    def lower(self, *args_info: Any) -> Any:
        return self.fn.lower(*args_info)

    def input_shardings(self) -> list[Sharding]:
        return list(self.in_shardings)

    def output_shardings(self) -> list[Sharding | None]:
        return list(self.out_shardings)

    def compiled_peak_bytes(self, compiled: Any) -> float:
        """`memory_analysis()`'s arguments + outputs - aliases + temporaries."""
        return float(hlo_audit.MemoryUsage.of(compiled).total_bytes)
