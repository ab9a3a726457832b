"""Tests for autopar.cost_model.profiler: live measurement on 8 CPU devices, α-β fits, JSON."""

import json

import jax
import numpy as np
import pytest

from autopar.cost_model import (
    ClusterSpec,
    Link,
    collectives,
    compute,
    conv_sweep,
    matmul_sweep,
    profiler,
)
from autopar.cost_model.profiler import ProfileResult, factor, fit_alpha_beta

AXES = [((8,), 0), ((2, 4), 0), ((2, 4), 1)]


@pytest.fixture(scope="module")
def quick():
    calls = []
    result = profiler.profile(quick=True, progress=lambda *a: calls.append(a))
    return result, calls


def test_quick_profile_measures_every_collective_axis_and_size(quick):
    result, _ = quick
    seen = {(s["collective"], tuple(s["mesh_shape"]), s["axis"]) for s in result.samples}
    assert seen == {(k, shape, axis) for k in profiler.COLLECTIVES for shape, axis in AXES}
    assert len(result.samples) == len(seen) * len(profiler.QUICK_SIZES)
    for s in result.samples:
        assert s["seconds"] > 0
        assert s["group_size"] == s["mesh_shape"][s["axis"]]
        assert not s["crosses_hosts"]
    assert {(c["op"], c["dtype"]) for c in result.compute_samples} == {
        (op, dt) for op in ("matmul", "elementwise") for dt in ("float32", "bfloat16")}


def test_progress_counts_up_to_total(quick):
    _, calls = quick
    dones = [c[0] for c in calls]
    total = calls[0][1]
    assert dones[0] == 0 and dones[-1] == total
    assert dones == sorted(dones) and len(dones) > len(AXES) * len(profiler.COLLECTIVES)
    assert all(c[1] == total for c in calls)
    assert calls[-1][2] == "done"


