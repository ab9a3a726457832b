"""PipeshardParallel across processes (autopar launch, CPU devices): stages on sub-meshes
aligned with the processes, every process running the driver loop, equal to the
single-device `jax.jit` step that averages over the same micro-batches (3 AdamW steps).

Each process passes every argument as a global array over all devices (the state
replicated, the batch split by rows: tests/multihost_scripts/train.py `shardings`).
Tolerances: tests/multihost.py TOL (AdamW, eps 1e-4: rtol 1e-3 / atol 1e-4).
"""

from __future__ import annotations

import pytest

from multihost import (
    SCRIPTS,
    assert_equals_reference,
    assert_one_plan_across,
    ranks_json,
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
