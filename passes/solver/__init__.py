"""Sharding-strategy solver: exact reductions, then toulbar2 (cost function networks) or an
ILP (PuLP: HiGHS or CBC) with a heuristic.

A standalone package: it imports nothing from autopar outside it (numpy, PuLP and the
solver backends only), and its worker processes run `python -m
autopar.passes.solver.worker`.  The names below load on first use (PEP 562), so a worker
imports only the modules its requests need.
"""

import importlib as _importlib
import sys as _sys
import types as _types

# Public name -> the submodule that defines it.
_EXPORTS = {
    "BACKENDS": "backend",
    "DEFAULT_BACKEND": "backend",
    "Backend": "backend",
    "evaluate": "evaluate",
    "load_iopddl": "iopddl",
    "INFINITE_COST": "problem",
    "ShardingProblem": "problem",
    "Solution": "problem",
    "InfeasibleError": "reduce",
    "solve": "solve",
}

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "Backend",
    "INFINITE_COST",
    "InfeasibleError",
    "ShardingProblem",
    "Solution",
    "evaluate",
    "load_iopddl",
    "solve",
]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(_types.ModuleType):
    """Keeps `solve` and `evaluate` the functions: the import system binds a submodule
    (solve.py, evaluate.py) to the package attribute of its name when it first loads it."""

    def __setattr__(self, name: str, value: object) -> None:
        if not (name in _EXPORTS and isinstance(value, _types.ModuleType)):
            super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
