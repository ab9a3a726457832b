"""PipeshardParallel across processes (autopar launch, CPU devices): stages on sub-meshes
aligned with the processes, every process running the driver loop, equal to the
single-device `jax.jit` step that averages over the same micro-batches (3 AdamW steps).

Each process passes every argument as a global array over all devices (the state
replicated, the batch split by rows: tests/multihost_scripts/train.py `shardings`).
Tolerances: tests/multihost.py TOL (AdamW, eps 1e-4: rtol 1e-3 / atol 1e-4).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time

import numpy as np
import pytest

from multihost import (
    SCRIPTS,
    TOL,
    assert_equals_reference,
    assert_one_plan_across,
    ranks_json,
    report,
    run_processes,
)

MICRO = 4
TIME_LIMIT = "2"  # per ILP, seconds


def _run(tmp_path, name: str, processes: int, devices: int, stages: int,
         micro: int | str = MICRO) -> list[dict]:
    run_processes(SCRIPTS / "train.py", name, tmp_path, "--methods", "pipeshard",
                  "--micro-batches", micro, "--stages", stages, "--time-limit", TIME_LIMIT,
                  processes=processes, devices_per_process=devices, timeout_s=240)
    infos = ranks_json(tmp_path, processes)
    assert_one_plan_across(infos, processes, devices)
    assert len(infos[0]["stage_processes"]) == stages
    return infos


@pytest.mark.parametrize("name", ["gpt", "convbn"])
def test_two_stages_one_per_process(name, tmp_path):
    infos = _run(tmp_path, name, processes=2, devices=4, stages=2)
    assert infos[0]["stage_processes"] == [[0], [1]]
    # each stage's parameters and optimizer state stay on its own process
    assert all(i["remote_state_leaves"] > 0 for i in infos)
    assert_equals_reference(name, tmp_path, micro=MICRO)


def test_four_stages_over_four_processes(tmp_path):
    infos = _run(tmp_path, "gpt", processes=4, devices=2, stages=4)
    # the planner's stages (here 1, 1, 4 and 2 devices: one stage spans two processes)
    # cover every process
    assert sorted({p for st in infos[0]["stage_processes"] for p in st}) == [0, 1, 2, 3]
    assert_equals_reference("gpt", tmp_path, micro=MICRO)


def test_auto_micro_batch_count_is_chosen_once(tmp_path):
    # num_micro_batches="auto": process 0 tries the counts and chooses; process 1 traces
    # at its choice and checks the plan, so both run one plan (two separate searches under
    # ILP time limits could choose differently).
    infos = _run(tmp_path, "gpt", processes=2, devices=4, stages=2, micro="auto")
    micro = infos[0]["num_micro_batches"]
    assert {i["num_micro_batches"] for i in infos} == {micro}
    assert all(i["micro_batch_tries"] >= 2 for i in infos)  # the tries came with the plan
    assert_equals_reference("gpt", tmp_path, micro=micro)


# ---- as a user writes it (tests/multihost_scripts/user_pipeline.py) ------------------------
# The state from `autopar.place` on `init_state()`'s ordinary arrays or from
# `Checkpoints.restore_into`, the batch built with `jax.make_array_from_process_local_data`
# in three shardings, the loss read with `float` on every process after the last step only
# (a loop that never waits on a step: what hung before every received array was waited
# for), `autopar.distributed.initialize` or `jax.distributed.initialize` called directly.

USER = SCRIPTS / "user_pipeline.py"


def _user_module():
    spec = importlib.util.spec_from_file_location("user_pipeline", USER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _user_reference(steps: int = 3) -> tuple[list[float], dict[str, np.ndarray]]:
    return _user_module().reference(steps)


@pytest.mark.parametrize("processes,devices,stages,batch,state,init", [
    (2, 4, 2, "split", "place", "autopar"),
    (2, 4, 2, "replicated", "restore", "jax"),
    (2, 4, 4, "rows", "place", "jax"),
    (4, 2, 4, "split", "restore", "autopar"),
    (4, 2, 2, "rows", "place", "autopar"),
])
def test_a_pipeline_as_a_user_writes_it(processes, devices, stages, batch, state, init,
                                        tmp_path):
    started = time.perf_counter()
    run_processes(USER, tmp_path, "--stages", stages, "--batch", batch, "--state", state,
                  "--init", init, processes=processes, devices_per_process=devices,
                  timeout_s=240)
    infos = ranks_json(tmp_path, processes)
    ref_losses, ref_params = _user_reference()
    assert all(i["stages"] == stages for i in infos)
    for info in infos:   # every process read the loss itself
        np.testing.assert_allclose(info["losses"], ref_losses, **TOL)
    result = np.load(tmp_path / "result.npz", allow_pickle=False)
    for name, ref in ref_params.items():
        np.testing.assert_allclose(result[name], ref, err_msg=name, **TOL)
    print(f"{processes}x{devices} {stages} stages, batch {batch}, state {state}, "
          f"init {init}: {time.perf_counter() - started:.1f} s")


def test_a_misordered_transfer_ends_every_process_with_a_named_error(tmp_path):
    # Rank 1 receives two arrays from rank 0 in the other order than rank 0 sends them.
    result = run_processes(USER, tmp_path, "--misorder-rank", "1", expect_ok=False,
                           grace_s=90.0, timeout_s=180,
                           env={**os.environ, "AUTOPAR_TRANSFER_TIMEOUT_S": "20"})
    first, other = result.ranks[1], result.ranks[0]
    assert result.failed_rank == 1, report(result)
    assert "TransferError" in first.output and "different orders" in first.output, \
        report(result, [1])
    assert not other.ok and not other.stopped_by_launcher, report(result)
    assert "another process died" in other.describe(), report(result, [0])
    took = max(r.exit_s for r in result.ranks)
    assert took < 60, report(result)
    print(f"mis-ordered transfer: every process ended after {took:.1f} s")


def test_a_rank_stopping_mid_step_ends_the_pipeline_with_a_named_error(tmp_path):
    # Rank 1 is SIGKILLed during step 1.  Rank 0 ends by itself with a named error: the
    # copy it waits for fails (TransferError, gloo's "connection closed"; then it may exit
    # in the same instant as rank 1, and the launcher names either first) or JAX's runtime
    # stops it on rank 1's missed heartbeats.
    result = run_processes(USER, tmp_path, "--stop-rank", "1", "--stop-step", "1",
                           expect_ok=False, grace_s=90.0, timeout_s=180)
    killed, other = result.ranks[1], result.ranks[0]
    assert result.returncode != 0 and "SIGKILL" in killed.describe(), report(result)
    assert not other.ok and not other.stopped_by_launcher, report(result)
    assert ("TransferError" in other.output or "another process died" in other.describe()), \
        report(result, [0])
    took = other.exit_s - killed.exit_s
    assert took < 60, report(result)
    print(f"rank 0 ended {took:.1f} s after rank 1 stopped: {other.describe()}")
