"""The solver-backend option, defined once: its type, its valid values, its default.

    "toulbar2"  cost-function-network solver (pytoulbar2): exact with memory as knapsack
                constraints on small and medium problems, a penalty loop with repair and
                large-neighbourhood search on large ones (toulbar2.py).
    "highs"     PuLP's ILP solved by HiGHS (highspy), with HiGHS sub-MIPs in the heuristic.
    "cbc"       PuLP's ILP solved by CBC (the reference formulation, always installed).
    "auto"      toulbar2 when pytoulbar2 imports, else highs when highspy is installed,
                else cbc.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

Backend = Literal["auto", "toulbar2", "highs", "cbc"]
BACKENDS: tuple[str, ...] = ("auto", "toulbar2", "highs", "cbc")
DEFAULT_BACKEND: Backend = "auto"

_PACKAGES = {"toulbar2": "pytoulbar2", "highs": "highspy"}


def backend_available(name: str) -> bool:
    """Whether the package a concrete backend needs is installed (cbc always is)."""
    pkg = _PACKAGES.get(name)
    return pkg is None or importlib.util.find_spec(pkg) is not None


def resolve_backend(backend: str) -> str:
    """The concrete backend ("toulbar2", "highs" or "cbc") that `backend` stands for.

    Raises ValueError listing the valid names for an unknown one, and naming the missing
    package when a concrete backend is asked for but not installed.
    """
    if backend not in BACKENDS:
        raise ValueError(f"solve: backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        for name in ("toulbar2", "highs"):
            if backend_available(name):
                return name
        return "cbc"
    if not backend_available(backend):
        raise ValueError(
            f"solve: backend={backend!r} needs the {_PACKAGES[backend]} package "
            f"(pip install {_PACKAGES[backend]})"
        )
    return backend
