"""Tests for autopar.cost_model: presets, JSON, mesh links, α-β collectives, roofline."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar.cost_model import ClusterSpec, Link, collectives, compute, efficiency

LINK = Link(alpha_s=1e-5, beta_s_per_byte=1e-9)
COLLECTIVE_FNS = [
    collectives.all_reduce_s,
    collectives.all_gather_s,
    collectives.reduce_scatter_s,
    collectives.all_to_all_s,
    collectives.send_recv_s,
]


# --- presets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ClusterSpec.presets())
def test_every_example_preset_parses(name):
    spec = ClusterSpec.preset(name)
    assert spec.num_devices == spec.num_hosts * spec.devices_per_host
    assert spec.peak_flops_per_s("float32") > 0
    assert spec.memory_bytes > 0 and spec.memory_bandwidth_bytes_per_s > 0
    assert ClusterSpec.preset(spec.name) == spec  # the canonical name parses to itself
    hash(spec)


@pytest.mark.parametrize(
    "name, hosts, per_host, kind",
    [
        ("8xA100-80GB", 1, 8, "A100-80GB"),
        ("2x8xA100-80GB", 2, 8, "A100-80GB"),
        ("8x8xV100-16GB", 8, 8, "V100-16GB"),
        ("8xH100-80GB", 1, 8, "H100-80GB"),
        ("4x8xH100-80GB", 4, 8, "H100-80GB"),
        ("4xa100-40gb", 1, 4, "A100-40GB"),
        ("cpu-local", 1, 8, "cpu"),
        ("4xCPU", 1, 4, "cpu"),
    ],
)
def test_preset_grammar(name, hosts, per_host, kind):
    spec = ClusterSpec.preset(name)
    assert (spec.num_hosts, spec.devices_per_host, spec.device_kind) == (hosts, per_host, kind)


def test_preset_figures_are_the_datasheet_ones():
    a100 = ClusterSpec.preset("8xA100-80GB")
    assert a100.peak_flops_per_s(jnp.bfloat16) == 312e12
    # float32 dots at XLA's default precision: TF32 (devices.py default_precision).
    assert a100.peak_flops_per_s("float32") == a100.peak_flops_per_s("tf32") == 156e12
    assert a100.memory_bandwidth_bytes_per_s == 2039e9
    assert a100.memory_bytes == 80 * 2**30
    # Alpa's testbed: 25 Gbps per p3.16xlarge shared by 8 GPUs, derated by 0.8.
    v100 = ClusterSpec.preset("8x8xV100-16GB")
    assert v100.inter_host.bandwidth_bytes_per_s == pytest.approx(25e9 / 8 * 0.8 / 8)
    assert v100.intra_host.bandwidth_bytes_per_s > 10 * v100.inter_host.bandwidth_bytes_per_s
    # The FP16 tensor peak (125 TFLOP/s) at the fraction calibrated on Megatron-LM's run
    # (kernel_efficiency.json: one point, so every size).
    assert v100.peak_flops_per_s("float16") == 125e12
    assert compute.flop_fraction(1e9, "float16", v100) == 0.47
    assert compute.flop_fraction(1e13, np.float16, v100) == 0.47
    assert v100.peak_flops_per_s("float32") == 15.7e12  # no TF32 on V100


def test_peak_flops_dtype_lookup():
    spec = ClusterSpec.preset("8xA100-80GB")
    assert spec.peak_flops_per_s(np.float16) == spec.peak_flops_per_s("fp16") == 312e12
    assert spec.peak_flops_per_s(jnp.dtype("bfloat16")) == 312e12
    assert spec.peak_flops_per_s(np.int8) == 624e12
    assert spec.peak_flops_per_s(np.complex64) == spec.peak_flops["float32"]  # fallback
    assert spec.peak_flops_per_s("no-such-dtype") == spec.peak_flops["float32"]


@pytest.mark.parametrize("bad", ["8xB200", "A100-80GB", "8x", "", "x8xA100-80GB", "0x8xH100-80GB"])
def test_bad_preset_lists_valid_kinds(bad):
    with pytest.raises(ValueError) as info:
        ClusterSpec.preset(bad)
    msg = str(info.value)
    if bad != "0x8xH100-80GB":
        assert "A100-80GB" in msg and "V100-16GB" in msg and "[HOSTS x ]DEVICES x KIND" in msg
    assert repr(bad) in msg


def test_spec_is_frozen_and_hashable():
    spec = ClusterSpec.preset("2x8xA100-80GB")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_hosts = 3
    with pytest.raises(TypeError):
        spec.peak_flops["float32"] = 1.0
    assert len({spec, ClusterSpec.preset("2x8xA100-80GB")}) == 1


def test_with_devices_keeps_hardware():
    spec = ClusterSpec.preset("4x8xH100-80GB")
    sub = spec.with_devices(1, 4)
    assert (sub.num_hosts, sub.devices_per_host, sub.name) == (1, 4, "4xH100-80GB")
    assert sub.peak_flops == spec.peak_flops and sub.inter_host == spec.inter_host
    with pytest.raises(ValueError, match="devices_per_host"):
        spec.with_devices(1, 0)


# --- JSON -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cpu-local", "2x8xA100-80GB", "8x8xV100-16GB", "4x8xH100-80GB"])
def test_json_round_trip(tmp_path, name):
    spec = ClusterSpec.preset(name)
    path = tmp_path / "cluster.json"
    spec.save(path)
    assert json.loads(path.read_text())["format_version"] == 1
    assert ClusterSpec.load(path) == spec
    assert ClusterSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


def _write(tmp_path, data):
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_load_not_json_names_file(tmp_path):
    path = _write(tmp_path, "{not json")
    with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        ClusterSpec.load(path)


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.pop("memory_bytes"), "memory_bytes"),
        (lambda d: d.update(num_hosts="two"), "num_hosts"),
        (lambda d: d.update(num_hosts=1.5), "num_hosts"),
        (lambda d: d["intra_host"].update(alpha_s="fast"), "intra_host.alpha_s"),
        (lambda d: d["inter_host"].pop("beta_s_per_byte"), "inter_host"),
        (lambda d: d["peak_flops"].update(bfloat16=None), "peak_flops.bfloat16"),
        (lambda d: d.update(format_version=99), "format_version"),
        (lambda d: d.update(colour="red"), "colour"),
        (lambda d: d.update(devices_per_host=0), "devices_per_host"),
        (lambda d: d.update(peak_flops={"bfloat16": 1e12}), "float32"),
    ],
)
def test_load_malformed_names_file_and_field(tmp_path, edit, field):
    d = ClusterSpec.preset("2x8xA100-80GB").to_json()
    edit(d)
    path = _write(tmp_path, d)
    with pytest.raises(ValueError) as info:
        ClusterSpec.load(path)
    assert "bad.json" in str(info.value) and field in str(info.value)


# --- mesh axis links --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh_shape, expected",
    [
        ((2, 8), ("inter", "intra")),
        ((16,), ("inter",)),
        ((4, 4), ("inter", "intra")),
        ((8, 2), ("inter", "intra")),
        ((2, 2, 4), ("inter", "intra", "intra")),
        ((8,), ("intra",)),
        ((1, 8), ("intra", "intra")),
        ((2, 4), ("intra", "intra")),
        ((16, 1), ("inter", "intra")),
        ((), ()),
    ],
)
def test_mesh_axis_links(mesh_shape, expected):
    spec = ClusterSpec.preset("2x8xA100-80GB")
    links = {"inter": spec.inter_host, "intra": spec.intra_host}
    assert spec.mesh_axis_links(mesh_shape) == tuple(links[e] for e in expected)


@pytest.mark.parametrize("mesh_shape", [(32,), (3,), (2, 3), (0, 8), (-2, -8)])
def test_mesh_axis_links_rejects_bad_shapes(mesh_shape):
    with pytest.raises(ValueError, match="mesh_shape"):
        ClusterSpec.preset("2x8xA100-80GB").mesh_axis_links(mesh_shape)


# --- collectives ------------------------------------------------------------------------------


def test_collective_formulas():
    s, n, a, b = 1e6, 4, LINK.alpha_s, LINK.beta_s_per_byte
    assert collectives.all_reduce_s(s, n, LINK) == pytest.approx(a + 2 * 3 / 4 * s * b)
    assert collectives.all_gather_s(s, n, LINK) == pytest.approx(a + 3 / 4 * s * b)
    assert collectives.reduce_scatter_s(s, n, LINK) == pytest.approx(a + 3 / 4 * s * b)
    assert collectives.all_to_all_s(s, n, LINK) == pytest.approx(a + 3 / 16 * s * b)
    assert collectives.send_recv_s(s, 2, LINK) == pytest.approx(a + s * b)
    # all-reduce = reduce-scatter + all-gather in bandwidth
    assert collectives.all_reduce_s(s, n, LINK) - a == pytest.approx(
        collectives.reduce_scatter_s(s, n, LINK) + collectives.all_gather_s(s, n, LINK) - 2 * a
    )
    assert set(collectives.COLLECTIVES.values()) == set(COLLECTIVE_FNS)


@pytest.mark.parametrize("fn", COLLECTIVE_FNS)
@pytest.mark.parametrize("n", [0, 1])
def test_collective_single_device_is_free(fn, n):
    assert fn(1e9, n, LINK) == 0.0


@pytest.mark.parametrize("fn", COLLECTIVE_FNS)
def test_collective_rejects_negative_bytes(fn):
    with pytest.raises(ValueError, match="nbytes"):
        fn(-1, 4, LINK)


@pytest.mark.parametrize("fn", COLLECTIVE_FNS)
@given(
    nbytes=st.floats(0, 1e12),
    extra=st.floats(0, 1e12),
    n=st.integers(2, 4096),
    dn=st.integers(0, 4096),
)
def test_collective_monotone(fn, nbytes, extra, n, dn):
    assert fn(nbytes, n, LINK) <= fn(nbytes + extra, n, LINK)
    if fn is not collectives.all_to_all_s:  # (n-1)/n^2 per device shrinks as n grows
        assert fn(nbytes, n, LINK) <= fn(nbytes, n + dn, LINK) * (1 + 1e-12)
    assert fn(nbytes, n, LINK) >= LINK.alpha_s


@given(nbytes=st.floats(0, 1e12), n=st.integers(2, 4096), dn=st.integers(0, 4096))
def test_all_to_all_total_traffic_monotone(nbytes, n, dn):
    # Total bytes moved, n * (n-1)/n^2 * S = (n-1)/n * S, grows with n.
    def total(k):
        return k * (collectives.all_to_all_s(nbytes, k, LINK) - LINK.alpha_s)

    # Subtracting alpha leaves float noise of ~1e-16 x alpha per collective when the
    # bandwidth term is tiny: allow for it.
    assert total(n) <= total(n + dn) * (1 + 1e-12) + 1e-15 * (n + dn) * LINK.alpha_s


# --- compute ----------------------------------------------------------------------------------


def test_combined_collectives_share_one_latency_on_gpus_not_on_cpu():
    """XLA:GPU combines independent collectives into ops of up to 30 MiB, so a small one
    pays its share of one α and a large one a whole α; XLA:CPU runs each alone."""
    mib = 2**20
    share = collectives.combined_alpha_share
    assert share(3 * mib, "V100-16GB") == pytest.approx(0.1)
    assert share(30 * mib, "H100-80GB") == 1.0 == share(300 * mib, "H100-80GB")
    assert share(0.0, "A100-80GB") == 0.0
    assert share(3 * mib, "cpu") == 1.0 == share(0.0, "cpu")
    from autopar.passes.sharding_spec import MeshContext, reshard_s
    from autopar.pipeline_search import gather_after_update_s

    alpha, small = 5e-6, 3 * mib
    gpu = dataclasses.replace(ClusterSpec.preset("8xV100-16GB"), intra_host=Link(alpha, 1e-11))
    cpu = dataclasses.replace(gpu, device_kind="cpu")
    state, spec = (("x",), ()), ((), ())
    on_cpu = MeshContext.build((4,), cpu)
    on_gpu = MeshContext.build((4,), gpu)
    assert gather_after_update_s(state, spec, small, on_cpu) == reshard_s(
        state, spec, small, on_cpu)
    assert gather_after_update_s(state, spec, small, on_gpu) == pytest.approx(
        reshard_s(state, spec, small, on_gpu) - 0.9 * alpha)
    assert gather_after_update_s(spec, spec, small, on_gpu) == 0.0


def test_roofline_compute_bound():
    spec = ClusterSpec.preset("8xA100-80GB")
    flops, nbytes = 2 * 4096**3, 3 * 4096**2 * 2  # bf16 matmul
    t = compute.compute_time_s(flops, nbytes, jnp.bfloat16, spec)
    assert t == pytest.approx(flops / 312e12)
    assert t > nbytes / spec.memory_bandwidth_bytes_per_s


def test_roofline_memory_bound():
    spec = ClusterSpec.preset("8xA100-80GB")
    flops, nbytes = 2**20, 3 * 2**20 * 4  # elementwise f32 add
    t = compute.compute_time_s(flops, nbytes, "float32", spec)
    assert t == pytest.approx(nbytes / 2039e9)
    assert t > flops / spec.peak_flops_per_s("float32")


def test_roofline_dtype_matters_and_validates():
    spec = ClusterSpec.preset("8xA100-80GB")
    f32 = compute.compute_time_s(1e15, 0, np.float32, spec)
    bf16 = compute.compute_time_s(1e15, 0, jnp.bfloat16, spec)
    assert math.isclose(f32 / bf16, 312 / 156)  # float32 at TF32
    f64 = compute.compute_time_s(1e15, 0, np.float64, spec)
    assert math.isclose(f64 / bf16, 312 / 19.5)
    with pytest.raises(ValueError, match="flops"):
        compute.compute_time_s(-1, 0, "float32", spec)


# --- live devices -----------------------------------------------------------------------------


def test_from_devices_cpu():
    spec = ClusterSpec.from_devices(jax.devices())
    assert (spec.name, spec.num_hosts, spec.devices_per_host, spec.num_devices) == (
        "cpu-local",
        1,
        8,
        8,
    )
    assert spec.device_kind == "cpu"
    assert spec == ClusterSpec.preset("cpu-local")
    sub = ClusterSpec.from_devices(jax.devices()[:4])
    assert sub.num_devices == 4
    # 4 emulated devices share the host: each gets twice the share of 8.
    assert sub.peak_flops_per_s("float32") == pytest.approx(2 * spec.peak_flops_per_s("float32"))


@dataclasses.dataclass
class _FakeDevice:
    device_kind: str
    process_index: int
    platform: str = "gpu"


def test_from_devices_gpu_matches_table():
    devs = [_FakeDevice("NVIDIA A100-SXM4-80GB", i // 8) for i in range(16)]
    assert ClusterSpec.from_devices(devs) == ClusterSpec.preset("2x8xA100-80GB")
    devs = [_FakeDevice("Tesla V100-SXM2-16GB", 0) for _ in range(8)]
    assert ClusterSpec.from_devices(devs) == ClusterSpec.preset("8xV100-16GB")
    devs = [_FakeDevice("NVIDIA H100 80GB HBM3", 0) for _ in range(8)]
    assert ClusterSpec.from_devices(devs).device_kind == "H100-80GB"
    h200 = ClusterSpec.from_devices([_FakeDevice("NVIDIA H200", 0)])
    assert h200 == ClusterSpec.preset("1xH200-141GB")
    h100 = ClusterSpec.preset("1xH100-80GB")
    # Same compute as the H100 (datasheet), more and faster memory, each at the bandwidth
    # fraction measured on its lent GPU (kernel_efficiency.json).
    assert h200.peak_flops == h100.peak_flops
    measured = efficiency.table()
    assert h200.memory_bandwidth_bytes_per_s / h100.memory_bandwidth_bytes_per_s == \
        pytest.approx(4.8 * measured["H200-141GB"].bandwidth_fraction
                      / (3.35 * measured["H100-80GB"].bandwidth_fraction))


def test_from_devices_errors():
    with pytest.raises(ValueError, match=r"'TPU v4'.*A100-80GB"):
        ClusterSpec.from_devices([_FakeDevice("TPU v4", 0, "tpu")])
    with pytest.raises(ValueError, match="same number of devices"):
        ClusterSpec.from_devices([_FakeDevice("NVIDIA A100-SXM4-80GB", i) for i in (0, 0, 1)])
    with pytest.raises(ValueError, match="at least one device"):
        ClusterSpec.from_devices([])
