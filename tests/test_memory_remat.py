"""Reshards that XLA's partitioner would do by replicating the whole tensor ("involuntary
full rematerialization") are recognised, routed through the gathered layout by the emitter,
and counted from the compile's log (issue 14)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding

import autopar
from autopar.constraints import to_pspec
from autopar.cost_model import compile_log
from autopar.passes.sharding_spec import full_rematerialization, gather_first

from models import gpt_case, mlp_case, moe_case

# XLA's warning as the CPU compiler printed it for one plan (one line in the log).
WARNING = (
    "W0000 00:00:1763876543.123456   12345 spmd_partitioner.cc:630] [SPMD] Involuntary full "
    "rematerialization. The compiler cannot go from sharding {devices=[8,1]<=[8]} to "
    "{devices=[1,2,4]<=[8] last_tile_dim_replicate} efficiently for HLO operation "
    "%param.3 = f32[32,1024]{1,0} parameter(31), sharding={devices=[8,1]<=[8]}, "
    "metadata={op_name=\"x\"}. As the last resort, SPMD partitioner will fallback to "
    "replicate the whole tensor.\n")


def test_compile_log_parses_the_partitioner_warning():
    log = compile_log.parse("unrelated line\n" + WARNING + WARNING.replace("param.3", "dot.7"))
    assert log.involuntary_rematerializations == 2
    first = log.rematerializations[0]
    assert (first.operation, first.shape) == ("param.3", "f32[32,1024]")
    assert first.source == "{devices=[8,1]<=[8]}"
    assert first.target == "{devices=[1,2,4]<=[8] last_tile_dim_replicate}"
    assert compile_log.parse("nothing here").involuntary_rematerializations == 0


@pytest.mark.parametrize("src, dst, full, via", [
    # one axis moving dims: an all-to-all, no replication
    ((("x",), ()), ((), ("x",)), False, None),
    # the case: dim 0 on both axes → dim 1 on y only: gather x, move y
    ((("x", "y"), ()), ((), ("y",)), True, ((), ())),
    # x stays on dim 0, y moves from dim 0 to dim 1: keep x, gather y, then slice
    ((("x", "y"), ()), (("x",), ("y",)), True, (("x",), ())),
    # pure gather / pure slice with two axes: collectives only
    ((("x",), ("y",)), (("x",), ()), False, None),
    ((("x",), ()), (("x",), ("y",)), False, None),
    # one axis gathered while another is newly split
    ((("x",), ()), ((), ("y",)), True, ((), ())),
])
def test_full_rematerialization_and_gather_first(src, dst, full, via):
    assert full_rematerialization(src, dst) is full
    if full:
        assert gather_first(src, dst) == via


@pytest.mark.parametrize("make", [
    lambda: mlp_case(batch=32, hidden=64, layers=2, optimizer="adamw"),
    lambda: gpt_case(batch=8, seq=16, hidden=32, heads=4, vocab=64),
    lambda: moe_case(),
], ids=["mlp", "gpt", "moe"])
def test_test_models_compile_without_involuntary_rematerialization(make):
    case = make()
    state, batch = case.init()
    step = autopar.parallelize(case.step, method=autopar.ShardParallel(
        mesh_shape=(2, 4), time_limit_s=5.0))
    traced = step.trace(state, batch)
    _, log = compile_log.compile_logged(traced.lower())
    assert log.involuntary_rematerializations == 0, (
        [(r.operation, r.source, r.target) for r in log.rematerializations],
        traced.plan.summary())


def test_compile_log_counts_a_real_rematerialization_and_gather_first_avoids_it():
    """The issue's reshard, split on dim 0 over both axes → dim 1 over y: XLA replicates
    (counted once); through `gather_first`'s layout it does not."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"),
                axis_types=(AxisType.Auto,) * 2)
    src, dst = (("x", "y"), ()), ((), ("y",))
    x = jax.ShapeDtypeStruct((32, 1024), jnp.float32,
                             sharding=NamedSharding(mesh, to_pspec(src)))

    def step(via):
        def f(a):
            if via:
                a = jax.lax.with_sharding_constraint(
                    a, NamedSharding(mesh, to_pspec(gather_first(src, dst))))
            return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, to_pspec(dst))) + 1
        return jax.jit(f).lower(x)

    direct, log = compile_log.compile_logged(step(False))
    assert log.involuntary_rematerializations == 1, log.text
    assert log.rematerializations[0].shape == "f32[4,1024]"
    routed, log = compile_log.compile_logged(step(True))
    assert log.involuntary_rematerializations == 0, log.text
    a = jnp.arange(32 * 1024, dtype=jnp.float32).reshape(32, 1024)
    a = jax.device_put(a, NamedSharding(mesh, to_pspec(src)))
    np.testing.assert_array_equal(np.asarray(direct(a)), np.asarray(routed(a)))
