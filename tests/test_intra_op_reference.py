"""Intra-op plans on the layer families of Alpa's test suite (issue 44 item 5).

Each case of `benchmarks.alpa_cases` is planned with ShardParallel on 4 of the 8 CPU devices
under a communication-only cluster (α = 0, β = 1 s/byte, free compute: Alpa's test
clusters), compiled, and read back from the HLO (`hlo_audit`); the hand-written reference
plans are compiled as `jax.jit` programs with their layouts (`benchmarks.intra_op_reference`).
Expectations of our own, per case: the collective kinds and counts of the compiled step, its
bytes against the best reference (at most 1.05x, as issue 44 asks), and the plan's predicted
communication against the compiled program's.  The full table (12 cases x 3 meshes) is
`python -m benchmarks.intra_op_reference`'s results file; equality with `jax.jit` of every
case is checked there (2 SGD steps).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks import intra_op_reference as ior

CASES = {c.name: c for c in ior.CASES}
GOAL = ior.GOAL


@pytest.fixture(scope="module")
def cluster():
    return ior.comm_only_cluster()


def _run(name: str, mesh: str, cluster) -> dict:
    return ior.run_case(CASES[name], mesh, cluster, time_limit_s=10.0)


def _non_scalar(row: dict) -> dict[str, int]:
    return row["autopar"]["counts"]


@pytest.mark.parametrize("mesh", ["4", "2x2"])
def test_data_parallel_mlp_is_one_all_reduce(mesh, cluster):
    """Alpa's test_n_layer_mlp_data_parallel: one all-reduce of the gradients and nothing
    else, as many bytes as the data-parallel reference (on (2, 2) too: the batch over both
    axes)."""
    row = _run("mlp-dp", mesh, cluster)
    assert _non_scalar(row) == {"all-reduce": 1}, row["autopar"]
    assert row["ratio"] == pytest.approx(1.0, rel=1e-6)
    assert row["autopar"]["predicted_comm_s"] == pytest.approx(row["autopar"]["comm_bytes_s"],
                                                              rel=1e-6)


def test_gradient_accumulation_reduces_once_per_step(cluster):
    """Alpa's test_gradient_accumulation on (1, 4), 2 micro-batches: one all-reduce of the
    gradients per step, the bytes of the reference step that runs the whole batch at once."""
    row = _run("grad-acc", "1x4", cluster)
    assert _non_scalar(row) == {"all-reduce": 1}, row["autopar"]
    assert row["ratio"] <= 1.01


def test_conv_batchnorm_data_parallel(cluster):
    """Alpa's test_n_layer_conv_data_parallel on (2, 2): one all-reduce of the gradients and
    two per BatchNorm layer (its batch statistics forward and backward), nothing else."""
    row = _run("conv-dp", "2x2", cluster)
    assert _non_scalar(row) == {"all-reduce": 1 + 2 * 3}, row["autopar"]
    assert row["ratio"] <= GOAL


def test_references_compile_their_layouts(cluster):
    """The Megatron reference of the model-parallel MLP is what Megatron does: 5 all-reduces
    of the [batch, hidden] activations (plus the input batch gathered), no gradient
    all-reduce; the data-parallel reference one all-reduce of every gradient."""
    built = CASES["mlp-mp"].build()
    mesh = ior.mesh_of((4,))
    megatron = ior.run_reference(built, "megatron", mesh, cluster)
    assert megatron["counts"].get("all-reduce") == 5, megatron
    act = 32 * 256 * 4
    assert megatron["bytes_by_kind"]["all-reduce"] == pytest.approx(5 * act, rel=0.01)
    dp = ior.run_reference(built, "dp", mesh, cluster)
    grads = sum(np.prod(x.shape) * 4 for x in jax.tree.leaves(built.state["params"]))
    assert dp["counts"] == {"all-reduce": 1}
    assert dp["bytes_by_kind"]["all-reduce"] == pytest.approx(grads, rel=0.01)


def test_gathers_over_several_axes_cost_one_all_gather(cluster):
    """A value split over both axes of a (2, 2) mesh, gathered whole, costs the 4-way
    all-gather XLA emits (3/4 of its bytes at β = 1), not two 2-way gathers of the split
    value (1/2: the planned 1,771,526 B against 2,641,926 B compiled on conv-mp (2, 2))."""
    from autopar.passes.sharding_spec import MeshContext, reshard_s

    mesh = MeshContext.build((2, 2), cluster)
    a, b = mesh.axes
    nbytes = 2 ** 20
    assert reshard_s(((a, b), ()), ((), ()), nbytes, mesh) == pytest.approx(0.75 * nbytes)
    assert reshard_s(((a,), (b,)), ((), ()), nbytes, mesh) == pytest.approx(0.75 * nbytes)
    assert reshard_s(((a, b), ()), ((a,), ()), nbytes, mesh) == pytest.approx(0.25 * nbytes)


def test_fixed_2d_mesh_keeps_the_flat_plan_when_cheaper(cluster):
    # Channel parallelism over all 4 devices moves a split from one dim to another with an
    # all-to-all; on the 2x2 mesh that move runs as a 4x larger all-gather.  With the (4,)
    # view of the same devices solved too, the 2x2 request gets the 1-D plan's program.
    row = _run("conv-mp", "2x2", cluster)
    assert row["autopar"]["counts"].get("all-to-all", 0) >= 1
    assert row["ratio"] <= GOAL
    assert row["autopar"]["predicted_comm_s"] <= 1.5 * row["autopar"]["comm_bytes_s"]


def test_flat_view_specs_and_when_it_applies():
    from autopar import flat_view
    from autopar.cost_model import ClusterSpec
    from autopar.passes.sharding_spec import MeshContext

    assert flat_view.flat_shape((2, 4)) == (8,)
    assert flat_view.flat_shape((1, 8)) is None and flat_view.flat_shape((8,)) is None
    mesh = MeshContext.build((2, 2), ClusterSpec.preset("cpu-local"))
    assert flat_view.lift_spec((("x",), ()), mesh) == (("x", "y"), ())
    assert flat_view.lifts_to({3: (("x",), ())}, {3: (("x", "y"), ())}, mesh)
    assert not flat_view.lifts_to({3: (("x",), ())}, {3: (("x",), ())}, mesh)
    assert not flat_view.lifts_to({3: (("x",), ())}, {4: (("x", "y"), ())}, mesh)


def test_broadcast_operands_are_pinned_bert_mlm(cluster):
    # BERT MLM, data-parallel: the [B, 1, 1, S] mask bias is broadcast onto the
    # [B, h, S, S] scores.  Unpinned, XLA added the bias in its own split layout and
    # all-gathered the sum twice per step (11.5x the data-parallel reference's bytes);
    # the emitter now pins an operand an equation broadcasts at the layout priced.
    row = _run("bert-mlm-dp", "4", cluster)
    assert row["ratio"] <= GOAL, row["autopar"]
    assert row["autopar"]["predicted_comm_s"] >= 0.9 * row["autopar"]["comm_bytes_s"]
