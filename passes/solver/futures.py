"""Independent sharding problems solved at the same time, as futures, on the worker pool.

The planners build each intra-op problem in their process (building reads the traced
program) and hand it to a `SolvePool`; `workers` worker processes ("solve" handler of
worker.py: no JAX, started once per pool and reused) solve them while the next problems
are built, so the mesh shapes of a ShardParallel search and the layer ILPs of a pipeline
search use every core.  Results come back as `concurrent.futures.Future`s of `Solution`;
a worker that dies, cannot start or overruns its bound is replaced by solving in this
process, so the pool never loses a problem.

`SolvePool(workers=0)` (or one core) solves inline: the same interface, no processes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time

from . import solve_request
from .pool import Request, WorkerPool
from .problem import ShardingProblem
from .solve import solve

log = logging.getLogger("autopar")

# Longest `SolvePool.close` waits for its workers to finish the problems they hold (seconds).
CLOSE_TIMEOUT_S = 60.0
#: How long past its time limit a worker may take to answer (start-up, reading the
#: problem, the solver's own overrun) before the pool stops waiting, seconds.
ANSWER_GRACE_S = 120.0


def answer_bound_s(time_limit_s: float) -> float:
    """Seconds the pool waits for a worker's answer to a problem with this time limit."""
    return 2.0 * time_limit_s + ANSWER_GRACE_S


def default_workers() -> int:
    """Worker processes worth running: one per core, at most 2 (the solves are short and
    the building process needs a core too); 0 on a single core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return 0 if cores < 2 else min(2, cores)


_Job = tuple[concurrent.futures.Future, ShardingProblem, float, str, int]


class SolvePool:
    """`workers` solver processes fed from one queue, one serving thread each; use as a
    context manager."""

    def __init__(self, workers: int | None = None):
        self.workers = default_workers() if workers is None else max(0, int(workers))
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._pool = WorkerPool(max(1, self.workers), handler="solve")
        # Guards `_threads` and the order of jobs and stop marks in `_jobs`.
        self._lock = threading.Lock()
        self.solved_in_workers = 0

    def __enter__(self) -> SolvePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def warm_up(self) -> None:
        """Starts the serving threads now (their worker processes' imports overlap the
        caller's work)."""
        with self._lock:
            self._start_threads()

    def submit(self, problem: ShardingProblem, *, time_limit_s: float, backend: str,
               threads: int = 1) -> concurrent.futures.Future:
        """A future of `solve(problem, ...)`; inline (already done) without workers."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.workers:
            _run_inline(fut, problem, time_limit_s, backend, threads)
            return fut
        with self._lock:
            self._start_threads()
            self._jobs.put((fut, problem, time_limit_s, backend, threads))
        return fut

    def close(self, cancel: bool = False) -> None:
        """Stops the workers after the queued problems (with `cancel`, drops those not
        started yet: their futures are cancelled), waiting at most CLOSE_TIMEOUT_S for
        them; workers still solving then are killed (their futures get an error).

        A problem handed over while the threads stop (by a done-callback in a serving
        thread: a layer ILP's early retry) lands behind their stop marks: the threads start
        again for it, and stop once nothing is left.  Solves stay in the worker processes
        (toulbar2's options are process-wide: two solves in threads of one process break
        each other).  The pool starts again on the next `submit`."""
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while True:
            with self._lock:
                threads = list(self._threads)
                dropped = self._drain() if cancel else []
                for _ in threads:
                    self._jobs.put(None)
            for job in dropped:   # outside the lock: a future's callbacks may submit
                job[0].cancel()
            self._join(threads, deadline)
            with self._lock:
                left = self._drain()
                self._threads.clear()
                if left and not cancel and time.monotonic() < deadline:
                    for job in left:  # handed over while the threads stopped: serve them
                        self._jobs.put(job)
                    self._start_threads()
                    continue
            for job in left:
                job[0].cancel()
            return

    def _join(self, threads: list[threading.Thread], deadline: float) -> None:
        """Waits for `threads` until `deadline`; a worker still solving then is killed (its
        serving thread then returns; one solving in this process is left to its daemon
        thread)."""
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            for w in list(self._pool.workers):
                if w is not None and w.alive():
                    w.proc.kill()
            for t in threads:
                t.join(2.0)

    def _drain(self) -> list[_Job]:
        """The jobs still queued, taken off the queue (stop marks dropped)."""
        jobs = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return jobs
            if job is not None:
                jobs.append(job)

    def _start_threads(self) -> None:
        """One serving thread per worker (under `_lock`)."""
        for k in range(len(self._threads), self.workers):
            t = threading.Thread(target=self._serve, args=(k,), daemon=True,
                                 name=f"autopar-solve-{k}")
            self._threads.append(t)
            t.start()

    def _serve(self, k: int) -> None:
        self._pool.start_worker(k)
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                try:
                    self._solve(k, *job)
                except Exception as err:  # the caller waits on this future: never leave it
                    if not job[0].done():
                        job[0].set_exception(err)
        finally:
            self._pool.stop_worker(k)

    def _solve(self, k: int, fut: concurrent.futures.Future, problem: ShardingProblem,
               time_limit_s: float, backend: str, threads: int) -> None:
        """Solves one job on worker k, or here where the worker fails."""
        bound = answer_bound_s(time_limit_s)
        req = Request(*solve_request.request(problem, time_limit_s, backend, threads))
        try:
            answer = self._pool.ask(k, req, time.monotonic() + bound)
        except TimeoutError as err:  # a worker past its bound: solved here instead
            log.warning("autopar: solver worker gave no answer on %s within %.0f s (time "
                        "limit %.0f s): %s; solving it in this process",
                        problem.name or "a problem", bound, time_limit_s, err)
            answer = None
        if answer is None:  # no worker: solve here (a fresh one starts for the next)
            _run_inline(fut, problem, time_limit_s, backend, threads)
            return
        self.solved_in_workers += 1
        fut.set_result(solve_request.solution(problem, answer.arrays, answer.meta))


def _run_inline(fut: concurrent.futures.Future, problem: ShardingProblem, time_limit_s: float,
                backend: str, threads: int) -> None:
    try:
        fut.set_result(solve(problem, time_limit_s=time_limit_s, backend=backend,
                             threads=max(threads, 1)))
    except Exception as err:  # delivered through the future, as from a worker
        fut.set_exception(err)