def test_fits_reproduce_their_own_samples_within_20_percent(quick):
    # Recomputed here from alpha/beta, not taken from the fit's own error report. The fit is
    # least squares on relative error over the median timings, so every size counts and
    # none is dropped; the criterion is the median relative error.
    result, _ = quick
    fits = {(f["collective"], tuple(f["mesh_shape"]), f["axis"]): f for f in result.fits}
    assert len(fits) == len(profiler.COLLECTIVES) * len(AXES)
    errors = []
    for key, fit in fits.items():
        rows = [s for s in result.samples
                if (s["collective"], tuple(s["mesh_shape"]), s["axis"]) == key]
        x = np.array([factor(s["collective"], s["group_size"]) * s["nbytes"] for s in rows])
        predicted = fit["alpha_s"] + x * fit["beta_s_per_byte"]
        measured = np.array([s["seconds"] for s in rows])
        rel = np.abs(predicted - measured) / measured
        assert fit["alpha_s"] >= 0 and fit["beta_s_per_byte"] >= 0
        assert fit["median_rel_error"] == pytest.approx(np.median(rel))
        # Each fit is the non-negative least-squares optimum of its own samples: no nearby
        # (alpha, beta) >= 0 prices them better. Four live timings per fit on a shared 2-core
        # machine can sit 40% off any line, so how close one fit comes is the machine's noise;
        # the bound below is on all fits together.
        best = _relative_sse(fit["alpha_s"], fit["beta_s_per_byte"], x, measured)
        for da, db in ((1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (-1, -1), (1, -1), (-1, 1)):
            alpha = max(fit["alpha_s"] * (1 + 0.01 * da) + 1e-9 * max(da, 0), 0.0)
            beta = max(fit["beta_s_per_byte"] * (1 + 0.01 * db) + 1e-15 * max(db, 0), 0.0)
            assert best <= _relative_sse(alpha, beta, x, measured) * (1 + 1e-9), (key, da, db)
        errors.extend(rel)
    assert np.median(errors) <= 0.2


def _relative_sse(alpha: float, beta: float, x: np.ndarray, t: np.ndarray) -> float:
    return float(np.sum(((alpha + x * beta - t) / t) ** 2))


def test_cluster_uses_fitted_link_and_measured_compute(quick):
    result, _ = quick
    link = result.links["intra_host"]
    assert result.cluster.intra_host == Link(link["alpha_s"], link["beta_s_per_byte"])
    assert "inter_host" not in result.links  # one host: inter_host kept from from_devices
    assert result.cluster.inter_host == ClusterSpec.from_devices(jax.devices()).inter_host
    best = max(c["flops_per_s"] for c in result.compute_samples
               if c["op"] == "matmul" and c["dtype"] == "float32")
    assert result.cluster.peak_flops_per_s("float32") == best
    assert result.cluster.peak_flops_per_s("bfloat16") > 0
    assert result.cluster.memory_bandwidth_bytes_per_s == max(
        c["bytes_per_s"] for c in result.compute_samples if c["op"] == "elementwise")
    # The fitted link prices a sample the way cost_model.collectives does.
    s = next(s for s in result.samples if s["collective"] == "all-reduce")
    assert collectives.all_reduce_s(s["nbytes"], s["group_size"], result.cluster.intra_host) \
        == pytest.approx(link["alpha_s"] + factor("all-reduce", s["group_size"]) * s["nbytes"]
                         * link["beta_s_per_byte"])


def test_json_round_trip_loads_as_cluster_spec(quick, tmp_path):
    result, _ = quick
    path = tmp_path / "cluster.json"
    result.save(path)
    data = json.loads(path.read_text())
    assert {"cluster", "samples", "fits", "links", "compute_samples", "meta"} <= set(data)
    assert ClusterSpec.load(path) == result.cluster
    again = ProfileResult.load(path)
    assert again.cluster == result.cluster
    assert list(again.samples) == [dict(s) for s in result.samples]
    assert list(again.fits) == [dict(f) for f in result.fits]
    # A plain ClusterSpec file still loads.
    result.cluster.save(tmp_path / "plain.json")
    assert ClusterSpec.load(tmp_path / "plain.json") == result.cluster


def test_fit_recovers_alpha_beta_exactly():
    x = np.array([1e3, 1e4, 1e5, 1e6, 1e7])
    t = 2e-5 + x * 3e-10
    alpha, beta = fit_alpha_beta(x, t)
    assert alpha == pytest.approx(2e-5, rel=1e-6)
    assert beta == pytest.approx(3e-10, rel=1e-6)


def test_fit_clamps_to_non_negative():
    x = np.array([1e3, 1e4, 1e5])
    alpha, beta = fit_alpha_beta(x, np.array([3e-4, 2e-4, 1e-4]))  # time falls with size
    assert beta == 0.0 and alpha > 0
    t = x * 1e-9 - 5e-7  # negative intercept: refit β alone, still on relative error
    alpha, beta = fit_alpha_beta(x, t)
    assert alpha == 0.0
    grid = np.linspace(0.5e-9, 1.5e-9, 20001)
    best = grid[np.argmin([np.sum(((x * b - t) / t) ** 2) for b in grid])]
    assert beta == pytest.approx(best, rel=1e-4)


def test_factors_match_cost_model_collectives():
    link = Link(0.0, 1.0)
    for kind, fn in [("all-reduce", collectives.all_reduce_s),
                     ("all-gather", collectives.all_gather_s),
                     ("reduce-scatter", collectives.reduce_scatter_s),
                     ("all-to-all", collectives.all_to_all_s),
                     ("collective-permute", collectives.send_recv_s)]:
        for n in (2, 4, 8):
            assert factor(kind, n) == pytest.approx(fn(1.0, n, link))


def test_bad_arguments_name_valid_values():
    with pytest.raises(ValueError, match="all-reduce"):
        profiler.profile(collectives=["broadcast"], quick=True)
    with pytest.raises(ValueError, match="mesh shape"):
        profiler.profile(mesh_shapes=[(3,)], quick=True)


# --- matmul efficiency sweep --------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep():
    return profiler.profile(collectives=(), mesh_shapes=[], dtypes=("float32",),
                            matmul_shapes=matmul_sweep.QUICK_SHAPES, quick=True)


def test_sweep_samples_are_per_matmul_and_become_the_clusters_curve(sweep, tmp_path):
    chains = [c for c in sweep.compute_samples if c["op"] == "matmul-chain"]
    assert [tuple(c["shape"]) for c in chains] == list(matmul_sweep.QUICK_SHAPES)
    for c in chains:
        m, k, n = c["shape"]
        assert c["flops"] == 2.0 * m * k * n
        short, long = c["call_seconds"]
        assert c["seconds"] == pytest.approx(
            max((long - short) / (2 * (matmul_sweep.TRIPS[1] - matmul_sweep.TRIPS[0])), 1e-9))
    best = max(c["flops_per_s"] for c in sweep.compute_samples
               if c["op"] in ("matmul", "matmul-chain"))
    assert sweep.cluster.peak_flops_per_s("float32") == best
    curve = sweep.cluster.matmul_efficiency["float32"]
    assert [f for f, _ in curve] == sorted(c["flops"] for c in chains)
    for c in chains:
        frac = dict(curve)[c["flops"]]
        assert frac == pytest.approx(min(1.0, c["flops_per_s"] / best))
        # The planner prices a call of this size at the measured rate.
        assert compute.compute_time_s(c["flops"], 0, "float32", sweep.cluster) == \
            pytest.approx(c["seconds"], rel=1e-6)
    sweep.save(tmp_path / "c.json")
    assert ClusterSpec.load(tmp_path / "c.json").matmul_efficiency == \
        sweep.cluster.matmul_efficiency


def test_sweep_chain_computes_the_chain_it_times():
    mesh = profiler._mesh(jax.devices()[:2], (2,))
    x, w1, w2 = matmul_sweep._operands(mesh, "float32", (8, 4, 16))
    got = np.asarray(matmul_sweep._chain(mesh, "float32", 3)((x, w1, w2)))
    xs, a, b = (np.asarray(v, np.float64) for v in (x, w1, w2))
    for d in range(2):   # each device chains its own rows with its own weights
        y = xs[d * 8:(d + 1) * 8]
        for _ in range(3):
            y = y @ a[d * 4:(d + 1) * 4] @ b[d * 16:(d + 1) * 16]
        np.testing.assert_allclose(got[d * 8:(d + 1) * 8], y, rtol=1e-4, atol=1e-5)


def test_curves_average_equal_flops_cap_at_one_and_skip_unmeasured_peaks():
    rows = [{"op": "matmul-chain", "dtype": "bfloat16", "flops": 10.0, "flops_per_s": 4.0},
            {"op": "matmul-chain", "dtype": "bfloat16", "flops": 10.0, "flops_per_s": 6.0},
            {"op": "matmul-chain", "dtype": "bfloat16", "flops": 20.0, "flops_per_s": 30.0},
            {"op": "matmul", "dtype": "bfloat16", "flops": 5.0, "flops_per_s": 1.0},
            {"op": "matmul-chain", "dtype": "float16", "flops": 10.0, "flops_per_s": 1.0}]
    assert matmul_sweep.curves(rows, {"bfloat16": 10.0}) == {
        "bfloat16": ((10.0, 0.5), (20.0, 1.0))}


def test_profiled_gpu_cluster_drops_the_presets_curve_of_a_remeasured_dtype():
    # A preset's curve is a fraction of the datasheet peak; once the peak is the measured
    # best rate, that curve would count the shortfall twice.
    base = ClusterSpec.preset("1xH100-80GB")
    assert {"float16", "bfloat16"} <= set(base.matmul_efficiency)
    samples = [{"op": "matmul", "dtype": "float16", "flops": 1e12, "flops_per_s": 5e14,
                "bytes_per_s": 1.0}]
    _, cluster = profiler._fit_cluster(base, [], samples)
    assert cluster.peak_flops_per_s("float16") == 5e14
    assert "float16" not in cluster.matmul_efficiency
    assert cluster.matmul_efficiency["bfloat16"] == base.matmul_efficiency["bfloat16"]
    assert cluster.peak_flops_per_s("bfloat16") == base.peak_flops_per_s("bfloat16")


# --- convolution efficiency sweep ----------------------------------------------------------------


def test_conv_sweep_samples_become_the_clusters_conv_curve(tmp_path):
    result = profiler.profile(collectives=(), mesh_shapes=[], dtypes=("float32",),
                              matmul_shapes=(), conv_shapes=conv_sweep.QUICK_SHAPES, quick=True)
    chains = [c for c in result.compute_samples if c["op"] == "conv-chain"]
    assert [tuple(c["shape"]) for c in chains] == list(conv_sweep.QUICK_SHAPES)
    peak = result.cluster.peak_flops_per_s("float32")
    curve = dict(result.cluster.conv_efficiency["float32"])
    for c in chains:
        n, side, ch, w = c["shape"]
        assert c["flops"] == 2.0 * n * side * side * 9 * ch * w * ch
        short, long = c["call_seconds"]
        calls = conv_sweep.CALLS_PER_TRIP * (conv_sweep.TRIPS[1] - conv_sweep.TRIPS[0])
        assert c["seconds"] == pytest.approx(max((long - short) / calls, 1e-9))
        assert curve[c["flops"]] == pytest.approx(min(1.0, c["flops_per_s"] / peak))
        # The planner prices a convolution of this size at the measured rate.
        assert compute.compute_time_s(c["flops"], 0, "float32", result.cluster, "conv") == \
            pytest.approx(c["seconds"], rel=1e-6) or curve[c["flops"]] == 1.0
    result.save(tmp_path / "c.json")
    assert ClusterSpec.load(tmp_path / "c.json").conv_efficiency == \
        result.cluster.conv_efficiency
    with pytest.raises(ValueError, match="conv_shapes"):
        profiler.profile(collectives=(), mesh_shapes=[], conv_shapes=[(1, 2, 3)], quick=True)


def test_conv_chain_computes_the_training_pass_it_times():
    mesh = profiler._mesh(jax.devices()[:2], (2,))
    shape = (1, 4, 3, 2)
    x, k1, k2 = conv_sweep._operands(mesh, "float32", shape)
    got = np.asarray(conv_sweep._chain(mesh, 2)((x, k1, k2)))
    xs, a, b = (np.asarray(v) for v in (x, k1, k2))
    for d in range(2):   # each device runs its own images with its own kernels
        y, u, v = xs[d:d + 1], a[3 * d:3 * d + 3], b[3 * d:3 * d + 3]
        for _ in range(2):
            def f(y, u, v):
                return conv_sweep._conv(conv_sweep._conv(y, u), v)
            out, vjp = jax.vjp(f, y, u, v)
            dy, du, dv = vjp(out)
            y, u, v = out + 1e-3 * dy, u - 1e-3 * du, v - 1e-3 * dv
        np.testing.assert_allclose(got[d:d + 1], y, rtol=1e-5, atol=1e-6)
