"""Several processes on jax.distributed, started by `autopar launch` (2 processes x 4 CPU
devices, and 4 x 2): single-mesh plans on a mesh spanning every process equal the
single-device `jax.jit` step; one plan everywhere; a dead or missing process stops the
others with a clear error in bounded time; the launcher itself.

Every run has a hard wall-clock timeout (the launcher kills all its processes when it
strikes).  Tolerances (tests/multihost.py): AdamW (eps 1e-4) at rtol 1e-3 / atol 1e-4, as
in test_equivalence.py: reduction order differs between the programs.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from autopar.launch import launch

from multihost import (
    ROOT,
    SCRIPTS,
    assert_equals_reference,
    assert_one_plan_across,
    ranks_json,
    report,
    run_processes,
)

# The GPT's ILPs get 2 s per mesh shape (the same plan as the default limit, 10x sooner).
TIME_LIMIT = "2"


@pytest.mark.parametrize("name", ["gpt", "convbn"])
def test_shard_parallel_on_two_processes(name, tmp_path):
    run_processes(SCRIPTS / "train.py", name, tmp_path, "--time-limit", TIME_LIMIT)
    assert_one_plan_across(ranks_json(tmp_path, 2), 2, 4)
    assert_equals_reference(name, tmp_path)


def test_shard_parallel_on_four_processes_of_two_devices(tmp_path):
    run_processes(SCRIPTS / "train.py", "gpt", tmp_path, "--time-limit", TIME_LIMIT,
                  processes=4, devices_per_process=2)
    assert_one_plan_across(ranks_json(tmp_path, 4), 4, 2)
    assert_equals_reference("gpt", tmp_path)


def test_one_plan_when_the_searches_would_differ(tmp_path):
    # Rank 0 asks for ZeRO-3, rank 1 for ShardParallel, both with a 0.1 s ILP limit: two
    # independent searches could not agree; every process runs process 0's plan (ZeRO-3:
    # parameters and optimizer state split over the devices of both processes).
    run_processes(SCRIPTS / "train.py", "mlp", tmp_path, "--methods", "zero3,shard",
                  "--time-limit", "0.1")
    infos = ranks_json(tmp_path, 2)
    assert [i["method"] for i in infos] == ["zero3", "zero3"]
    assert all(i["split_state_leaves"] > 0 for i in infos)  # created and kept sharded
    assert_one_plan_across(infos, 2, 4)
    assert_equals_reference("mlp", tmp_path)


def test_processes_tracing_different_programs_stop_before_the_first_step(tmp_path):
    # Rank 1 passes its local rows as if they were the global batch (a common mistake):
    # its trace differs from process 0's, and both stop with the reason.
    result = run_processes(SCRIPTS / "train.py", "mlp", tmp_path, "--wrong-batch-rank", "1",
                           expect_ok=False, timeout_s=180)
    assert result.returncode != 0, report(result)
    assert all(not r.ok and not r.stopped_by_launcher for r in result.ranks), report(result)
    assert "process 1 traced a different program than process 0" in result.output(1), \
        report(result, [1])
    assert "do not run one plan" in result.output(0), report(result, [0])
    assert not (tmp_path / "rank0.json").exists()


def test_a_killed_process_stops_the_others(tmp_path):
    # Rank 1 dies (SIGKILL) while step 1 is in flight; rank 0 must stop by itself (the
    # launcher's grace period is longer than the bound) with a clear error, in < 60 s.
    result = run_processes(SCRIPTS / "train.py", "mlp", tmp_path, "--methods", "dp",
                           "--kill-rank", "1", "--kill-step", "1", expect_ok=False,
                           grace_s=90.0, timeout_s=240)
    first, other = result.ranks[1], result.ranks[0]
    assert result.failed_rank == 1 and result.returncode == 128 + 9, report(result)
    assert "killing myself while step 1 is in flight" in first.output
    assert not other.ok and not other.stopped_by_launcher, report(result)
    took = other.exit_s - first.exit_s
    assert took < 60, f"rank 0 stopped {took:.1f} s after rank 1 died\n{report(result)}"
    assert "another process died" in other.describe(), report(result, [0])
    assert "rank 1 failed first" in result.summary()
    print(f"rank 0 stopped {took:.1f} s after rank 1 was killed")


def test_an_exception_in_one_process_stops_the_others():
    # Without autopar's exit at once, rank 1 would wait at JAX's shutdown barrier for rank 0,
    # stuck in a sum that needs rank 1: both would hang until the shutdown timeout.
    result = run_processes(SCRIPTS / "join.py", "raise", 1, devices_per_process=2,
                           expect_ok=False, grace_s=90.0, timeout_s=180)
    assert result.failed_rank == 1 and result.returncode == 1, report(result)
    assert "RuntimeError: rank 1: a bug in the user's script" in result.output(1)
    other = result.ranks[0]
    assert not other.ok and not other.stopped_by_launcher, report(result)
    assert other.exit_s - result.ranks[1].exit_s < 30, report(result)
    assert "another process died" in other.describe(), report(result, [0])


def test_the_plan_exchange_waits_while_process_0_reports_and_not_longer(tmp_path):
    # The bound is 3 missed heartbeats (3 x 2 s): process 0's first search takes 10 s with
    # its heartbeat going (every process gets the plan); in the second its heartbeat stops
    # after 2 beats, and process 1 gives up ~6 s later, naming process 0 and what it said.
    result = run_processes(SCRIPTS / "plan_wait.py", "heartbeat", 10, expect_ok=False,
                           plan_missed_heartbeats=3, grace_s=3.0, timeout_s=180)
    for k in range(2):
        took = re.search(rf"rank {k}: plan 1 after ([\d.]+) s", result.output(k))
        assert took and float(took.group(1)) > 10, report(result)
    out = result.output(1)
    assert result.failed_rank == 1 and not result.ranks[1].stopped_by_launcher, report(result)
    assert re.search(r"PlanError: process 1 waited [\d.]+ s for process 0's plan .*and gave "
                     r"up: process 0 published no heartbeat for [\d.]+ s \(the bound: 3 x 2 s",
                     out), report(result, [1])
    assert re.search(r"Its last heartbeat, [\d.]+ s into the exchange, said: searching the plan, "
                     r"in autopar\.", out), report(result, [1])
    ended = float(re.search(r"rank 1: plan 2 ended after ([\d.]+) s", out).group(1))
    assert 6 < ended < 30, report(result, [1])


def test_process_0s_search_error_reaches_every_process(tmp_path):
    # Process 0's search raises (memory_budget_bytes=1); it waits for process 1 to read the
    # error before it exits with its key-value store.  Before that, every process builds a
    # batch on process 0's devices only (process 1 passes process_rows' none).
    result = run_processes(SCRIPTS / "plan_wait.py", "search-error", expect_ok=False,
                           timeout_s=180)
    assert all(not r.ok and not r.stopped_by_launcher for r in result.ranks), report(result)
    assert "MemoryBudgetError: no plan fits 1 B per device" in result.output(0)
    assert ("PlanError: process 0 could not plan this step: MemoryBudgetError: no plan fits 1 B "
            "per device") in result.output(1), report(result, [1])
    assert "lost the coordinator" not in result.ranks[1].describe(), report(result)
    for k, (rows, shards) in enumerate([("0:16", 4), ("0:0", 0)]):
        assert (f"rank {k}: rows {rows} of a batch on process 0's devices, {shards} shards "
                f"here, gathered equal: True") in result.output(k), report(result, [k])


def test_a_process_that_never_arrives_stops_the_others():
    result = run_processes(SCRIPTS / "join.py", "absent", 1, expect_ok=False,
                           initialization_timeout_s=5, timeout_s=120)
    assert result.ranks[1].ok and "not joining" in result.output(1)
    assert result.failed_rank == 0 and not result.ranks[0].stopped_by_launcher, report(result)
    assert "gave up waiting for every process to join" in result.ranks[0].describe()
    assert result.ranks[0].exit_s < 60


# ---- the launcher on its own (no JAX) --------------------------------------------------------

def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


RANK = "import os, sys, time; rank = int(os.environ['AUTOPAR_PROCESS_ID'])\n"


def test_launch_prefixes_output_and_names_the_failed_rank():
    lines = []

    class Sink:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    code = RANK + ("print('hello from', rank, os.environ['AUTOPAR_NUM_PROCESSES'])\n"
                   "sys.exit(3 if rank == 1 else 0)")
    result = launch(_python(code), 3, timeout_s=60, echo=Sink())
    assert result.returncode == 3 and result.failed_rank == 1
    assert [r.returncode for r in result.ranks] == [0, 3, 0]
    assert sorted(lines) == [f"[rank {k}] hello from {k} 3\n" for k in range(3)]
    assert "rank 1 failed first" in result.summary()
    assert "rank 1: exit status 3" in result.summary()


def test_launch_gives_each_process_its_own_ports_and_devices():
    code = RANK + ("print(os.environ['AUTOPAR_COORDINATOR_ADDRESS'], "
                   "os.environ['AUTOPAR_TRANSFER_ADDRESS'], os.environ['JAX_PLATFORMS'], "
                   "os.environ['AUTOPAR_DEVICES_PER_PROCESS'])")
    result = launch(_python(code), 3, devices_per_process=2, timeout_s=60)
    rows = [r.output.split() for r in result.ranks]
    assert result.returncode == 0
    assert len({row[0] for row in rows}) == 1
    assert len({row[1] for row in rows}) == 3 and rows[0][0] not in {row[1] for row in rows}
    assert {(row[2], row[3]) for row in rows} == {("cpu", "2")}


def test_launch_stops_everything_at_the_timeout():
    result = launch(_python("import time; time.sleep(600)"), 2, timeout_s=2, grace_s=1)
    assert result.timed_out and result.returncode == 124
    assert all(r.stopped_by_launcher for r in result.ranks)
    assert result.wall_s < 30
    assert "timed out after" in result.summary()


def test_launch_stops_the_others_after_the_grace_period():
    result = launch(_python(RANK + "sys.exit(5) if rank == 0 else time.sleep(600)"), 2,
                    timeout_s=120, grace_s=1)
    assert result.returncode == 5 and result.failed_rank == 0
    assert result.ranks[1].stopped_by_launcher and not result.ranks[0].stopped_by_launcher
    assert result.wall_s < 60


def test_cli_launch(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(RANK + "print('hi', rank, sys.argv[1:])\nsys.exit(2 if rank == 1 else 0)\n")
    run = subprocess.run([sys.executable, "-m", "autopar", "launch", "-n", "2", "--timeout",
                          "60", str(script), "--flag", "x"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    assert "[rank 0] hi 0 ['--flag', 'x']" in run.stdout
    assert "rank 1 failed first" in run.stderr


def test_readme_multiple_hosts_scripts_run(tmp_path):
    # The section's two code blocks, the second (a pipeline) continuing the first.
    text = (ROOT / "README.md").read_text()
    section = re.search(r"## Multiple hosts\n(.*?)\n## ", text, re.S).group(1)
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "the Multiple hosts section's python blocks changed"
    script = tmp_path / "train.py"
    script.write_text("\n".join(blocks))
    result = run_processes(script, timeout_s=240)
    assert re.search(r"^loss \d", result.output(0), re.M), report(result, [0])
    for rank in (0, 1):   # the pipeline's loss read with float() on every process
        assert re.search(r"^pipeline loss \d", result.output(rank), re.M), \
            report(result, [rank])


def test_demo_on_two_processes(capsys):
    from autopar import demo

    status = demo.run_processes(2, 2, quiet=True, timeout_s=300, time_limit_s=1.0)
    out = capsys.readouterr()
    assert status == 0, out.out[-3000:] + out.err[-3000:]
    assert "[rank 0] losses match" in out.out
    assert "2 processes x 4 emulated CPU devices" in out.out


def test_launch_help():
    run = subprocess.run([sys.executable, "-m", "autopar", "launch", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "--devices-per-process" in run.stdout, run.stderr


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def _start_waiting_processes(tmp_path) -> tuple[subprocess.Popen, list[int]]:
    """`autopar launch` of 2 processes that join and wait; returns it and their pids."""
    launcher = subprocess.Popen([sys.executable, "-m", "autopar", "launch", "-n", "2",
                                 "--devices-per-process", "1", "--timeout", "120",
                                 str(SCRIPTS / "join.py"), "wait", str(tmp_path)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    if len(pids) != 2:
        launcher.kill()
        launcher.wait(timeout=30)
        pytest.fail(f"the processes did not start: {pids}")
    return launcher, pids


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(_running(p) for p in pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_processes_die_with_a_killed_launcher(tmp_path):
    launcher, pids = _start_waiting_processes(tmp_path)
    launcher.kill()  # SIGKILL: the launcher cannot clean up
    launcher.wait(timeout=30)
    assert _wait_gone(pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_interrupted_launcher_stops_its_processes(tmp_path):
    launcher, pids = _start_waiting_processes(tmp_path)
    launcher.send_signal(signal.SIGINT)  # Ctrl-C
    assert launcher.wait(timeout=60) == 130
    assert _wait_gone(pids, timeout_s=5.0)


# ---- autopar.distributed in one process --------------------------------------------------------

def test_launch_env_round_trips_through_the_environment():
    from autopar.distributed import LaunchEnv

    env = LaunchEnv("127.0.0.1:1234", 4, 2, 2, "127.0.0.1:5678", 10, 5, 20, 99)
    assert LaunchEnv.from_env(env.to_env()) == env
    beats = LaunchEnv("127.0.0.1:1234", 4, 2, plan_missed_heartbeats=3)
    assert beats.to_env()["AUTOPAR_PLAN_MISSED_HEARTBEATS"] == "3"
    assert LaunchEnv.from_env(beats.to_env()) == beats
    assert LaunchEnv.from_env({}) is None
    with pytest.raises(ValueError, match="AUTOPAR_PROCESS_ID"):
        LaunchEnv.from_env({"AUTOPAR_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match="AUTOPAR_NUM_PROCESSES='two'"):
        LaunchEnv.from_env({**env.to_env(), "AUTOPAR_NUM_PROCESSES": "two"})


def test_global_batch_and_gather_in_one_process():
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import autopar.distributed as dist

    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    assert dist.process_rows(sharding, (16, 3)) == slice(0, 16)  # one process holds all rows
    x = np.arange(48, dtype=np.float32).reshape(16, 3)
    batch = dist.global_batch({"x": x}, {"x": sharding}, 16)
    assert batch["x"].sharding == sharding
    np.testing.assert_array_equal(dist.gather(batch)["x"], x)
    with pytest.raises(ValueError, match=r"passed 8 rows of batch\['x'\].*rows 0:16"):
        dist.global_batch({"x": x[:8]}, sharding, 16)


def test_input_shardings_give_the_plan_layouts_and_pipeline_inputs():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import autopar
    import autopar.distributed as dist

    def step(w, batch):
        loss, g = autopar.value_and_grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w)
        return w - 0.1 * g, loss

    w = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    batch = {"x": jax.ShapeDtypeStruct((16, 8), jnp.float32)}
    par = autopar.parallelize(step, method=autopar.DataParallel())
    w_sharding, batch_sharding = dist.input_shardings(par, w, batch)
    plan = par.get_plan(w, batch)
    assert w_sharding.spec == autopar.constraints.to_pspec(plan.in_specs[0])
    assert batch_sharding["x"].spec[0] is not None  # data parallel: the batch is split
    pipe = autopar.parallelize(step, method=autopar.PipeshardParallel(num_micro_batches=2,
                                                                      num_stages=2))
    # A pipeline plan: the state replicated and the batch split by rows over all devices
    # (each stage's part is copied onto its sub-mesh by the first step), and a step called
    # on arguments so laid out equals the single-device step.
    w_sharding, batch_sharding = dist.input_shardings(pipe, w, batch)
    assert len(w_sharding.device_set) == 8 and w_sharding.is_fully_replicated
    assert batch_sharding["x"].spec == jax.sharding.PartitionSpec("all")
    w0 = jax.device_put(jnp.ones((8, 4), jnp.float32), w_sharding)
    x = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) / 100
    got = pipe(w0, {"x": jax.device_put(x, batch_sharding["x"])})
    want = jax.jit(step)(jnp.ones((8, 4), jnp.float32), {"x": x})
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    odd = {"x": jax.ShapeDtypeStruct((12, 8), jnp.float32)}   # 12 rows on 8 devices
    assert dist.input_shardings(pipe, w, odd)[1]["x"].is_fully_replicated


def test_plan_wait_settings_from_the_environment(monkeypatch):
    from autopar import kv_store

    monkeypatch.delenv("AUTOPAR_PLAN_TIMEOUT_S", raising=False)
    monkeypatch.delenv("AUTOPAR_PLAN_MISSED_HEARTBEATS", raising=False)
    assert kv_store.fixed_timeout_s() is None
    assert kv_store.missed_heartbeats() * kv_store.PLAN_HEARTBEAT_S == 60
    monkeypatch.setenv("AUTOPAR_PLAN_TIMEOUT_S", "7200")
    monkeypatch.setenv("AUTOPAR_PLAN_MISSED_HEARTBEATS", "5")
    assert kv_store.fixed_timeout_s() == 7200 and kv_store.missed_heartbeats() == 5
    monkeypatch.setenv("AUTOPAR_PLAN_MISSED_HEARTBEATS", "0")
    with pytest.raises(ValueError, match="AUTOPAR_PLAN_MISSED_HEARTBEATS='0'"):
        kv_store.missed_heartbeats()


def test_process_rows_of_a_sharding_on_other_processes():
    import autopar.distributed as dist

    class Elsewhere:   # a sharding none of whose devices is on this process
        def addressable_devices_indices_map(self, shape):
            return {}

    assert dist.process_rows(Elsewhere(), (16, 3)) == slice(0, 0)


# ---- bounded waits on the solver pool's answers ------------------------------------------------

class _StuckPool:
    """A solver pool that never answers (`SolvePool`'s interface)."""

    def __init__(self, workers=None):
        self.futures = []

    def submit(self, problem, *, time_limit_s, backend, threads=1):
        import concurrent.futures

        self.futures.append(concurrent.futures.Future())
        return self.futures[-1]

    def close(self, cancel=False):
        for f in self.futures:
            f.cancel()


def test_waits_on_solver_answers_follow_the_pools_progress():
    import concurrent.futures
    import threading

    from autopar.planner import SolveTimeoutError, WatchedSubmit

    futures = []

    def submit(problem, *, time_limit_s, backend):
        futures.append(concurrent.futures.Future())
        return futures[-1]

    class Problem:
        name, num_nodes = "stuck", 12

    watch = WatchedSubmit(submit, bound_s=lambda limit: 1.0 + limit)
    stuck = watch(Problem(), time_limit_s=0.5, backend="auto")
    other = watch(Problem(), time_limit_s=0.5, backend="auto")
    threading.Timer(1.0, lambda: futures[1].set_result("answer")).start()
    t0 = time.monotonic()
    with pytest.raises(SolveTimeoutError, match=r"no answer to sharding problem 'stuck' of 12 "
                       r"nodes \(solver time limit 0.5 s\) after \d+ s, and no other .* "
                       r"in the last 2 s"):
        stuck.result()
    took = time.monotonic() - t0
    assert other.result() == "answer"
    assert took >= 2.4, took   # the other answer (at 1 s) restarted the 1.5 s bound
    assert took < 20, took
    done = watch(Problem(), time_limit_s=0.5, backend="auto")
    futures[-1].set_exception(ValueError("infeasible"))
    with pytest.raises(ValueError, match="infeasible"):
        done.result()


@pytest.mark.parametrize("method", ["shard", "pipeshard"])
def test_a_stuck_solver_pool_ends_the_search_with_a_named_error(method, monkeypatch):
    import jax
    import jax.numpy as jnp

    import autopar
    from autopar import planner
    from autopar.pipeline_search import layer_solutions

    monkeypatch.setattr(planner, "answer_wait_s", lambda limit: 0.5)
    monkeypatch.setattr(planner, "SolvePool", _StuckPool)
    monkeypatch.setattr(layer_solutions, "SolvePool", _StuckPool)

    def step(w, batch):
        loss, g = autopar.value_and_grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w)
        return w - 0.1 * g, loss

    chosen = (autopar.ShardParallel(time_limit_s=1) if method == "shard" else
              autopar.PipeshardParallel(num_micro_batches=2, num_stages=2, time_limit_s=1))
    par = autopar.parallelize(step, method=chosen)
    w = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    batch = {"x": jax.ShapeDtypeStruct((16, 8), jnp.float32)}
    what = ("the mesh ILP on logical mesh" if method == "shard" else
            r"the layer ILP \(\d+ equations\) on sub-mesh")
    with pytest.raises(planner.SolveTimeoutError, match=what + r".*the solver pool is stuck"):
        par.get_plan(w, batch)
