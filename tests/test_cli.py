"""The `autopar` command driven as a user would: subprocesses of `python -m autopar`.

plan → show → load-and-run on 8 CPU devices against plain jax.jit; user errors (invalid or
mismatched plan files, unknown names, bad sizes) exit 2 with one line and no traceback;
`autopar demo --steps 3` exits 0; `--help` works for every subcommand.  The planning runs
use a small MLP target and the toy GPT with a short per-ILP time limit to stay fast.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from autopar.cost_model import parse_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TARGET = textwrap.dedent('''
    """A small MLP step for the CLI tests: `mlp_target:make` returns (step, args)."""
    import jax
    import jax.numpy as jnp

    import autopar


    def loss_fn(params, batch):
        h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


    def step(params, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


    def real_args(batch=16):
        k = jax.random.split(jax.random.key(0), 5)
        params = {"w1": jax.random.normal(k[0], (32, 64)) * 0.1, "b1": jnp.zeros((64,)),
                  "w2": jax.random.normal(k[1], (64, 16)) * 0.1}
        data = {"x": jax.random.normal(k[2], (batch, 32)),
                "y": jax.random.normal(k[3], (batch, 16))}
        return params, data


    def make(batch=16):
        args = real_args(batch)
        return step, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
''')

RUN = textwrap.dedent('''
    import sys

    import jax
    import numpy as np

    import autopar
    import mlp_target

    params, data = mlp_target.real_args(int(sys.argv[2]))
    par = autopar.parallelize(mlp_target.step, plan=sys.argv[1])
    ref = jax.jit(mlp_target.step)
    p1, p2 = params, params
    for _ in range(3):
        p1, l1 = par(p1, data)
        p2, l2 = ref(p2, data)
        np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    print("EQUAL", float(l1))
''')


def autopar_cli(*args: str, cwd=None, timeout: float = 240, extra_path: str | None = None):
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=timeout)


def assert_user_error(proc, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error: "), proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("target")
    (d / "mlp_target.py").write_text(TARGET)
    (d / "run_plan.py").write_text(RUN)
    return d


@pytest.fixture(scope="module")
def mlp_plan(target):
    path = target / "plan.json"
    proc = autopar_cli("plan", "mlp_target:make", "--cluster", "cpu-local", "-o", str(path),
                       "--quiet", cwd=target, extra_path=str(target))
    assert proc.returncode == 0, proc.stderr
    assert "predicted step time" in proc.stdout and "search time" in proc.stdout
    return path


def test_parse_size():
    assert parse_size("40GiB") == 40 * 2**30
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1e9") == 1e9
    assert parse_size("16GB") == 16e9
    for bad in ("", "forty", "12XB", "-1GiB", "0"):
        with pytest.raises(ValueError, match="invalid size"):
            parse_size(bad)


def test_plan_show_and_run_round_trip(target, mlp_plan):
    proc = autopar_cli("show", str(mlp_plan), "--png", str(target / "bars.png"))
    assert proc.returncode == 0, proc.stderr
    assert "largest inputs" in proc.stdout and "arg0.w1 " in proc.stdout
    assert "no pipeline schedule" in proc.stdout
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=str(target))
    run = subprocess.run([sys.executable, str(target / "run_plan.py"), str(mlp_plan), "16"],
                         capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode == 0, run.stderr
    assert "EQUAL" in run.stdout


def test_mismatched_plan_names_both_fingerprints(target, mlp_plan):
    # The same program at another batch size is another program.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=str(target))
    run = subprocess.run([sys.executable, str(target / "run_plan.py"), str(mlp_plan), "32"],
                         capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode != 0 and "FingerprintError" in run.stderr
    saved = json.loads(mlp_plan.read_text())["fingerprint"]
    assert f"plan fingerprint {saved} does not match this program (" in run.stderr


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["in_specs"][0].__setitem__(0, ["z"]), "unknown mesh axis 'z'"),
    (lambda d: d.__setitem__("mesh_shape", [3]), "mesh_shape"),
    (lambda d: d.pop("in_specs"), "missing field 'in_specs'"),
])
def test_invalid_plan_files_are_user_errors(target, mlp_plan, edit, field):
    data = json.loads(mlp_plan.read_text())
    edit(data)
    bad = target / "bad.json"
    bad.write_text(json.dumps(data))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=str(target))
    if field.startswith("missing"):
        assert_user_error(autopar_cli("show", str(bad)), field)
        return
    run = subprocess.run([sys.executable, str(target / "run_plan.py"), str(bad), "16"],
                         capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode != 0 and "PlanError" in run.stderr and field in run.stderr


def test_user_errors_exit_2_without_traceback(tmp_path):
    (tmp_path / "junk.json").write_text("{not json")
    assert_user_error(autopar_cli("show", str(tmp_path / "junk.json")), "not a JSON plan")
    assert_user_error(autopar_cli("show", str(tmp_path / "none.json")), "does not exist")
    assert_user_error(autopar_cli("plan", "gpt-nope", "--cluster", "cpu-local"),
                      "unknown model 'gpt-nope'", "gpt-toy", "gpt-39b")
    assert_user_error(autopar_cli("plan", "gpt-toy", "--cluster", "9xTPU"),
                      "unknown cluster preset '9xTPU'", "8xA100-80GB")
    assert_user_error(autopar_cli("plan", "gpt-toy", "--cluster", "cpu-local",
                                  "--memory-budget", "lots"), "invalid size 'lots'")
    assert_user_error(autopar_cli("plan", "gpt-toy", "--cluster", "cpu-local",
                                  "--method", "3d", "--dp", "3", "--tp", "2", "--pp", "2"),
                      "dp x tp x pp = 12", "8 devices")
    assert_user_error(autopar_cli("plan", "gpt-toy", "--cluster", "cpu-local", "--batch", "6",
                                  "--micro-batches", "4"), "not divisible")
    assert_user_error(autopar_cli("plan", "gpt-toy", "--cluster", "cpu-local", "--set",
                                  "widht=3"), "no config field 'widht'", "hidden")
    assert_user_error(autopar_cli("plan", "gpt-toy", "--cluster", "cpu-local", "--set",
                                  "tied"), "expected FIELD=VALUE")


def test_memory_budget_impossible(target):
    proc = autopar_cli("plan", "mlp_target:make", "--cluster", "cpu-local", "--method", "dp",
                       "--memory-budget", "1KiB", "--quiet", cwd=target,
                       extra_path=str(target))
    assert_user_error(proc, "no plan fits 1.00 KiB per device")


def test_plan_gpt_toy_pipeline_on_two_hosts(tmp_path):
    out = tmp_path / "toy.json"
    # A fixed 3-D layout keeps the test short (the automatic stage search prices every
    # layer on every sub-mesh: ~70 s here for the toy GPT).
    proc = autopar_cli("plan", "gpt-toy", "--cluster", "2x8xA100-80GB", "--batch", "8",
                       "--micro-batches", "2", "--method", "3d", "--dp", "2", "--tp", "4",
                       "--time-limit", "5", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "method 3d" in proc.stdout and "2 pipeline stages" in proc.stdout
    assert "TFLOP/s per device" in proc.stdout and "search time" in proc.stdout
    shown = autopar_cli("show", str(out), "--png", str(tmp_path / "sched.png"))
    assert shown.returncode == 0, shown.stderr
    assert "stage 1 (mesh" in shown.stdout and "arg0.params.Embed_0" in shown.stdout
    assert (tmp_path / "sched.png").stat().st_size > 1000


def test_plan_gpt_toy_on_cpu_local(tmp_path):
    out = tmp_path / "toy.json"
    proc = autopar_cli("plan", "gpt-toy", "--cluster", "cpu-local", "--batch", "8",
                       "--time-limit", "5", "--set", "tied=false", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "method shard" in proc.stdout and "of 2.94 GiB" in proc.stdout
    assert "gpt-toy (batch 8, tied=False)" in proc.stdout
    assert json.loads(out.read_text())["solver"]["cli"]["model_flops"] > 0


def test_demo():
    proc = autopar_cli("demo", "--steps", "3", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "losses match" in proc.stdout


@pytest.mark.parametrize("command", [[], ["plan"], ["show"], ["profile"], ["demo"], ["bench"]])
def test_help(command):
    proc = autopar_cli(*command, "--help")
    assert proc.returncode == 0 and "usage: autopar" in proc.stdout, proc.stderr


def _pipeline_plan(**stage1):
    from autopar import Plan, PredictedCost, StagePlan

    st0 = StagePlan(layers=(0, 1), eqn_range=(0, 10), device_ids=(0, 1, 2, 3), mesh_shape=(4,),
                    mesh_axes=("x",), input_specs=((5, (("x",), ())),), predicted_s=1.0,
                    memory_bytes=1.0)
    st1 = StagePlan(**{**dict(layers=(2, 3), eqn_range=(10, 20), device_ids=(4, 5, 6, 7),
                              mesh_shape=(2, 2), mesh_axes=("x", "y"),
                              input_specs=((7, ((), ("y",))),), predicted_s=1.0,
                              memory_bytes=1.0), **stage1})
    return Plan(fingerprint="f", method="pipeshard", cluster="cpu-local", mesh_shape=(8,),
                mesh_axes=("x",), device_ids=tuple(range(8)), input_names=(), in_specs=(),
                out_specs=(), value_specs=(), predicted=PredictedCost(1, 1, 0, 1),
                stages=(st0, st1), num_micro_batches=2, schedule="1f1b")


@pytest.mark.parametrize("stage1, message", [
    ({}, None),
    ({"device_ids": (3, 4, 5, 6)}, "stages[1].device_ids: device 3 is also in stage 0"),
    ({"input_specs": ((7, ((), ("z",))),)}, "stages[1].input_specs[v7]: unknown mesh axis 'z'"),
    ({"input_specs": ((7, (("x",), ())),)}, "stages[1].input_specs[v7]: dim 0 of size 3"),
    ({"mesh_shape": (2, 4)}, "stages[1].mesh_shape (2, 4) needs 8 devices"),
    ({"state_specs": ((7, ((), ("y",))),)}, None),
    ({"state_specs": ((5, ((), ())),)}, "stages[1].state_specs[v5]: value 5 is not an input"),
    ({"state_specs": ((7, ((), ("x", "y"))),)}, "stages[1].state_specs[v7]: dim 1 of size 6"),
])
def test_verify_plan_checks_stages(stage1, message):
    from autopar.plan import PlanError, verify_plan

    plan = _pipeline_plan(**stage1)
    from autopar import Plan
    assert Plan.from_json(plan.to_json()) == plan   # state_specs round-trip too
    check = lambda: verify_plan(plan, [], [], {}, 8, stage_value_shapes={5: (8, 4), 7: (3, 6)})
    if message is None:
        check()
    else:
        with pytest.raises(PlanError, match=re.escape(message)):
            check()


def test_bench_needs_a_checkout_and_forwards_to_the_harness(tmp_path):
    # Outside a clone the harness does not exist: a one-line user error.
    assert_user_error(autopar_cli("bench", "gpt", "--cluster", "8x8xV100-16GB", cwd=tmp_path),
                      "source checkout")
    # Inside one, `autopar bench ...` is `python -m benchmarks ...` (its own error here).
    proc = autopar_cli("bench", "gpt", cwd=os.path.join(ROOT, "tests"))
    assert proc.returncode == 2 and "needs --cluster" in proc.stderr, proc.stderr
