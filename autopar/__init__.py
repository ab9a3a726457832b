"""autopar: automatic parallelization of JAX training steps (Alpa-style, on stock JAX).

The public names load on first use (PEP 562), so importing a part that needs no JAX (the
sharding solver, `autopar.passes.solver`) does not import JAX or Orbax.  `autopar.X` also
imports the submodule `autopar.X` on first use, as an eager `import autopar` used to load
most of them.
"""

import importlib as _importlib
import pkgutil as _pkgutil
import sys as _sys
import types as _types

# Public name -> the module that defines it (relative to this package, or absolute).
_EXPORTS: dict[str, str] = {
    "ClusterSpec": "autopar.cost_model",
    "Fallback": "autopar.passes.fallbacks",
    "FallbackWarning": "autopar.passes.fallbacks",
    "MemoryBudgetError": "autopar.passes.intra_op",
    "FingerprintError": ".api",
    "ParallelizedFunction": ".api",
    "Traced": ".api",
    "parallelize": ".api",
    "place": ".api",
    "plan": ".api",
    "CheckpointMismatchError": ".checkpoint",
    "Checkpoints": ".checkpoint",
    "grad": ".markers",
    "mark_pipeline_boundary": ".markers",
    "value_and_grad": ".markers",
    "DataParallel": ".methods",
    "Manual3DParallel": ".methods",
    "MeshMethod": ".methods",
    "Method": ".methods",
    "PipelineMethod": ".methods",
    "PipeshardParallel": ".methods",
    "ShardParallel": ".methods",
    "Zero2Parallel": ".methods",
    "Zero3Parallel": ".methods",
    "Plan": ".plan",
    "PlanError": ".plan",
    "PredictedCost": ".plan",
    "StagePlan": ".plan",
}

__all__ = [
    "CheckpointMismatchError",
    "Checkpoints",
    "ClusterSpec",
    "DataParallel",
    "Fallback",
    "FallbackWarning",
    "FingerprintError",
    "Manual3DParallel",
    "MemoryBudgetError",
    "MeshMethod",
    "Method",
    "ParallelizedFunction",
    "PipelineMethod",
    "PipeshardParallel",
    "Plan",
    "PlanError",
    "PredictedCost",
    "ShardParallel",
    "StagePlan",
    "Traced",
    "Zero2Parallel",
    "Zero3Parallel",
    "grad",
    "mark_pipeline_boundary",
    "parallelize",
    "place",
    "plan",
    "distributed",
    "value_and_grad",
]


def _export(name: str) -> object:
    """The public object `name`, importing the module that defines it."""
    return getattr(_importlib.import_module(_EXPORTS[name], __name__), name)


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        value = _export(name)
    elif name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        try:
            value = _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


# Subpackages installed from folders outside autopar/ (pyproject's package-dir).
_MAPPED_SUBPACKAGES = ("cost_model", "passes")


def __dir__() -> list[str]:
    """The public names, the submodules, and whatever is loaded already."""
    submodules = {m.name for m in _pkgutil.iter_modules(__path__)} | set(_MAPPED_SUBPACKAGES)
    loaded = {k for k in globals() if not k.startswith("_") or k.startswith("__")}
    return sorted(loaded | submodules | set(__all__))


class _Package(_types.ModuleType):
    """Keeps `autopar.plan` the function `api.plan`: the import system binds the submodule
    autopar/plan.py to the package attribute `plan` when it first loads it."""

    def __setattr__(self, name: str, value: object) -> None:
        if not (name in _EXPORTS and isinstance(value, _types.ModuleType)):
            super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
