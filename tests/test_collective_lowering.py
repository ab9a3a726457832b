"""Collectives priced as each backend runs them (issue 44 item 3).

XLA:CPU runs a reduce-scatter as an all-reduce of the whole input and a local slice
(`collectives.LOWERINGS`); GPU and TPU run it natively.  Checked here: the rule table and
the backend of every cluster kind; that the time model (strategies, the HLO audit, the
profiler's link fit) applies it on CPU clusters only, leaving GPU presets' numbers as the
native formulas give them; the HLO facts the table rests on; and, on a data-parallel MLP
(Alpa's `test_n_layer_mlp_data_parallel`: 6 Dense layers of 32, batch 256, Adam) over 4 CPU
devices priced communication-only, that the search no longer picks reduce-scatter +
all-gather pairs (one all-reduce on paper, an all-reduce *and* an all-gather compiled) and
that the planned ranking of layouts is the compiled programs' communication.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.cost_model import ClusterSpec, Link, collectives, devices, hlo_audit, profiler
from autopar.cost_model.cluster import backend_of
from autopar.graph import Graph
from autopar.passes import intra_op
from autopar.passes import strategies as st
from autopar.passes.sharding_spec import MeshContext

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send-recv")
GPU_PRESET = "8xA100-80GB"
# Communication only (Alpa's test clusters): α = 0, β = 1 s/byte, free compute, so a
# plan's communication seconds are its α-β bytes.
BYTES = Link(0.0, 1.0)
HUGE = 1e30


def _cpu_comm_only(num_devices: int = 4) -> ClusterSpec:
    base = ClusterSpec.from_devices(jax.devices()[:num_devices])
    return dataclasses.replace(base, name=f"{num_devices}xCPU-bytes", intra_host=BYTES,
                               inter_host=BYTES, peak_flops={"float32": HUGE},
                               memory_bandwidth_bytes_per_s=HUGE)


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("x",), axis_types=(AxisType.Auto,))


def _kinds(compiled, n: int = 4) -> list[str]:
    return [c.kind for c in hlo_audit.audit(compiled, (n,), ("x",)).collectives]


# ---- the rule table ---------------------------------------------------------------------


def test_rule_table_lowers_reduce_scatter_on_cpu_only():
    assert collectives.LOWERINGS["cpu"] == {"reduce-scatter": "all-reduce"}
    for backend in ("cpu", "gpu", "tpu"):
        for kind in KINDS:
            expect = "all-reduce" if (backend, kind) == ("cpu", "reduce-scatter") else kind
            assert collectives.lowered_kind(kind, backend) == expect


def test_every_cluster_kind_has_its_backend():
    assert backend_of("cpu") == "cpu"
    for name in devices.DEVICE_KINDS:
        assert backend_of(name) == "gpu", name
    assert backend_of("TPU v4") == "tpu"
    assert ClusterSpec.from_devices(jax.devices()).backend == "cpu"
    assert ClusterSpec.preset("8xCPU").backend == "cpu"
    assert ClusterSpec.preset("cpu-local").backend == "cpu"
    assert ClusterSpec.preset(GPU_PRESET).backend == "gpu"
    assert ClusterSpec.preset("2x8xH100-80GB").backend == "gpu"


def test_mesh_prices_reduce_scatter_as_the_backend_runs_it():
    """Same links, two kinds: the CPU mesh prices a reduce-scatter as the all-reduce of the
    same buffer; a GPU preset's mesh prices every kind with the native formula itself (its
    numbers are those before the rule table existed)."""
    gpu = ClusterSpec.preset(GPU_PRESET)
    cpu = dataclasses.replace(gpu, device_kind="cpu")
    on_gpu, on_cpu = MeshContext.build((4,), gpu), MeshContext.build((4,), cpu)
    axes = ("x",)
    for nbytes in (4096.0, 64 * 2**20):
        link = on_gpu.group_link(axes, nbytes)
        assert on_gpu.reduce_scatter_s(nbytes, axes) == collectives.reduce_scatter_s(
            nbytes, 4, link)
        assert on_gpu.all_reduce_s(nbytes, axes) == collectives.all_reduce_s(nbytes, 4, link)
        assert on_gpu.all_gather_s(nbytes, axes) == collectives.all_gather_s(
            nbytes, 4, on_gpu.group_link(axes))
        assert on_gpu.all_to_all_s(nbytes, axes) == collectives.all_to_all_s(
            nbytes, 4, on_gpu.link("x"))
        assert on_cpu.reduce_scatter_s(nbytes, axes) == on_cpu.all_reduce_s(nbytes, axes)
        assert on_cpu.reduce_scatter_s(nbytes, axes) > on_gpu.reduce_scatter_s(nbytes, axes)
        for kind in ("all_reduce_s", "all_gather_s", "all_to_all_s"):
            assert getattr(on_cpu, kind)(nbytes, axes) == getattr(on_gpu, kind)(nbytes, axes)


def test_dot_strategies_reduce_scatter_costs_the_all_reduce_on_cpu():
    """A matmul whose contracting dim is split: its reduce-scatter strategy costs what its
    all-reduce strategy costs on CPU, about half on a GPU preset."""
    gpu = ClusterSpec.preset(GPU_PRESET)
    cpu = dataclasses.replace(gpu, device_kind="cpu")
    graph = Graph.from_jaxpr(jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((64, 256)),
                                                                 jnp.ones((256, 128))))
    eqn = graph.eqns[0]
    ins = [graph.values[v] for v in eqn.inputs]
    out = graph.values[eqn.outputs[0]]
    info = st.EqnInfo(eqn, tuple(v.shape for v in ins), (out.shape,),
                      tuple(float(v.nbytes) for v in ins), (float(out.nbytes),),
                      (False, False), (False, False), None, eqn_out_dtype=out.dtype)
    for cluster, ratio in ((cpu, 1.0), (gpu, None)):
        split_k = [s for s in st.enumerate_dot(info, MeshContext.build((4,), cluster))
                   if s.name.startswith("dot k0@x ")]
        (ar,) = [s for s in split_k if s.name.endswith("allreduce")]
        (rs,) = [s for s in split_k if "reducescatter" in s.name]
        if ratio is not None:
            assert rs.comm_s == ar.comm_s
        else:
            assert rs.comm_s < 0.6 * ar.comm_s


# ---- the HLO evidence (jax 0.10.2, XLA:CPU) ---------------------------------------------


def test_xla_cpu_partitioner_emits_all_reduce_and_slice_for_a_reduce_scatter():
    """`collectives.LOWERINGS`' evidence: the partitioner's reduce-scatter (a matmul with k
    split over x and its result's rows over x) is an all-reduce of the whole (64, 128)
    result and a dynamic-slice; a shard_map psum_scatter stays a reduce-scatter (priced as
    an all-reduce all the same: it ran no faster); all-gather, all-to-all and permutes are
    native."""
    mesh = _mesh(4)
    rows, cols = NamedSharding(mesh, P("x", None)), NamedSharding(mesh, P(None, "x"))
    a, b = jnp.ones((64, 256)), jnp.ones((256, 128))
    dot = jax.jit(lambda a, b: a @ b, in_shardings=(cols, rows), out_shardings=rows)
    compiled = dot.lower(a, b).compile()
    found = hlo_audit.audit(compiled, (4,), ("x",)).collectives
    assert [(c.kind, c.operand_bytes) for c in found] == [("all-reduce", 64 * 128 * 4)]
    assert "dynamic-slice" in compiled.as_text()

    def shard_map(fn):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                  check_vma=False))
        return f.lower(jnp.ones((4, 1024))).compile()

    assert _kinds(shard_map(lambda v: jax.lax.psum_scatter(
        v, "x", scatter_dimension=1, tiled=True))) == ["reduce-scatter"]
    assert _kinds(shard_map(lambda v: jax.lax.all_gather(v, "x", axis=1, tiled=True))) == [
        "all-gather"]
    assert _kinds(shard_map(lambda v: jax.lax.all_to_all(v, "x", 1, 1, tiled=True))) == [
        "all-to-all"]
    moved = jax.jit(lambda a: a * 2, in_shardings=rows, out_shardings=cols)
    assert _kinds(moved.lower(a).compile()) == ["all-to-all"]
    gathered = jax.jit(lambda a: a * 2, in_shardings=rows,
                       out_shardings=NamedSharding(mesh, P()))
    assert _kinds(gathered.lower(a).compile()) == ["all-gather"]


def test_audit_prices_a_cpu_reduce_scatter_as_all_reduce():
    """A reduce-scatter left in CPU HLO (shard_map's psum_scatter) is priced as the
    all-reduce of its operand on a CPU cluster, natively on a GPU one."""
    mesh = _mesh(4)
    f = jax.jit(jax.shard_map(lambda v: jax.lax.psum_scatter(
        v, "x", scatter_dimension=1, tiled=True), mesh=mesh, in_specs=P("x"),
        out_specs=P("x"), check_vma=False))
    audited = hlo_audit.audit(f.lower(jnp.ones((4, 1024))).compile(), (4,), ("x",))
    cpu = _cpu_comm_only()
    gpu = dataclasses.replace(cpu, device_kind="A100-80GB")
    nbytes = 1024 * 4  # the operand: each device's whole (1, 1024) row
    assert audited.price(cpu)["communication_s"] == collectives.all_reduce_s(nbytes, 4, BYTES)
    assert audited.price(gpu)["communication_s"] == collectives.reduce_scatter_s(
        nbytes, 4, BYTES)


# ---- the profiler -----------------------------------------------------------------------


def _samples(kind_seconds, link: Link, n: int = 4) -> list[dict]:
    return [{"collective": kind, "mesh_shape": [n], "axis": 0, "group_size": n,
             "crosses_hosts": False, "nbytes": s, "seconds": seconds(s, n, link)}
            for kind, seconds in kind_seconds for s in (2.0**10, 2.0**16, 2.0**22)]


def test_profiler_fits_the_link_the_time_model_prices_with():
    """The cluster's link is fitted with each sample at the factor of the kind the time
    model prices it as: on CPU, reduce-scatters that take an all-reduce's time give back
    the all-reduce's link (at the native factor they would read as a link twice as slow,
    and the planner, pricing them as all-reduces, would count that twice); on a GPU the
    native reduce-scatter time gives back the same link."""
    link = Link(2e-4, 1e-9)
    ar = ("all-reduce", collectives.all_reduce_s)
    cpu = ClusterSpec.from_devices(jax.devices()[:4])
    gpu = dataclasses.replace(cpu, device_kind="A100-80GB")
    for base, rs in ((cpu, collectives.all_reduce_s), (gpu, collectives.reduce_scatter_s)):
        samples = _samples([ar, ("reduce-scatter", rs), ("all-gather", collectives.all_gather_s)],
                           link)
        _, fitted = profiler._fit_cluster(base, samples, [])
        assert fitted.intra_host.alpha_s == pytest.approx(link.alpha_s, rel=1e-6)
        assert fitted.intra_host.beta_s_per_byte == pytest.approx(link.beta_s_per_byte,
                                                                   rel=1e-6)
    assert profiler.factor("reduce-scatter", 4, "cpu") == profiler.factor("all-reduce", 4)
    assert profiler.factor("reduce-scatter", 4, "gpu") == profiler.factor("reduce-scatter", 4)
    assert profiler.factor("collective-permute", 4, "cpu") == 1.0


# ---- plans on a data-parallel MLP (Alpa's) ------------------------------------------------


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(5):
            x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(32)(x)


@pytest.fixture(scope="module")
def alpa_mlp():
    """(step, state, batch): Alpa's data-parallel MLP case, MSE loss, Adam."""
    model, tx = _MLP(), optax.adam(1e-2)
    x, y = jnp.ones((256, 32)), jnp.ones((256, 32))
    params = model.init(jax.random.PRNGKey(0), x)

    def step(state, batch):
        def loss_fn(p):
            return jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2)

        loss, grads = autopar.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    return step, {"params": params, "opt": tx.init(params)}, {"x": x, "y": y}


