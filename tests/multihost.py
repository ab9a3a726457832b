"""Multi-process tests: run a script on N local processes through `autopar launch`.

    result = run_processes(SCRIPTS / "train.py", "gpt", tmp_path, processes=2,
                           devices_per_process=4)
    result.output(1)          # everything rank 1 printed
    result.ranks[0].returncode

Every run is bounded by a hard wall-clock timeout (the launcher kills every process when it
strikes) and uses free ports, so tests can run side by side.  A run that does not exit 0
fails the test with the launcher's summary and the last lines of every rank, unless
`expect_ok=False` (then the caller inspects the `LaunchResult`).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

import pytest

from autopar.launch import LaunchResult, launch, python_command

SCRIPTS = pathlib.Path(__file__).parent / "multihost_scripts"
ROOT = pathlib.Path(__file__).parents[1]
TAIL_LINES = 30


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
