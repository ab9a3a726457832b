"""Tests for autopar.cost_model.hlo_audit: collectives, bytes and mesh axes read back from
compiled HLO on 8 CPU devices, memory and FLOPs, and pricing."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autopar.cost_model import ClusterSpec, Link, collectives, hlo_audit
from autopar.cost_model.compute import compute_time_s
from autopar.cost_model.hlo_audit import audit, audit_text

from helpers import per_device_bytes

L = 1024  # float32 elements per device: every local buffer is (1, L) = 4096 bytes
LOCAL = 4 * L
MESHES = [((8,), ("d",)), ((2, 4), ("x", "y"))]
CASES = [(shape, names, axis) for shape, names in MESHES for axis in names]


def make_mesh(shape, names):
    devices = np.array(jax.devices()[: math.prod(shape)]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


def shard_map_audit(fn, shape, names):
    mesh = make_mesh(shape, names)
    spec = P(names)  # dim 0 over all axes: a (1, L) row per device
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    x = jnp.ones((math.prod(shape), L), jnp.float32)
    compiled = f.lower(x).compile()
    return audit(compiled, shape, names), compiled


def only(result):
    assert len(result.collectives) == 1, result.summary()
    return result.collectives[0]


def check_groups(c, shape, names, axis):
    n = shape[names.index(axis)]
    assert c.axes == (axis,)
    assert c.group_size == n
    assert c.full_axes
    assert len(c.groups) == math.prod(shape) // n
    assert sorted(d for g in c.groups for d in g) == list(range(math.prod(shape)))


@pytest.mark.parametrize("shape,names,axis", CASES)
def test_psum(shape, names, axis):
    c = only(shard_map_audit(lambda a: jax.lax.psum(a, axis), shape, names)[0])
    assert (c.kind, c.dtype, c.operand_bytes, c.result_bytes) == (
        "all-reduce", "float32", LOCAL, LOCAL)
    assert c.nbytes == LOCAL
    check_groups(c, shape, names, axis)


@pytest.mark.parametrize("shape,names,axis", CASES)
def test_all_gather(shape, names, axis):
    n = shape[names.index(axis)]
    c = only(shard_map_audit(lambda a: jax.lax.all_gather(a, axis, axis=1, tiled=True),
                             shape, names)[0])
    assert (c.kind, c.operand_bytes, c.result_bytes) == ("all-gather", LOCAL, n * LOCAL)
    assert c.nbytes == n * LOCAL  # S = the gathered result
    check_groups(c, shape, names, axis)


@pytest.mark.parametrize("shape,names,axis", CASES)
def test_psum_scatter(shape, names, axis):
    # JAX-NOTES warns that CPU XLA may lower this to all-reduce + dynamic-slice. On jax
    # 0.10.2 a shard_map psum_scatter stays one reduce-scatter; accept either, with the
    # operand (S of both) the full local buffer.
    n = shape[names.index(axis)]
    audited, _ = shard_map_audit(
        lambda a: jax.lax.psum_scatter(a, axis, scatter_dimension=1, tiled=True), shape, names)
    c = only(audited)
    assert c.kind in ("reduce-scatter", "all-reduce")
    assert c.operand_bytes == LOCAL and c.nbytes == LOCAL
    assert c.result_bytes == (LOCAL // n if c.kind == "reduce-scatter" else LOCAL)
    check_groups(c, shape, names, axis)


@pytest.mark.parametrize("shape,names,axis", CASES)
def test_all_to_all(shape, names, axis):
    # CPU XLA emits the tuple form: n operands of LOCAL / n each, n results.
    n = shape[names.index(axis)]
    c = only(shard_map_audit(lambda a: jax.lax.all_to_all(a, axis, 1, 1, tiled=True),
                             shape, names)[0])
    assert (c.kind, c.operand_bytes, c.result_bytes) == ("all-to-all", LOCAL, LOCAL)
    assert c.nbytes == n * LOCAL  # S = the group's whole tensor, as the planner prices it
    check_groups(c, shape, names, axis)


@pytest.mark.parametrize("shape,names,axis", CASES)
def test_ppermute(shape, names, axis):
    n = shape[names.index(axis)]
    perm = [(i, (i + 1) % n) for i in range(n)]
    c = only(shard_map_audit(lambda a: jax.lax.ppermute(a, axis, perm), shape, names)[0])
    assert (c.kind, c.operand_bytes, c.result_bytes) == ("collective-permute", LOCAL, LOCAL)
    assert c.axes == (axis,) and c.group_size == n
    assert len(c.groups) == math.prod(shape)  # one (source, target) pair per device
    mesh_pos = np.arange(math.prod(shape)).reshape(shape)
    k = names.index(axis)
    for src, dst in c.groups:  # the pair is the ring shift along `axis`
        a, b = np.argwhere(mesh_pos == src)[0], np.argwhere(mesh_pos == dst)[0]
        assert b[k] == (a[k] + 1) % n and all(a[i] == b[i] for i in range(len(shape)) if i != k)


def test_psum_over_both_axes_and_several_collectives_in_order():
    def f(a):
        a = jax.lax.psum(a, ("x", "y"))
        b = jax.lax.all_gather(a, "x", axis=1, tiled=True)
        return jax.lax.psum(b, "y")[:, :L]

    audited, _ = shard_map_audit(f, (2, 4), ("x", "y"))
    kinds = [(c.kind, c.axes, c.group_size) for c in audited.collectives]
    assert kinds == [("all-reduce", ("x", "y"), 8), ("all-gather", ("x",), 2),
                     ("all-reduce", ("y",), 4)]
    assert audited.bytes_by_kind() == {"all-reduce": LOCAL + 2 * LOCAL, "all-gather": 2 * LOCAL}


# --- data parallel ------------------------------------------------------------------------------


def mlp_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (64, 128)), "b1": jnp.zeros((128,)),
            "w2": jax.random.normal(k2, (128, 10)), "b2": jnp.zeros((10,))}


def mlp_loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def sgd_step(p, x, y):
    g = jax.grad(mlp_loss)(p, x, y)
    return jax.tree.map(lambda w, d: w - 0.1 * d, p, g)


@pytest.mark.parametrize("shape,names", MESHES)
def test_data_parallel_all_reduce_bytes_equal_gradient_bytes(shape, names):
    mesh = make_mesh(shape, names)
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(names))
    step = jax.jit(sgd_step, in_shardings=(replicated, batch, batch),
                   out_shardings=replicated)
    params = mlp_params()
    compiled = step.lower(params, jnp.ones((256, 64)), jnp.ones((256, 10))).compile()
    audited = audit(compiled, shape, names)
    grad_bytes = sum(w.size * w.dtype.itemsize for w in jax.tree.leaves(params))
    # XLA combines the four gradient all-reduces into one tuple all-reduce on CPU: assert
    # bytes and axes, not the count.
    assert {c.kind for c in audited.collectives} == {"all-reduce"}
    assert audited.bytes_by_kind("operand_bytes") == {"all-reduce": grad_bytes}
    assert audited.bytes_by_kind("result_bytes") == {"all-reduce": grad_bytes}
    for c in audited.collectives:
        assert c.axes == names and c.group_size == math.prod(shape)


def test_collectives_in_loops_count_once_per_iteration():
    # A scan over 3 blocks of a scan over 2 layers, the weights split on their columns:
    # each layer all-gathers its (16, 64) output, so one all-gather instruction inside two
    # while loops runs 3 x 2 times per call (XLA records the loops' trip counts); the
    # loss's all-reduce, outside the loops, once.
    mesh = make_mesh((8,), ("d",))

    def f(ws, x):
        def layer(x, w):
            return jnp.tanh(x @ w), None

        def block(x, w2):
            return jax.lax.scan(layer, x, w2)[0], None

        return jax.lax.scan(block, x, ws)[0].sum()

    ws, x = jnp.ones((3, 2, 64, 64)), jnp.ones((16, 64))
    split = NamedSharding(mesh, P(None, None, None, "d"))
    compiled = jax.jit(f, in_shardings=(split, NamedSharding(mesh, P()))).lower(ws, x).compile()
    audited = audit(compiled, (8,), ("d",))
    runs = {c.kind: c.count for c in audited.collectives}
    assert runs == {"all-gather": 6, "all-reduce": 1}, audited.summary()
    assert audited.bytes_by_kind()["all-gather"] == 6 * 16 * 64 * 4
    once = dataclasses.replace(audited, collectives=tuple(
        dataclasses.replace(c, count=1) for c in audited.collectives))
    cluster = ClusterSpec.preset("8xA100-80GB")
    assert audited.price(cluster)["communication_s"] > once.price(cluster)["communication_s"]
    assert "runs" in audited.summary()


# --- FLOPs, memory, pricing ---------------------------------------------------------------------


def test_cost_analysis_and_memory_are_per_device():
    mesh = make_mesh((8,), ("d",))
    f = jax.jit(lambda a, b: a @ b, in_shardings=(NamedSharding(mesh, P("d")),
                                                  NamedSharding(mesh, P())),
                out_shardings=NamedSharding(mesh, P("d")))
    compiled = f.lower(jnp.ones((1024, 256)), jnp.ones((256, 128))).compile()
    audited = audit(compiled, (8,), ("d",))
    assert audited.collectives == ()
    assert audited.flops == pytest.approx(2 * 1024 * 256 * 128 / 8, rel=0.05)
    assert audited.compute_dtype == "float32"
    m = compiled.memory_analysis()
    assert audited.memory.argument_bytes == m.argument_size_in_bytes == (128 * 256 + 256 * 128) * 4
    assert audited.memory.total_bytes == per_device_bytes(compiled)


def test_convolution_programs_are_priced_on_the_conv_curve():
    """A program whose largest calls are convolutions is priced on the cluster's conv
    curve, a matmul program on the matmul curve (the kind read from the HLO op)."""
    x, k = jnp.ones((8, 32, 32, 16)), jnp.ones((3, 3, 16, 32))
    conv = jax.jit(lambda x, k: jax.lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))).lower(x, k).compile()
    matmul = jax.jit(lambda a, b: a @ b).lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile()
    conv_audit, matmul_audit = audit(conv, (1,), ("d",)), audit(matmul, (1,), ("d",))
    assert (conv_audit.compute_kernel, matmul_audit.compute_kernel) == ("conv", "matmul")
    assert conv_audit.to_json()["compute_kernel"] == "conv"
    base = ClusterSpec.preset("8xCPU")
    slow_conv = dataclasses.replace(base, conv_efficiency={"float32": ((1.0, 0.01),)})
    assert conv_audit.price(slow_conv)["compute_s"] == compute_time_s(
        conv_audit.flops, conv_audit.bytes_accessed, "float32", slow_conv, "conv")
    assert conv_audit.price(slow_conv)["compute_s"] > conv_audit.price(base)["compute_s"]
    assert matmul_audit.price(slow_conv)["compute_s"] == matmul_audit.price(base)["compute_s"]


def test_gpu_library_calls_are_read_as_their_kind():
    """GPU backends lower dots and convolutions to cuBLAS / cuDNN custom-calls whose result
    is (output, scratch): the kind and dtype come from the call target and the output."""
    text = """HloModule m
