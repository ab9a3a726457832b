"""Several processes (hosts) on `jax.distributed`: start-up, and the names users reach for
one plan everywhere, global batches and state placed in a plan's shardings.

Multi-controller JAX: every process runs the same script, meshes span the devices of all
processes, and XLA's collectives (NCCL on GPUs, gloo on CPUs) move the data.  autopar adds:

- `initialize()` (here): `jax.distributed.initialize` with the settings autopar needs (gloo
  for CPU collectives, the cross-process transfer socket, bounded start-up and heartbeat
  timeouts); under `autopar launch` every argument comes from the environment
  (`LaunchEnv`), on a cluster from JAX's own detection (SLURM, Open MPI, Kubernetes, TPU).
- `one_plan(...)` (`plan_exchange`): called by `ParallelizedFunction` when a step's devices
  span processes.  Process 0 searches; its plan JSON goes to the others through the
  distributed key-value store (`kv_store`); every process checks the plan against its own
  trace and all of them confirm the same (fingerprint, plan hash) before the first step.
  Two searches never run two plans.  Every wait there follows the heartbeat of the process
  waited for (a search may take hours while process 0 reports; one that stops reporting is
  given up on within PLAN_MISSED_HEARTBEATS x PLAN_HEARTBEAT_S), and process 0's search
  error reaches every process as that error.
- `global_batch(...)` / `process_rows(...)` / `gather(...)` (`global_data`): a global batch
  from each process's rows, and arrays read back whole on every process.
- `input_shardings(step, *args)` (`global_data`): the shardings a single-mesh plan expects
  for every argument, to create state directly in place (`jax.jit(init, out_shardings=...)`).

A process that dies makes the others stop within the heartbeat timeout (JAX's distributed
runtime terminates them with "tasks ... stopped sending heartbeats"); a process that never
arrives makes the others stop after the initialization timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

import jax

from . import kv_store
from .global_data import (
    GATHER_TIMEOUT_S,
    gather,
    global_batch,
    input_shardings,
    place_leaves,
    process_rows,
)
from .kv_store import PLAN_HEARTBEAT_S, PLAN_MISSED_HEARTBEATS
from .plan_exchange import PLAN_ERROR_LINGER_S, one_plan, plan_hash, spans_processes

# The names users and the runtime reach through `autopar.distributed`; the plan exchange,
# the key-value store and the data across processes live in their own modules.
__all__ = ["GATHER_TIMEOUT_S", "HEARTBEAT_TIMEOUT_S", "INITIALIZATION_TIMEOUT_S",
           "PLAN_ERROR_LINGER_S", "PLAN_HEARTBEAT_S", "PLAN_MISSED_HEARTBEATS",
           "SHUTDOWN_TIMEOUT_S", "LaunchEnv", "gather", "global_batch", "initialize",
           "input_shardings", "launched", "one_plan", "place_leaves", "plan_hash",
           "process_rows", "spans_processes"]

# Defaults for real clusters (JAX's own are 300 s and 100 s); `autopar launch` uses shorter
# ones (local processes start in seconds).
INITIALIZATION_TIMEOUT_S = 300
HEARTBEAT_TIMEOUT_S = 60
SHUTDOWN_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What `autopar launch` tells each process, through environment variables.

    Attributes:
      coordinator_address: host:port of the coordination service (run by process 0).
      num_processes: processes in the job.
      process_id: this process's rank, 0 .. num_processes - 1.
      devices_per_process: emulated CPU devices per process (None: the real devices).
      transfer_address: host:port of this process's socket for cross-process
        `jax.device_put` (None: not set).
      initialization_timeout_s / heartbeat_timeout_s / shutdown_timeout_s: seconds.
      launcher_pid: the launcher's process id (the process dies with it).
      plan_missed_heartbeats: heartbeats (PLAN_HEARTBEAT_S apart) the plan exchange may
        miss from a process before the others give up on it (None: PLAN_MISSED_HEARTBEATS).
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    devices_per_process: int | None = None
    transfer_address: str | None = None
    initialization_timeout_s: int = INITIALIZATION_TIMEOUT_S
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S
    shutdown_timeout_s: int = SHUTDOWN_TIMEOUT_S
    launcher_pid: int | None = None
    plan_missed_heartbeats: int | None = None

    _VARS = {"coordinator_address": "AUTOPAR_COORDINATOR_ADDRESS",
             "num_processes": "AUTOPAR_NUM_PROCESSES",
             "process_id": "AUTOPAR_PROCESS_ID",
             "devices_per_process": "AUTOPAR_DEVICES_PER_PROCESS",
             "transfer_address": "AUTOPAR_TRANSFER_ADDRESS",
             "initialization_timeout_s": "AUTOPAR_INITIALIZATION_TIMEOUT_S",
             "heartbeat_timeout_s": "AUTOPAR_HEARTBEAT_TIMEOUT_S",
             "shutdown_timeout_s": "AUTOPAR_SHUTDOWN_TIMEOUT_S",
             "launcher_pid": "AUTOPAR_LAUNCHER_PID",
             "plan_missed_heartbeats": "AUTOPAR_PLAN_MISSED_HEARTBEATS"}

    def to_env(self) -> dict[str, str]:
        return {var: str(getattr(self, field)) for field, var in self._VARS.items()
                if getattr(self, field) is not None}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
        """The launcher's settings, or None when this process was not started by
        `autopar launch`."""
        environ = os.environ if environ is None else environ
        if cls._VARS["num_processes"] not in environ:
            return None
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            var = cls._VARS[field.name]
            if var not in environ:
                continue
            text = environ[var]
            try:
                values[field.name] = text if field.name.endswith("address") else int(text)
            except ValueError:
                raise ValueError(f"environment variable {var}={text!r}: expected an int") from None
        missing = [cls._VARS[f] for f in ("coordinator_address", "process_id") if f not in values]
        if missing:
            raise ValueError(f"AUTOPAR_NUM_PROCESSES is set but {missing} are not: start the "
                             f"script with `autopar launch` or unset AUTOPAR_NUM_PROCESSES")
        return cls(**values)


def launched() -> bool:
    """Whether this process was started by `autopar launch`."""
    return LaunchEnv.from_env() is not None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, cpu_devices: int | None = None,
               transfer_address: str | None = None,
               initialization_timeout_s: int = INITIALIZATION_TIMEOUT_S,
               heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
               shutdown_timeout_s: int = SHUTDOWN_TIMEOUT_S) -> None:
    """Joins this process to the job; call it first, before any JAX computation.

    Under `autopar launch` every setting comes from the environment and the arguments must
    be left out.  Elsewhere they go to `jax.distributed.initialize` (None: JAX detects the
    job from SLURM, Open MPI, Kubernetes or a Cloud TPU environment).

    Args:
      coordinator_address / num_processes / process_id: as `jax.distributed.initialize`.
      cpu_devices: emulated CPU devices in this process (`jax_num_cpu_devices`).
      transfer_address: host:port, reachable from the other hosts, where this process
        accepts cross-process `jax.device_put` transfers (needed by backends without
        their own, e.g. CPU; pipeline stages on different hosts move data this way).
      initialization_timeout_s: how long process start-up waits for every process.
      heartbeat_timeout_s: a process silent this long is declared dead and the others stop.
      shutdown_timeout_s: how long a finishing process waits for the others at exit.

    An uncaught exception then ends the process at once (exit status 1, after its
    traceback), so that the others stop within the heartbeat timeout rather than after the
    shutdown timeout.
    """
    env = LaunchEnv.from_env()
    if env is not None:
        given = [name for name, v in (("coordinator_address", coordinator_address),
                                      ("num_processes", num_processes),
                                      ("process_id", process_id), ("cpu_devices", cpu_devices),
                                      ("transfer_address", transfer_address)) if v is not None]
        if given:
            raise ValueError(f"autopar.distributed.initialize: this process was started by "
                             f"`autopar launch`, which sets {given} itself; call initialize() "
                             f"without them")
        coordinator_address, num_processes = env.coordinator_address, env.num_processes
        process_id, cpu_devices = env.process_id, env.devices_per_process
        transfer_address = env.transfer_address
        initialization_timeout_s = env.initialization_timeout_s
        heartbeat_timeout_s = env.heartbeat_timeout_s
        shutdown_timeout_s = env.shutdown_timeout_s
        if env.launcher_pid is not None:
            _die_with(env.launcher_pid)
    kv_store.set_initialization_timeout(initialization_timeout_s)
    # CPU devices dispatch synchronously across processes: with asynchronous dispatch the
    # CPU client's queued executions, gloo collectives and cross-process transfers of a
    # pipeline step deadlocked here in 1 of 4 runs (2 processes x 4 devices, 2 stages,
    # jax 0.10.2); synchronous dispatch ran 5 of 5.  GPU and TPU clients are unaffected.
    settings = {"jax_cpu_collectives_implementation": "gloo",
                "jax_cpu_enable_async_dispatch": False}
    if cpu_devices is not None:
        settings["jax_num_cpu_devices"] = cpu_devices
    if transfer_address is not None:
        settings["jax_cross_host_transfer_socket_address"] = transfer_address
    for name, value in settings.items():
        try:
            jax.config.update(name, value)
        except RuntimeError as err:
            raise RuntimeError(f"autopar.distributed.initialize must run before any JAX "
                               f"computation (setting {name}: {err})") from None
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               initialization_timeout=initialization_timeout_s,
                               heartbeat_timeout_seconds=heartbeat_timeout_s,
                               shutdown_timeout_seconds=shutdown_timeout_s)
    _exit_at_once_on_errors()


def _exit_at_once_on_errors() -> None:
    """An uncaught exception ends the process at once (status 1, after the traceback):
    at a normal exit, JAX's shutdown waits up to the shutdown timeout for processes that
    are stuck waiting for this one; exiting at once lets them stop within the heartbeat
    timeout instead.  Just before it exits, the process announces it in the key-value store
    (`kv_store.announce_exit`, at most 2 s): a process 0 whose search failed waits for that,
    so that the others end with their own error rather than with "lost the coordinator"."""
    previous = sys.excepthook

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        kv_store.announce_exit()
        os._exit(1)

    sys.excepthook = hook
    kv_store.mark_exit_announced()


def _die_with(parent_pid: int) -> None:
    """On Linux, asks for SIGKILL when the launcher dies (even by SIGKILL, when it cannot
    clean up), so that no process outlives its launch."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the launcher died before the request
        os.kill(os.getpid(), signal.SIGKILL)
