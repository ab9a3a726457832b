"""Matmul efficiency by size (cost_model/efficiency.py, kernel_efficiency.json): the table,
its interpolation, the presets built from it, and the time model reading it."""

import dataclasses
import json
import math
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from autopar.cost_model import ClusterSpec, compute, devices, efficiency

H100_4096 = 2 * 4096**3
H100_8192 = 2 * 8192**3


def test_table_rows_carry_sources_and_valid_fractions():
    table = efficiency.table()
    assert set(table) <= set(devices.DEVICE_KINDS)
    assert {"V100-16GB", "H100-80GB", "H200-141GB"} <= set(table)
    for kind, entry in table.items():
        assert 0 < entry.bandwidth_fraction <= 1 and entry.bandwidth_source
        for dtype, points in entry.matmul.items():
            assert dtype in devices.DEVICE_KINDS[kind].peak_flops, (kind, dtype)
            assert [p.flops for p in points] == sorted(p.flops for p in points)
            for p in points:
                assert 0 < p.fraction <= 1 and p.flops > 0 and len(p.source) > 20


def test_fraction_interpolates_in_log_flops_and_clamps():
    curve = efficiency.check_curve("t", [(1e12, 0.8), (1e10, 0.2)])
    assert curve == ((1e10, 0.2), (1e12, 0.8))
    assert efficiency.fraction_at(curve, 1e10) == 0.2
    assert efficiency.fraction_at(curve, 1e12) == 0.8
    assert efficiency.fraction_at(curve, 1e11) == pytest.approx(0.5)  # log midpoint
    assert efficiency.fraction_at(curve, 1e5) == 0.2 == efficiency.fraction_at(curve, 0)
    assert efficiency.fraction_at(curve, 1e15) == 0.8
    xs = np.logspace(8, 14, 61)
    ys = [efficiency.fraction_at(curve, x) for x in xs]
    assert all(b >= a for a, b in zip(ys, ys[1:]))  # monotone where the points are


@pytest.mark.parametrize("bad", [[], [(1e9, 0.0)], [(1e9, 1.5)], [(0, 0.5)], [(1e9, 0.3),
                                                                             (1e9, 0.4)]])
def test_bad_curves_are_refused(bad):
    with pytest.raises(ValueError, match="efficiency curve"):
        efficiency.check_curve("t", bad)


def test_time_model_reads_the_curve_by_call_size():
    h100 = ClusterSpec.preset("8xH100-80GB")
    (point,) = efficiency.table()["H100-80GB"].matmul["bfloat16"]  # one measured point
    assert h100.peak_flops_per_s("bfloat16") == 989.5e12  # the datasheet: the curve derates
    for flops in (1e9, H100_4096, H100_8192, 1e14):
        assert compute.flop_fraction(flops, "bfloat16", h100) == point.fraction
    t = compute.compute_time_s(H100_8192, 0, "bfloat16", h100)
    assert t == pytest.approx(H100_8192 / (989.5e12 * point.fraction))
    # A two-point curve: a smaller matmul runs at a lower fraction, costs more per FLOP.
    two = dataclasses.replace(h100, matmul_efficiency={"bfloat16": [(H100_4096, 0.4),
                                                                     (H100_8192, 0.8)]})
    mid = math.sqrt(H100_4096 * H100_8192)
    assert compute.flop_fraction(mid, jnp.bfloat16, two) == pytest.approx(0.6)
    per_flop = [compute.compute_time_s(f, 0, "bfloat16", two) / f
                for f in (1e9, H100_4096, mid, H100_8192, 1e14)]
    assert per_flop[1] > per_flop[2] > per_flop[3]
    assert per_flop[0] == pytest.approx(per_flop[1])  # clamped ends
    assert per_flop[3] == pytest.approx(per_flop[4])
    # Streaming bytes at the measured bandwidth fraction.
    bw = efficiency.table()["H100-80GB"].bandwidth_fraction
    assert h100.memory_bandwidth_bytes_per_s == pytest.approx(3350e9 * bw)
    assert compute.compute_time_s(1e6, 1e9, "bfloat16", h100) == pytest.approx(
        1e9 / (3350e9 * bw))


