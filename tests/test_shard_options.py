"""`ShardParallel` options a user of Alpa had (issue 44, item 6): `batch_axis`, Alpa's
``force_batch_dim_to_mesh_dim``.

Checked on a 3-layer MLP (`models.mlp_case`: batch 64, widths 40 → 96 → 96 → 8, clipped
SGD with momentum) on a (2, 4) mesh of 8 emulated CPU devices priced as 2 hosts x 4
devices (axis "x" across the hosts, slow; axis "y" inside a host, nearly free), where the
free search splits the batch over both axes:
  * option validation: ValueErrors naming the option and the bad value;
  * `batch_axis=0` (and 1): the batch inputs arrive split over that axis only, and every
    value computed from the batch splits its batch dims over that axis and no other
    (`plan.value_specs`, `planner.batch_dims`);
  * `batch_axis=0` compiled: every collective over axis "x" is an all-reduce over "x" alone
    (the gradients', with the loss's scalar; hlo_audit), and 3 steps equal `jax.jit`'s to
    rtol 1e-5 / atol 1e-6 (float32);
  * `batch_axis=None` (the default) leaves the search free: the batch split over both axes;
  * `batch_axis=0` with 2 micro-batches: the per-micro-batch values held to it too, and
    equal to the micro-batched `jax.jit` step.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

import autopar
from autopar import planner
from autopar.cost_model import Link, hlo_audit

import models
from helpers import assert_same_micro_batched_run, assert_same_run

RTOL, ATOL = 1e-5, 1e-6
BATCH = 64


def _case():
    """The 3-layer MLP; hidden width 96 and input width 40 differ from the batch size, so
    only the batch dims are held to the batch axis."""
    return models.mlp_case(batch=BATCH, hidden=96, layers=2, in_features=40)


def _two_hosts() -> autopar.ClusterSpec:
    """8 CPU devices priced as 2 hosts x 4: a (2, 4) mesh's axis 0 crosses the hosts."""
    base = autopar.ClusterSpec.from_devices(jax.devices()[:8])
    return dataclasses.replace(base, name="2x4xCPU-test", num_hosts=2, devices_per_host=4,
                               intra_host=Link(1e-7, 1e-14), inter_host=Link(1e-5, 1e-9))


def _traced(batch_axis: int | None, num_micro_batches: int = 1):
    case = _case()
    state, batch = case.init()
    par = autopar.parallelize(
        case.step, method=autopar.ShardParallel(mesh_shape=(2, 4), batch_axis=batch_axis,
                                                num_micro_batches=num_micro_batches,
                                                time_limit_s=10.0),
        cluster=_two_hosts(), donate_argnums=())
    return par, case, par.trace(state, batch)


# ---- validation -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_axis=2), r"batch_axis=2"),
    (dict(batch_axis=-1), r"batch_axis=-1"),
    (dict(batch_axis=True), r"batch_axis=True"),
    (dict(batch_axis="x"), r"batch_axis='x'"),
    (dict(batch_axis=1, mesh_shape=(8,)), r"batch_axis=1.*mesh_shape=\(8,\)"),
])
def test_batch_axis_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        autopar.ShardParallel(**kwargs)


def test_batch_axis_selects_the_meshes_tried():
    assert autopar.ShardParallel(batch_axis=1).mesh_shapes(8) == [(2, 4), (4, 2)]
    assert autopar.ShardParallel(batch_axis=0).mesh_shapes(8) == [(8,), (2, 4), (4, 2)]
    assert autopar.ShardParallel().mesh_shapes(8) == [(8,), (2, 4), (4, 2)]
    with pytest.raises(ValueError, match=r"batch_axis=1.*3 devices have no 2-D"):
        autopar.ShardParallel(batch_axis=1).mesh_shapes(3)


def test_batch_axis_enters_the_plan_cache_key():
    from autopar import plan_cache

    fields = [plan_cache.method_fields(autopar.ShardParallel(batch_axis=a))
              for a in (None, 0, 1)]
    assert len({repr(sorted(f.items())) for f in fields}) == 3


# ---- plans and compiled programs --------------------------------------------------------

def _batch_axes_used(traced) -> set[str]:
    """Mesh axes that split a batch dim (of the batch or micro-batch size) of some value
    computed from the batch."""
    specs = dict(traced.plan.value_specs)
    specs.update(zip(traced.graph.invars, traced.plan.in_specs))
    led = planner.batch_dims(traced.program, traced.plan.num_micro_batches)
    assert led, "the batch reaches no value"
    return {a for vid, dims in led.items() if vid in specs for d in dims
            for a in specs[vid][d]}


def test_default_search_splits_the_batch_over_both_axes():
    _, _, traced = _traced(None)
    assert _batch_axes_used(traced) == {"x", "y"}
    assert "batch_axis" not in traced.plan.solver


@pytest.mark.parametrize("batch_axis", [0, 1])
def test_batch_axis_keeps_every_batch_dim_on_its_axis(batch_axis):
    _, _, traced = _traced(batch_axis)
    plan = traced.plan
    axis = plan.mesh_axes[batch_axis]
    assert plan.solver["batch_axis"] == axis
    for name, spec in zip(plan.input_names, plan.in_specs):
        if name.startswith("['arg1']"):
            assert spec[0] == (axis,), (name, spec)
    assert _batch_axes_used(traced) == {axis}


def test_batch_axis_0_compiles_to_gradient_all_reduce_over_axis_0_only():
    par, case, traced = _traced(0)
    plan = traced.plan
    state, batch = case.init()
    compiled = par.lower(state, batch).compile()
    found = hlo_audit.audit(compiled, plan.mesh_shape, plan.mesh_axes, plan.device_ids)
    over_x = [c for c in found.collectives if "x" in c.axes]
    assert over_x, found.collectives
    assert all(c.kind == "all-reduce" and tuple(c.axes) == ("x",) for c in over_x), over_x
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state["params"]))
    # The gradients, each split over "y" as its parameter is (or whole), and the loss.
    assert sum(c.nbytes * c.count for c in over_x) <= param_bytes + 64
    assert_same_run(case, par, rtol=RTOL, atol=ATOL)


def test_batch_axis_with_micro_batches():
    """2 micro-batches: the per-micro-batch values (leading size 32) keep their batch dim
    on axis "x" too; 3 steps equal the micro-batched `jax.jit` step."""
    par, case, traced = _traced(0, num_micro_batches=2)
    assert len(planner.batch_dims(traced.program, 2)) > 10 * len(
        planner.batch_dims(traced.program, 1))
    assert _batch_axes_used(traced) == {"x"}
    assert_same_micro_batched_run(case, par, 2, rtol=RTOL, atol=ATOL)
