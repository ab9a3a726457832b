"""Independent sharding problems solved at the same time, in worker processes.

The planners build each intra-op problem in this process (building reads the traced
program) and hand it to a `SolvePool`; `workers` solver processes (`_solve_worker.py`: no
JAX, started once per pool and reused) solve them while the next problems are built, so
the mesh shapes of a ShardParallel search and the layer ILPs of a pipeline search use
every core.  Results come back as `concurrent.futures.Future`s of `Solution`; a worker
that dies or cannot start is replaced by solving in this process, so the pool never loses
a problem.

`SolvePool(workers=0)` (or one core) solves inline: the same interface, no processes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from autopar.passes import solver as solver_pkg
from autopar.passes.solver import InfeasibleError, ShardingProblem, Solution, solve

from . import _solve_worker as wire

log = logging.getLogger("autopar")

_WORKER = os.path.abspath(wire.__file__)
# Longest `SolvePool.close` waits for its workers to finish the problems they hold (seconds).
CLOSE_TIMEOUT_S = 60.0
# np.load parses each array's header with ast.literal_eval, and CPython 3.11's AST
# constructor keeps one recursion counter per interpreter, not per thread: two pool threads
# decoding answers at once failed with "SystemError: AST constructor recursion depth
# mismatch" (CPython gh-106905; seen here on 3.11.7 in a pipeline test).  One decode at a
# time.
_DECODE_LOCK = threading.Lock()


def default_workers() -> int:
    """Worker processes worth running: one per core, at most 2 (the solves are short and
    the building process needs a core too); 0 on a single core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return 0 if cores < 2 else min(2, cores)


class SolvePool:
    """`workers` solver processes fed from one queue; use as a context manager."""

    def __init__(self, workers: int | None = None):
        self.workers = default_workers() if workers is None else max(0, int(workers))
        self._jobs: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._procs: list[subprocess.Popen | None] = [None] * self.workers
        self._lock = threading.Lock()
        self.solved_in_workers = 0

    def __enter__(self) -> SolvePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def warm_up(self) -> None:
        """Starts the worker processes now (their imports overlap the caller's work)."""
        for k in range(self.workers):
            self._ensure_thread(k)

    def submit(self, problem: ShardingProblem, *, time_limit_s: float, backend: str,
               threads: int = 1) -> concurrent.futures.Future:
        """A future of `solve(problem, ...)`; inline (already done) without workers."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.workers:
            _run_inline(fut, problem, time_limit_s, backend, threads)
            return fut
        self.warm_up()
        self._jobs.put((fut, problem, time_limit_s, backend, threads))
        return fut

    def close(self, cancel: bool = False) -> None:
        """Stops the workers after the queued problems (with `cancel`, drops those not
        started yet: their futures are cancelled), waiting at most CLOSE_TIMEOUT_S for
        them; workers still solving then are killed (their futures get an error)."""
        while cancel:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            # A problem still solving past the bound: stop its worker process (its serving
            # thread then returns); one solved in this process is left to its daemon thread.
            for proc in list(self._procs):
                if proc is not None and proc.poll() is None:
                    proc.kill()
            for t in self._threads:
                t.join(2.0)
        self._threads.clear()

    # -- workers ------------------------------------------------------------------------

    def _ensure_thread(self, k: int) -> None:
        with self._lock:
            if len(self._threads) > k:
                return
            t = threading.Thread(target=self._serve, args=(k,), daemon=True,
                                 name=f"autopar-solve-{k}")
            self._threads.append(t)
            t.start()

    def _start(self, k: int) -> subprocess.Popen | None:
        try:
            return subprocess.Popen(
                [sys.executable, _WORKER, os.path.dirname(os.path.dirname(
                    solver_pkg.__file__))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                close_fds=True)
        except OSError:
            return None

    def _serve(self, k: int) -> None:
        proc = self._procs[k] = self._start(k)
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                fut, problem, time_limit_s, backend, threads = job
                try:
                    answer = None
                    if proc is not None and proc.poll() is None:
                        answer = _ask(proc, problem, time_limit_s, backend, threads)
                    if answer is None:  # no worker: solve here (and start a fresh one next)
                        if proc is not None:
                            _stop(proc)
                        _run_inline(fut, problem, time_limit_s, backend, threads)
                        proc = self._procs[k] = self._start(k)
                        continue
                    self.solved_in_workers += 1
                    _resolve(fut, problem, *answer)
                except Exception as err:  # the caller waits on this future: never leave it
                    if not fut.done():
                        fut.set_exception(err)
                    if proc is not None:  # its stream may be mid-frame: a fresh worker
                        _stop(proc)
                    proc = self._procs[k] = self._start(k)
        finally:
            if proc is not None:
                _stop(proc)
            self._procs[k] = None


def _ask(proc: subprocess.Popen, problem: ShardingProblem, time_limit_s: float,
         backend: str, threads: int) -> tuple[dict, dict] | None:
    meta = {"usage_limit": problem.usage_limit, "name": problem.name,
            "node_names": list(problem.node_names or ()) or None,
            "time_limit_s": float(time_limit_s), "backend": backend, "threads": threads}
    if meta["node_names"] is None:
        meta["node_names"] = [""] * problem.num_nodes
    try:
        wire.write_frame(proc.stdin.fileno(), wire.encode(wire.problem_arrays(problem), meta))
        frame = wire.read_frame(proc.stdout.fileno(),
                                time.monotonic() + answer_bound_s(time_limit_s))
    except TimeoutError as err:  # a worker past its bound: solved here instead
        log.warning("autopar: solver worker gave no answer on %s within %.0f s (time limit "
                    "%.0f s): %s; solving it in this process", problem.name or "a problem",
                    answer_bound_s(time_limit_s), time_limit_s, err)
        return None
    except OSError:
        return None
    if frame is None:
        return None
    with _DECODE_LOCK:
        try:
            return wire.decode(frame)
        except SystemError:  # the same bug, from an AST built outside the pool: once more
            return wire.decode(frame)


#: How long past its time limit a worker may take to answer (start-up, reading the
#: problem, the solver's own overrun) before the pool stops waiting, seconds.
ANSWER_GRACE_S = 120.0


def answer_bound_s(time_limit_s: float) -> float:
    """Seconds the pool waits for a worker's answer to a problem with this time limit."""
    return 2.0 * time_limit_s + ANSWER_GRACE_S


def _resolve(fut: concurrent.futures.Future, problem: ShardingProblem, arrays: dict,
             meta: dict[str, Any]) -> None:
    if "error" in meta:
        if meta.get("kind") == "InfeasibleError":
            fut.set_exception(InfeasibleError(meta["smallest_peak_usage"],
                                              meta["usage_limit"], problem.name))
        else:
            fut.set_exception(RuntimeError(f"solver worker: {meta['kind']}: {meta['error']}"))
        return
    fut.set_result(Solution(
        strategies=tuple(int(x) for x in np.asarray(arrays["strategies"])),
        cost=float(meta["cost"]), lower_bound=meta["lower_bound"], status=meta["status"],
        seconds=float(meta["seconds"]), feasible=bool(meta["feasible"]),
        stats=dict(meta["stats"], worker=True)))


def _run_inline(fut: concurrent.futures.Future, problem: ShardingProblem, time_limit_s: float,
                backend: str, threads: int) -> None:
    try:
        fut.set_result(solve(problem, time_limit_s=time_limit_s, backend=backend,
                             threads=max(threads, 1)))
    except Exception as err:  # delivered through the future, as from a worker
        fut.set_exception(err)


def _stop(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
        proc.wait(timeout=2.0)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