@pytest.mark.parametrize("preset, tf32", [("8xA100-80GB", 156e12), ("8xH100-80GB", 494.5e12),
                                          ("1xH200-141GB", 494.5e12)])
def test_float32_matmuls_at_tf32(preset, tf32):
    spec = ClusterSpec.preset(preset)
    assert spec.peak_flops_per_s(np.float32) == tf32
    assert spec.peak_flops_per_s("float64") < tf32 / 2


def test_presets_without_a_table_price_as_before():
    a100 = ClusterSpec.preset("8xA100-80GB")
    assert "A100-80GB" not in efficiency.table()
    assert dict(a100.matmul_efficiency) == {}
    assert compute.flop_fraction(1e9, "bfloat16", a100) == 1.0
    assert a100.memory_bandwidth_bytes_per_s == 2039e9
    cpu = ClusterSpec.preset("cpu-local")
    assert dict(cpu.matmul_efficiency) == {}
    flops, nbytes = 2 * 512**3, 3 * 512**2 * 4
    assert compute.compute_time_s(flops, nbytes, "float32", cpu) == max(
        flops / cpu.peak_flops_per_s("float32"), nbytes / cpu.memory_bandwidth_bytes_per_s)


def test_curves_survive_json_and_old_files_load():
    spec = ClusterSpec.preset("2x8xH100-80GB")
    data = json.loads(json.dumps(spec.to_json()))
    assert set(data["matmul_efficiency"]) == {"bfloat16", "float16", "float32"}
    assert ClusterSpec.from_json(data) == spec
    del data["matmul_efficiency"]  # a file written before curves existed
    old = ClusterSpec.from_json(data)
    assert dict(old.matmul_efficiency) == {} and old != spec
    assert "matmul_efficiency" not in ClusterSpec.preset("8xA100-80GB").to_json()
    data["matmul_efficiency"] = {"float16": [[1e9, 2.0]]}
    with pytest.raises(ValueError, match="efficiency curve"):
        ClusterSpec.from_json(data)


def test_with_devices_and_hash_keep_curves():
    spec = ClusterSpec.preset("4x8xH100-80GB")
    sub = spec.with_devices(1, 2)
    assert sub.matmul_efficiency == spec.matmul_efficiency
    assert len({spec, ClusterSpec.preset("4x8xH100-80GB")}) == 1
    with pytest.raises(TypeError):
        spec.matmul_efficiency["float16"] = ((1.0, 1.0),)


def test_h200_rows_are_the_lent_sweep_they_cite():
    """Each H200 matmul row is the mean, over the sweep's shapes of its FLOPs, of the
    matmul-chain rate in the results file it cites, as a fraction of the dense peak; the
    sweep shows small calls far below large ones, and the preset prices them so."""
    results = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    report = json.loads((results / "gpu-NVIDIA-H200-series.json").read_text())
    h200 = ClusterSpec.preset("1xH200-141GB")   # float32 at TF32, XLA's default precision
    table = efficiency.table()["H200-141GB"].matmul
    for dtype, points in table.items():
        assert len(points) >= 5, dtype
        for p in points:
            assert "gpu-NVIDIA-H200-series.json" in p.source
            rates = [r["flops_per_s"] for r in report["profile"]["rows"]
                     if r["op"] == "matmul-chain" and r["dtype"] == dtype
                     and 2 * math.prod(r["shape"]) == p.flops]
            assert rates, (dtype, p.flops)
            mean = sum(rates) / len(rates)
            assert p.fraction == pytest.approx(mean / h200.peak_flops_per_s(dtype), abs=1e-4)
    small, large = 2 * 512 * 1024 * 4096, 2 * 2048 * 4096 * 16384
    assert (compute.compute_time_s(small, 0, "bfloat16", h200) / small
            > 2 * compute.compute_time_s(large, 0, "bfloat16", h200) / large)


# --- convolutions ------------------------------------------------------------------------------


