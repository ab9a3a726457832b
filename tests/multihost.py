"""Multi-process tests: run a script on N local processes through `autopar launch`.

    result = run_processes(SCRIPTS / "train.py", "gpt", tmp_path, processes=2,
                           devices_per_process=4)
    result.output(1)          # everything rank 1 printed
    result.ranks[0].returncode

Every run is bounded by a hard wall-clock timeout (the launcher kills every process when it
strikes) and uses free ports, so tests can run side by side.  A run that does not exit 0
fails the test with the launcher's summary and the last lines of every rank, unless
`expect_ok=False` (then the caller inspects the `LaunchResult`).

`multihost_scripts/train.py` trains a test model (tests/models.py) for 3 AdamW steps and
writes what it ran; `assert_equals_reference` compares it with the single-device `jax.jit`
step (micro-batched like the plan when `micro` > 1), `assert_one_plan_across` checks that
every process ran the same plan on devices of every process.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from collections.abc import Sequence

import jax
import numpy as np
import pytest

from autopar.launch import LaunchResult, launch, python_command

import models
from helpers import micro_batch_value_and_grad, run_steps

SCRIPTS = pathlib.Path(__file__).parent / "multihost_scripts"
ROOT = pathlib.Path(__file__).parents[1]
TAIL_LINES = 30
STEPS = 3  # train.py's default
BATCH = 16  # every test case's batch
# AdamW with eps 1e-4, as in test_equivalence.py: reduction order differs between programs.
TOL = dict(rtol=1e-3, atol=1e-4)


def run_processes(script: str | os.PathLike, *args, processes: int = 2,
                  devices_per_process: int = 4, timeout_s: float = 300.0,
                  expect_ok: bool = True, **launch_options) -> LaunchResult:
    """Runs `python script *args` on `processes` local processes of `devices_per_process`
    emulated CPU devices each, with a hard `timeout_s`; `launch_options` go to
    `autopar.launch.launch` (e.g. `grace_s`, `heartbeat_timeout_s`)."""
    result = launch(python_command(str(script), [str(a) for a in args]), processes,
                    devices_per_process=devices_per_process, timeout_s=timeout_s, cwd=ROOT,
                    **launch_options)
    if expect_ok and result.returncode != 0:
        pytest.fail(report(result), pytrace=False)
    return result


def report(result: LaunchResult, ranks: Sequence[int] | None = None) -> str:
    """The launcher's summary and the last lines of each rank's output."""
    parts = [result.summary()]
    for r in result.ranks if ranks is None else [result.ranks[k] for k in ranks]:
        lines = [ln for ln in r.output.splitlines() if not ln.lstrip().startswith("@")]
        parts.append(f"--- rank {r.rank}, last {TAIL_LINES} lines:")
        parts.extend(lines[-TAIL_LINES:])
    return "\n".join(parts)


@functools.cache
def reference(name: str, micro: int = 1) -> tuple[list[float], list[np.ndarray]]:
    """Losses and final state leaves of STEPS AdamW steps of the single-device jax.jit step
    of test case `name`; with `micro` > 1, the step that averages over the same `micro`
    micro-batches (what pipeline and micro-batched plans compute)."""
    case = models.make_case(name, "adamw")
    state, _ = case.init()
    batches = [case.batch_for_step(i) for i in range(STEPS)]
    saved = models.GRAD.value_and_grad
    if micro > 1:
        models.GRAD.value_and_grad = micro_batch_value_and_grad(micro)
    try:
        final, losses = run_steps(jax.jit(case.step), state, batches)
    finally:
        models.GRAD.value_and_grad = saved
    return losses, [np.asarray(x) for x in jax.tree.leaves(final)]


def ranks_json(out: pathlib.Path, processes: int) -> list[dict]:
    """What each rank of train.py wrote: fingerprint, plan hash, method, mesh_shape, losses,
    rows (per batch leaf, the [start, stop) it passed), local_devices, split_state_leaves
    (final state leaves of which it holds only a part), stage_processes (per stage, the
    processes of its devices)."""
    return [json.loads((out / f"rank{k}.json").read_text()) for k in range(processes)]


def assert_equals_reference(name: str, out: pathlib.Path, micro: int = 1) -> None:
    """train.py's losses and final state (OUT/result.npz) equal `reference(name, micro)`."""
    ref_losses, ref_leaves = reference(name, micro)
    result = np.load(out / "result.npz", allow_pickle=False)
    np.testing.assert_allclose(result["losses"], ref_losses, **TOL)
    assert len([k for k in result.files if k.startswith("leaf")]) == len(ref_leaves)
    for k, ref in enumerate(ref_leaves):
        np.testing.assert_allclose(result[f"leaf{k}"], ref, err_msg=f"state leaf {k}", **TOL)


def assert_one_plan_across(infos: list[dict], processes: int, devices_per_process: int):
    """Every rank ran the same plan over every device, each rank on its own devices, and
    each passed its own block of rows of the batch (or all of them)."""
    assert len({(i["fingerprint"], i["plan"]) for i in infos}) == 1, infos
    total = processes * devices_per_process
    assert all(np.prod(i["mesh_shape"]) == total or i["stage_processes"] for i in infos)
    assert len({tuple(i["local_devices"]) for i in infos}) == processes
    block = BATCH // processes
    for k, info in enumerate(infos):
        for start, stop in jax.tree.leaves(info["rows"], is_leaf=lambda x: isinstance(x, list)):
            assert (start, stop) in ((k * block, (k + 1) * block), (0, BATCH)), (k, info["rows"])
