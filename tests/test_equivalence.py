"""A parallelized step returns the same numbers as the single-device jax.jit step.

Tolerances: SGD-momentum compares at rtol 2e-4 / atol 2e-5 (reduction order changes sums
by ~1e-7 relative; three steps of momentum keep that small).  AdamW runs with eps=1e-4
(see tests/models.py), which keeps adam's normalization from turning float noise in
near-zero gradients into ±lr steps; compared at rtol 1e-3 / atol 1e-4 (lr is 1e-3).
"""

from __future__ import annotations

import pytest

import autopar

from helpers import assert_same_run, cheap_comm_cluster
from models import CASE_NAMES, make_case

TOL = {"sgd": dict(rtol=2e-4, atol=2e-5), "adamw": dict(rtol=1e-3, atol=1e-4)}
MESHES = [(1, 8), (2, 4), (8, 1)]


def _parallel(case, method):
    return autopar.parallelize(case.step, method=method, cluster=cheap_comm_cluster())


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
@pytest.mark.parametrize("name", CASE_NAMES)
def test_shard_parallel_sgd(name, mesh):
    case = make_case(name, "sgd")
    step = _parallel(case, autopar.ShardParallel(mesh_shape=mesh))
    assert_same_run(case, step, **TOL["sgd"])
    plan = step.get_plan(*case.init())
    # The cheap-communication model must make the search split something.
    assert any(any(spec) for spec in plan.in_specs), plan.summary()


@pytest.mark.parametrize("name", CASE_NAMES)
def test_shard_parallel_adamw(name):
    case = make_case(name, "adamw")
    step = _parallel(case, autopar.ShardParallel(mesh_shape=(2, 4)))
    assert_same_run(case, step, **TOL["adamw"])


@pytest.mark.parametrize("method", [autopar.DataParallel(),
                                    autopar.Zero2Parallel(min_split_elements=0),
                                    autopar.Zero3Parallel(min_split_elements=0)],
                         ids=lambda m: m.name)
@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_baseline_methods(name, method, optimizer):
    case = make_case(name, optimizer)
    step = autopar.parallelize(case.step, method=method)
    assert_same_run(case, step, **TOL[optimizer])


def test_sub_mesh_of_four_devices():
    import jax

    case = make_case("gpt", "sgd")
    step = autopar.parallelize(case.step, method=autopar.ShardParallel(mesh_shape=(2, 2)),
                               devices=jax.devices()[4:], cluster=cheap_comm_cluster())
    assert_same_run(case, step, **TOL["sgd"])
    assert step.get_plan(*case.init()).device_ids == (4, 5, 6, 7)
