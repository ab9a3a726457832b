"""Sharding-strategy solver: exact reductions, then toulbar2 (cost function networks) or an
ILP (PuLP: HiGHS or CBC) with a heuristic."""

from autopar.passes.solver.backend import BACKENDS, DEFAULT_BACKEND, Backend
from autopar.passes.solver.evaluate import evaluate
from autopar.passes.solver.iopddl import load_iopddl
from autopar.passes.solver.problem import INFINITE_COST, ShardingProblem, Solution
from autopar.passes.solver.reduce import InfeasibleError
from autopar.passes.solver.solve import solve

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
