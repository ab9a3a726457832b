"""autopar: automatic parallelization of JAX training steps (Alpa-style, on stock JAX)."""

from autopar.cost_model import ClusterSpec
from autopar.passes.fallbacks import Fallback, FallbackWarning
from autopar.passes.intra_op import MemoryBudgetError

from . import distributed
from .api import FingerprintError, ParallelizedFunction, Traced, parallelize, place, plan
from .checkpoint import CheckpointMismatchError, Checkpoints
from .markers import grad, mark_pipeline_boundary, value_and_grad
from .methods import (
    DataParallel,
    Manual3DParallel,
    MeshMethod,
    Method,
    PipelineMethod,
    PipeshardParallel,
    ShardParallel,
    Zero2Parallel,
    Zero3Parallel,
)
from .plan import Plan, PlanError, PredictedCost, StagePlan

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