def test_conv_calls_read_the_conv_curve_and_fall_back_to_matmul():
    h100 = ClusterSpec.preset("8xH100-80GB")
    assert compute.kernel_of("conv_general_dilated") == "conv"
    assert compute.kernel_of("dot_general") == compute.kernel_of("add") == "matmul"
    # Without a conv curve a convolution is priced on the matmul curve (as before).
    assert dict(h100.conv_efficiency) == {}
    assert compute.compute_time_s(1e12, 0, "bfloat16", h100, "conv") == \
        compute.compute_time_s(1e12, 0, "bfloat16", h100)
    spec = dataclasses.replace(h100, conv_efficiency={"bfloat16": [(1e10, 0.1), (1e12, 0.3)]})
    peak = spec.peak_flops_per_s("bfloat16")
    assert compute.compute_time_s(1e12, 0, "bfloat16", spec, "conv") == \
        pytest.approx(1e12 / (peak * 0.3))
    assert compute.flop_fraction(1e11, "bfloat16", spec, "conv") == pytest.approx(0.2)
    # Matmuls, and convolutions of a dtype without a conv curve, keep the matmul curve.
    assert compute.flop_fraction(1e11, "bfloat16", spec) == \
        compute.flop_fraction(1e11, "bfloat16", h100)
    assert compute.flop_fraction(1e11, "float16", spec, "conv") == \
        compute.flop_fraction(1e11, "float16", h100)
    data = json.loads(json.dumps(spec.to_json()))
    assert data["conv_efficiency"] == {"bfloat16": [[1e10, 0.1], [1e12, 0.3]]}
    assert ClusterSpec.from_json(data) == spec and spec != h100
    assert "conv_efficiency" not in h100.to_json()  # files without conv curves unchanged


def _table_with(conv: dict) -> dict:
    row = {"flops": 1e12, "fraction": 0.5, "source": "test"}
    return {"format_version": efficiency.FORMAT_VERSION, "devices": {"H200-141GB": {
        "bandwidth": {"fraction": 0.9, "source": "test"},
        "matmul": {"bfloat16": [row]}, **conv}}}


def test_table_conv_rows_parse_and_need_matmul_rows():
    rows = [{"flops": 1e11, "fraction": 0.2, "source": "a"},
            {"flops": 1e10, "fraction": 0.1, "source": "b"}]
    entry = efficiency.parse(_table_with({"conv": {"bfloat16": rows}}))["H200-141GB"]
    assert entry.conv_curves() == {"bfloat16": ((1e10, 0.1), (1e11, 0.2))}
    assert efficiency.parse(_table_with({}))["H200-141GB"].conv_curves() == {}
    with pytest.raises(ValueError, match=r"conv rows for \['float16'\] without matmul rows"):
        efficiency.parse(_table_with({"conv": {"float16": rows}}))
    with pytest.raises(ValueError, match="H200-141GB/conv/bfloat16"):
        efficiency.parse(_table_with({"conv": {"bfloat16": [dict(rows[0], fraction=2.0)]}}))


def test_planner_prices_convolutions_on_the_conv_curve():
    import jax
    import optax

    import autopar

    def step(w, x):
        def loss(w):
            y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return jnp.mean(y**2)
        value, grad = jax.value_and_grad(loss)(w)
        return optax.apply_updates(w, jax.tree.map(lambda g: -1e-3 * g, grad)), value

    args = (jax.ShapeDtypeStruct((3, 3, 256, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, 56, 56, 256), jnp.bfloat16))
    base = ClusterSpec.preset("1xH100-80GB")
    slow = dataclasses.replace(base, conv_efficiency={"bfloat16": [(1.0, 0.05)]})
    method = autopar.ShardParallel(memory_budget_bytes=1e12)
    t_base, t_slow = (autopar.plan(step, *args, cluster=c, method=method).predicted.step_s
                      for c in (base, slow))
    # Two convolutions of 2*64*56*56*9*256*256 FLOPs each (forward and kernel gradient; x
    # is no parameter), now at 5% of the peak: the step is at least their time.
    conv_s = 2 * 2 * 64 * 56 * 56 * 9 * 256 * 256 / (base.peak_flops_per_s("bfloat16") * 0.05)
    assert t_slow >= conv_s * 0.99 and t_slow > 2 * t_base
