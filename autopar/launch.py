"""`autopar launch`: N local processes of one script, joined by `jax.distributed`.

For trying several hosts on one machine, and for tests.  Each process gets the coordinator
address, its rank, its own port for cross-process transfers and the timeouts through
environment variables (`autopar.distributed.LaunchEnv`); the script calls
`autopar.distributed.initialize()`.  Every line a process prints is echoed with the prefix
`[rank k] `.  When a process fails, the others get `grace_s` to stop on their own (JAX's
distributed runtime stops them within the heartbeat timeout), then they are killed; the
launcher returns a non-zero status and names the rank that failed first.  On a real cluster
the usual launcher (SLURM `srun`, a Kubernetes job, a TPU pod) starts the processes instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from .distributed import LaunchEnv

# Local processes start in seconds: fail fast when one is missing or dies.
INITIALIZATION_TIMEOUT_S = 60
HEARTBEAT_TIMEOUT_S = 10
SHUTDOWN_TIMEOUT_S = 60
# The plan exchange gives up on a process whose heartbeat (every
# distributed.PLAN_HEARTBEAT_S = 2 s) stopped for this many intervals: 20 s.
PLAN_MISSED_HEARTBEATS = 10
TIMEOUT_EXIT_STATUS = 124  # like coreutils `timeout`
_KILL_WAIT_S = 3.0
# What a process's last lines say about why JAX's distributed runtime stopped it.
DIAGNOSES: tuple[tuple[str, str], ...] = (
    ("RegisterTask", "gave up waiting for every process to join (initialization timeout)"),
    ("stopped sending heartbeats", "stopped because another process died (missed heartbeats)"),
    ("Failed to send RPC to coordination service",
     "stopped because it lost the coordinator (rank 0 died or is unreachable)"),
    ("Shutdown barrier", "stopped at exit: not every process reached the end"),
)  # between SIGTERM (JAX may catch it) and SIGKILL
_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class RankResult:
    """One process of a launch.

    Attributes:
      rank: its process id.
      returncode: its exit status (negative: killed by that signal).
      output: everything it printed (stdout and stderr), without the rank prefix.
      stopped_by_launcher: killed by the launcher (after another rank failed, the timeout,
        or an interrupt) rather than exiting on its own.
      exit_s: seconds from the launch to its exit.
    """

    rank: int
    returncode: int
    output: str
    stopped_by_launcher: bool
    exit_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        how = describe_status(self.returncode)
        why = [text for pattern, text in DIAGNOSES if pattern in self.output]
        if why and self.returncode != 0:
            how = f"{how}: {why[0]}"
        if self.stopped_by_launcher:
            how = f"stopped by the launcher ({how})"
        return f"rank {self.rank}: {how} after {self.exit_s:.1f} s"


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """What a launch did.

    Attributes:
      returncode: 0 when every rank exited 0; else the first failed rank's status (128 + N
        when killed by signal N), or 124 when the wall-clock timeout struck first.
      ranks: one result per rank, in rank order.
      failed_rank: the rank that failed first (None: none failed, or the timeout struck).
      timed_out: the wall-clock timeout killed the processes.
      wall_s: seconds from the launch to the last exit.
    """

    returncode: int
    ranks: tuple[RankResult, ...]
    failed_rank: int | None
    timed_out: bool
    wall_s: float

    def output(self, rank: int) -> str:
        return self.ranks[rank].output

    def summary(self) -> str:
        """One line per rank, headed by what went wrong."""
        if self.timed_out:
            head = f"timed out after {self.wall_s:.1f} s"
        elif self.failed_rank is not None:
            head = f"rank {self.failed_rank} failed first"
        else:
            head = f"all {len(self.ranks)} processes exited 0"
        return "\n".join([f"autopar launch: {head}", *(f"  {r.describe()}" for r in self.ranks)])


def describe_status(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit status {returncode}"


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that were free a moment ago (bound to port 0, released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def python_command(script: str | None, args: Sequence[str], module: str | None = None) -> list[str]:
    """The command line that runs a script (or `-m module`) with this Python."""
    if module is not None:
        return [sys.executable, "-m", module, *args]
    if script is None:
        raise ValueError("give a script or a module to run")
    return [sys.executable, script, *args]


def launch(command: Sequence[str], num_processes: int, *,
           devices_per_process: int | None = None, timeout_s: float | None = 3600.0,
           grace_s: float | None = None,
           initialization_timeout_s: int = INITIALIZATION_TIMEOUT_S,
           heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
           shutdown_timeout_s: int = SHUTDOWN_TIMEOUT_S,
           plan_missed_heartbeats: int | None = None,
           env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
           echo: TextIO | None = None) -> LaunchResult:
    """Runs `command` as `num_processes` local processes joined by `jax.distributed`.

    Args:
      command: the program and its arguments (e.g. `python_command("train.py", [...])`).
      num_processes: how many processes (ranks 0 .. N-1).
      devices_per_process: emulated CPU devices per process (sets `JAX_PLATFORMS=cpu`);
        None: each process uses its real devices.
      timeout_s: wall-clock limit of the whole launch, seconds (None: none).
      grace_s: after a rank fails, how long the others may take to stop on their own
        before they are killed, seconds (default: the heartbeat timeout + 10).
      initialization_timeout_s / heartbeat_timeout_s / shutdown_timeout_s: passed to
        `jax.distributed.initialize` in every process, seconds.
      plan_missed_heartbeats: the plan exchange gives up on a process whose heartbeat
        stopped for this many intervals of `distributed.PLAN_HEARTBEAT_S` (None: the
        environment's AUTOPAR_PLAN_MISSED_HEARTBEATS, else PLAN_MISSED_HEARTBEATS).
      env: the environment of the processes (default: this one's), before autopar's
        variables are added.
      cwd: their working directory.
      echo: where to echo their output, prefixed `[rank k] ` (None: not echoed).
    """
    if num_processes < 1:
        raise ValueError(f"launch needs at least 1 process, got num_processes={num_processes}")
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"devices_per_process must be positive, got {devices_per_process}")
    if grace_s is None:
        grace_s = heartbeat_timeout_s + 10.0
    if plan_missed_heartbeats is not None and plan_missed_heartbeats < 1:
        raise ValueError(f"plan_missed_heartbeats must be positive, got "
                         f"{plan_missed_heartbeats}")
    ports = free_ports(num_processes + 1)
    base = dict(os.environ if env is None else env)
    base["PYTHONUNBUFFERED"] = "1"
    if plan_missed_heartbeats is None and "AUTOPAR_PLAN_MISSED_HEARTBEATS" not in base:
        plan_missed_heartbeats = PLAN_MISSED_HEARTBEATS
    if devices_per_process is not None:
        base["JAX_PLATFORMS"] = "cpu"
    lock = threading.Lock()
    outputs: list[list[str]] = [[] for _ in range(num_processes)]
    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    exit_s: dict[int, float] = {}
    stopped: set[int] = set()
    t0 = time.monotonic()
    try:
        for rank in range(num_processes):
            settings = LaunchEnv(f"127.0.0.1:{ports[0]}", num_processes, rank,
                                 devices_per_process, f"127.0.0.1:{ports[rank + 1]}",
                                 initialization_timeout_s, heartbeat_timeout_s,
                                 shutdown_timeout_s, launcher_pid=os.getpid(),
                                 plan_missed_heartbeats=plan_missed_heartbeats)
            proc = subprocess.Popen(list(command), env={**base, **settings.to_env()}, cwd=cwd,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(proc)
            reader = threading.Thread(target=_pump, args=(proc, rank, outputs[rank], echo, lock),
                                      daemon=True)
            reader.start()
            readers.append(reader)
        first_failed, timed_out = _wait(procs, t0, grace_s, timeout_s, exit_s, stopped)
    finally:
        # Always reap every child, also on KeyboardInterrupt or an error here.
        stopped |= _kill(dict(enumerate(procs)))
        for reader in readers:
            reader.join(timeout=5.0)
    now = time.monotonic()
    for rank in range(num_processes):
        exit_s.setdefault(rank, now - t0)
    ranks = tuple(RankResult(rank, procs[rank].returncode, "".join(outputs[rank]),
                             rank in stopped, exit_s[rank]) for rank in range(num_processes))
    if timed_out and first_failed is None:
        code = TIMEOUT_EXIT_STATUS
    elif first_failed is not None:
        rc = ranks[first_failed].returncode
        code = rc if rc > 0 else 128 - rc
    else:
        code = 0
    return LaunchResult(code, ranks, first_failed, timed_out, now - t0)


def _wait(procs: Sequence[subprocess.Popen], t0: float, grace_s: float,
          timeout_s: float | None, exit_s: dict[int, float],
          stopped: set[int]) -> tuple[int | None, bool]:
    """Polls the processes until every one has exited, recording each one's exit time
    (seconds after `t0`) in `exit_s` and the ranks it killed in `stopped`: the others are
    killed `grace_s` after the first failure, every one past `timeout_s`.  Returns (the rank
    that failed first or None, whether the launch timed out)."""
    first_failed: int | None = None
    timed_out = False
    kill_at: float | None = None
    while len(exit_s) < len(procs):
        now = time.monotonic()
        for rank, proc in enumerate(procs):
            if rank not in exit_s and proc.poll() is not None:
                exit_s[rank] = now - t0
                if proc.returncode != 0 and first_failed is None and rank not in stopped:
                    first_failed = rank
                    kill_at = now + grace_s
        if len(exit_s) == len(procs):
            break
        if timeout_s is not None and now - t0 > timeout_s:
            timed_out = True
            kill_at = now
        if kill_at is not None and now >= kill_at:
            stopped |= _kill({r: p for r, p in enumerate(procs) if r not in exit_s})
            continue
        time.sleep(_POLL_S)
    return first_failed, timed_out


def _pump(proc: subprocess.Popen, rank: int, sink: list[str], echo: TextIO | None,
          lock: threading.Lock) -> None:
    """Copies a process's output, line by line, to `sink` and (prefixed) to `echo`."""
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        sink.append(line)
        if echo is not None:
            with lock:
                echo.write(f"[rank {rank}] {line}" + ("" if line.endswith("\n") else "\n"))
                echo.flush()
    proc.stdout.close()


def _kill(procs: Mapping[int, subprocess.Popen]) -> set[int]:
    """Stops processes (rank -> process) and anything they started: SIGTERM to their
    process groups, SIGKILL a few seconds later to those still running (JAX's preemption
    notifier catches SIGTERM).  Returns the ranks that were still running."""
    alive = {r: p for r, p in procs.items() if p.poll() is None}
    for p in alive.values():
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + _KILL_WAIT_S
    while time.monotonic() < deadline and any(p.poll() is None for p in alive.values()):
        time.sleep(_POLL_S)
    for p in alive.values():
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
    for p in alive.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10.0)
    return set(alive)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