def _planned_and_compiled(alpa_mlp, cluster: ClusterSpec):
    """(plan, compiled audit, the plan's layout priced under the CPU and the GPU-kind
    clusters by `intra_op.price_specs`) of ShardParallel on mesh (4,) planned for
    `cluster` and compiled for 4 CPU devices."""
    step, state, batch = alpa_mlp
    method = autopar.ShardParallel(mesh_shape=(4,), time_limit_s=10.0)
    par = autopar.parallelize(step, method=method, devices=jax.devices()[:4],
                              cluster=cluster, donate_argnums=())
    plan = par.get_plan(state, batch)
    audited = hlo_audit.audit(par.lower(state, batch).compile(), plan.mesh_shape,
                              plan.mesh_axes, plan.device_ids)
    program = par.trace(state, batch).program
    graph = program.graph
    cpu = _cpu_comm_only()
    meshes = [MeshContext.build(plan.mesh_shape, c)
              for c in (cluster, cpu, dataclasses.replace(cpu, device_kind="A100-80GB"))]
    specs = dict(zip(graph.invars, plan.in_specs)) | dict(plan.value_specs)
    forced = {graph.invars[p]: s for p, s in
              method.forced_specs(program.in_shapes, program.roles, meshes[0]).items()}
    ties = [(o, graph.invars[i]) for o, i in program.ties]
    _, on_cpu, on_gpu = intra_op.price_specs(graph, specs, meshes, forced=forced, ties=ties,
                                             batch_size=program.batch_size, time_limit_s=10.0)
    return plan, audited, on_cpu, on_gpu


