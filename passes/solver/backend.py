"""The solver-backend option, defined once: its type, its valid values, its default.

    "toulbar2"  cost-function-network solver (pytoulbar2): exact with memory as knapsack
                constraints on small and medium problems, a penalty loop with repair and
                large-neighbourhood search on large ones (toulbar2.py).
    "highs"     PuLP's ILP solved by HiGHS (highspy), with HiGHS sub-MIPs in the heuristic.
    "cbc"       PuLP's ILP solved by CBC (the reference formulation, always installed).
    "auto"      toulbar2 when pytoulbar2 imports and the problem has at least
                AUTO_TOULBAR2_MIN_NODES nodes (contest-size graphs), else highs when
                highspy is installed, else cbc.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

Backend = Literal["auto", "toulbar2", "highs", "cbc"]
BACKENDS: tuple[str, ...] = ("auto", "toulbar2", "highs", "cbc")
DEFAULT_BACKEND: Backend = "auto"

_PACKAGES = {"toulbar2": "pytoulbar2", "highs": "highspy"}

AUTO_TOULBAR2_MIN_NODES = 2000
"""Nodes from which "auto" picks toulbar2.  The compiler's per-layer problems are smaller
(tens to hundreds of nodes): HiGHS solves them to optimality in well under a second, inside
the planner's own worker processes, without toulbar2's worker start-up; the production-size
contest instances (28-35 thousand nodes) are where toulbar2's penalty loop wins
(benchmarks/results/solver_iopddl.md; the ILP path on them:
benchmarks/solver_experiments/measurements.md, "auto").  Pass
backend="toulbar2" to use it on smaller problems (the 816-node G: optimal in 2-7 s)."""


def backend_available(name: str) -> bool:
    """Whether the package a concrete backend needs is installed (cbc always is)."""
    pkg = _PACKAGES.get(name)
    return pkg is None or importlib.util.find_spec(pkg) is not None


def resolve_backend(backend: str, num_nodes: int | None = None) -> str:
    """The concrete backend ("toulbar2", "highs" or "cbc") that `backend` stands for, for a
    problem of `num_nodes` nodes (None: any size).

    Raises ValueError listing the valid names for an unknown one, and naming the missing
    package when a concrete backend is asked for but not installed.
    """
    if backend not in BACKENDS:
        raise ValueError(f"solve: backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        small = num_nodes is not None and num_nodes < AUTO_TOULBAR2_MIN_NODES
        for name in ("highs",) if small else ("toulbar2", "highs"):
            if backend_available(name):
                return name
        return "cbc"
    if not backend_available(backend):
        raise ValueError(
            f"solve: backend={backend!r} needs the {_PACKAGES[backend]} package "
            f"(pip install {_PACKAGES[backend]})"
        )
    return backend
