"""The planner's pool of sharding-problem solves: `autopar.passes.solver.futures` (its
constants, e.g. ANSWER_GRACE_S, live there), under the names the planners import."""

from autopar.passes.solver import wire
from autopar.passes.solver.futures import SolvePool, answer_bound_s, default_workers

__all__ = ["SolvePool", "answer_bound_s", "default_workers", "wire"]