def test_data_parallel_mlp_all_reduces_on_cpu(alpa_mlp):
    """On the communication-only CPU cluster the plan all-reduces the gradients, nothing
    else (priced natively, the search took reduce-scatter + all-gather pairs for two
    kernels, equal on paper; compiled, each is an all-reduce and an all-gather: 1.16x the
    step's communication), and its predicted communication is the compiled program's."""
    step, state, _ = alpa_mlp
    cpu = _cpu_comm_only()
    plan, audited, on_cpu, _ = _planned_and_compiled(alpa_mlp, cpu)
    kinds = {c.kind for c in audited.collectives}
    assert kinds == {"all-reduce"}, audited.summary()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state["params"]))
    assert audited.bytes_by_kind()["all-reduce"] >= param_bytes
    compiled_s = audited.price(cpu)["communication_s"]
    assert plan.predicted.comm_s == pytest.approx(compiled_s, rel=1e-9)
    assert on_cpu.comm_s == pytest.approx(compiled_s, rel=1e-9)


def test_planned_ranking_matches_the_compiled_programs(alpa_mlp):
    """Two layouts of the MLP: the CPU cluster's plan, and the plan of the same cluster
    named a GPU (native reduce-scatters: a tie broken towards reduce-scatter + all-gather
    pairs).  Both compiled for the CPU devices: priced by the CPU time model, each layout's
    communication is its compiled program's, so the planned ranking is the compiled one;
    the native model ranks them equal, though one compiles to more bytes."""
    cpu = _cpu_comm_only()
    gpu_named = dataclasses.replace(cpu, device_kind="A100-80GB")
    plans = {name: _planned_and_compiled(alpa_mlp, c)
             for name, c in (("cpu", cpu), ("gpu", gpu_named))}
    compiled = {name: audited.price(cpu)["communication_s"]
                for name, (_, audited, _, _) in plans.items()}
    planned = {name: on_cpu.comm_s for name, (_, _, on_cpu, _) in plans.items()}
    for name in plans:
        assert planned[name] == pytest.approx(compiled[name], rel=1e-9), name
    assert compiled["cpu"] <= compiled["gpu"]
    gpu_kinds = [c.kind for c in plans["gpu"][1].collectives]
    if "all-gather" in gpu_kinds:  # the pair was taken: the CPU model tells it apart
        assert planned["cpu"] < planned["gpu"] and compiled["cpu"] < compiled["gpu"]
        native = {name: on_gpu.comm_s for name, (_, _, _, on_gpu) in plans.items()}
        assert native["gpu"] == pytest.approx(native["cpu"], rel=1e-9)
    assert math.isclose(plans["gpu"][0].predicted.comm_s, plans["gpu"][3].comm_s,
                        rel_tol=1e-9)