ENTRY %main (p0: f16[64,56,56,128], p1: f16[3,3,128,128], p2: f16[64,64]) -> f16[64,56,56,128] {
  %p0 = f16[64,56,56,128]{3,2,1,0} parameter(0)
  %p1 = f16[3,3,128,128]{3,2,1,0} parameter(1)
  %p2 = f16[64,64]{1,0} parameter(2)
  %c = (f16[64,56,56,128], u8[99999999]) custom-call(%p0,%p1), custom_call_target="__cudnn$convForward"
  %g = (f32[64,64], s8[4194304]) custom-call(%p2, %p2), custom_call_target="__cublas$gemm"
  ROOT %out = f16[64,56,56,128] get-tuple-element(%c), index=0
}
"""  # noqa: E501
    audited = audit_text(text, (1,), ("d",))
    assert (audited.compute_kernel, audited.compute_dtype) == ("conv", "float16")
    # The matmul alone: its float32 output, not its int8 workspace, sets the dtype.
    gemm_only = text.replace("__cudnn$convForward", "something-else")
    assert (audit_text(gemm_only, (1,), ("d",)).compute_kernel,
            audit_text(gemm_only, (1,), ("d",)).compute_dtype) == ("matmul", "float32")


def test_price_uses_cost_model_functions():
    link_x, link_y = Link(1e-5, 2e-9), Link(3e-6, 5e-10)

    class TwoLinks(ClusterSpec):  # a cluster whose mesh axes have different links
        def mesh_axis_links(self, mesh_shape):
            return (link_x, link_y)

    base = ClusterSpec.preset("8xCPU")
    cluster = TwoLinks(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})

    def f(a):
        a = jax.lax.psum(a, "x")
        a = jax.lax.all_gather(a, "y", axis=1, tiled=True)
        a = jax.lax.all_to_all(a, "y", 1, 1, tiled=True)
        a = jax.lax.ppermute(a, "x", [(0, 1), (1, 0)])
        return jax.lax.psum(a, ("x", "y"))[:, :L]

    audited, _ = shard_map_audit(f, (2, 4), ("x", "y"))
    price = audited.price(cluster)
    slowest = Link(1e-5, 2e-9)
    expected = [
        collectives.all_reduce_s(LOCAL, 2, link_x),
        collectives.all_gather_s(4 * LOCAL, 4, link_y),
        collectives.all_to_all_s(4 * 4 * LOCAL, 4, link_y),
        collectives.send_recv_s(4 * LOCAL, 2, link_x),
        collectives.all_reduce_s(4 * LOCAL, 8, slowest),
    ]
    assert [c["seconds"] for c in price["collectives"]] == pytest.approx(expected)
    assert price["communication_s"] == pytest.approx(sum(expected))
    assert price["compute_s"] == pytest.approx(compute_time_s(
        audited.flops, audited.bytes_accessed, "float32", cluster))
    assert price["total_s"] == pytest.approx(price["communication_s"] + price["compute_s"])
    assert price["by_kind"]["all-reduce"] == pytest.approx(expected[0] + expected[4])
    # JSON and the table.
    data = json.loads(json.dumps(audited.to_json()))
    assert [c["kind"] for c in data["collectives"]] == [
        "all-reduce", "all-gather", "all-to-all", "collective-permute", "all-reduce"]
    assert data["memory"]["total_bytes"] == audited.memory.total_bytes
    table = audited.summary(cluster)
    assert "collective-permute" in table and "predicted" in table


def test_price_on_profiled_style_cluster_links_by_mesh():
    audited, _ = shard_map_audit(lambda a: jax.lax.psum(a, "y"), (2, 4), ("x", "y"))
    cluster = ClusterSpec.preset("2x4xCPU")  # axis x crosses hosts, y does not
    cluster = dataclasses.replace(cluster, intra_host=Link(1e-6, 1e-10),
                                  inter_host=Link(1e-3, 1e-8))
    assert audited.price(cluster)["communication_s"] == pytest.approx(
        collectives.all_reduce_s(LOCAL, 4, cluster.intra_host))


# --- HLO text forms (no devices) ----------------------------------------------------------------

HLO = """HloModule m, num_partitions=8
ENTRY %main (p: f32[8,16]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  %a = f32[8,16]{1,0} all-reduce(%p), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add
  %b = f32[8,16]{1,0} all-reduce(%a), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
  %c = f32[8,16]{1,0} all-reduce(%b), channel_id=3, replica_groups={}, to_apply=%add
  %ags = (f32[8,16]{1,0}, f32[16,16]{1,0}) all-gather-start(%c), channel_id=4, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
  %agd = f32[16,16]{1,0} all-gather-done(%ags)
  %d = bf16[8,16]{1,0} all-reduce(%c), channel_id=5, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, to_apply=%add
  %e = f32[8,16]{1,0} all-reduce(%c), channel_id=6, replica_groups=mesh['a'=8] {'a':(2)2}, to_apply=%add
  %cps = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%c), channel_id=7, source_target_pairs={{0,1},{1,0}}
  ROOT %cpd = f32[8,16]{1,0} collective-permute-done(%cps)
}
"""  # noqa: E501


def test_replica_group_forms_and_async_pairs():
    audited = audit_text(HLO, (2, 4), ("x", "y"))
    got = [(c.kind, c.is_async, c.axes, c.group_size, c.full_axes, c.groups)
           for c in audited.collectives]
    assert got == [
        ("all-reduce", False, ("y",), 4, True, ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("all-reduce", False, ("x",), 2, True, ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("all-reduce", False, ("x", "y"), 8, True, ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("all-gather", True, ("x",), 2, True, ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("all-reduce", False, ("y",), 4, True, ((0, 1, 2, 3), (4, 5, 6, 7))),
        # sub-axis (pre 2, size 2) of an 8-axis: digit 1 of 2x2x2, i.e. ids 2 apart
        ("all-reduce", False, ("y",), 2, False, ((0, 2), (1, 3), (4, 6), (5, 7))),
        ("collective-permute", True, ("y",), 4, True, ((0, 1), (1, 0))),
    ]
    ag = audited.collectives[3]
    assert (ag.operand_bytes, ag.result_bytes) == (512, 1024)  # from the -done's result
    assert audited.collectives[4].dtype == "bfloat16" and audited.collectives[4].result_bytes == 256
    cp = audited.collectives[6]
    assert (cp.operand_bytes, cp.result_bytes) == (512, 512)


def test_device_ids_map_hlo_ids_to_mesh_positions():
    # Mesh positions (row-major) hold HLO ids 7..0: group {0,1,2,3} is mesh row 1.
    audited = audit_text(HLO, (2, 4), ("x", "y"), device_ids=list(range(7, -1, -1)))
    assert audited.collectives[0].axes == ("y",)
    with pytest.raises(ValueError, match="device_ids"):
        audit_text(HLO, (2, 4), ("x", "y"), device_ids=[0, 1])
    with pytest.raises(ValueError, match="not on the mesh"):
        audit_text(HLO, (2, 2), ("x", "y"))


def test_kinds_listed():
    assert set(hlo_audit.KINDS) == {"all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                                    "collective-permute"}
