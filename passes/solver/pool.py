"""A pool of toulbar2 worker processes with a wall-clock guard.

`WorkerPool.run(requests, deadline)` sends each request to a worker, waits for all the
answers and returns them in request order, so the caller's result never depends on which
worker finished first.  A worker still busy at `deadline` is sent SIGVTALRM (toulbar2
stops and answers with its best solution), repeatedly; one still busy `grace_s` later is
killed and its answer is None (a fresh worker replaces it on the next request).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from autopar.passes.solver import tb2_worker

_WORKER = os.path.abspath(tb2_worker.__file__)
_SIGNAL_EVERY_S = 0.25


@dataclass
class Request:
    """One solve: model arrays and meta (see tb2_worker).  With `base`, the worker must
    hold the model cached under that name: `base_arrays` is sent first when it does not."""

    arrays: dict
    meta: dict
    base: str | None = None
    base_arrays: dict = field(default_factory=dict)


@dataclass
class Answer:
    arrays: dict
    meta: dict


class _Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, close_fds=True,
        )
        self.cached: str | None = None

    @property
    def out_fd(self) -> int:
        return self.proc.stdout.fileno()

    def send(self, arrays: dict, meta: dict) -> None:
        tb2_worker.write_frame(self.proc.stdin.fileno(), tb2_worker.encode(arrays, meta))

    def receive(self) -> Answer | None:
        frame = tb2_worker.read_frame(self.out_fd)
        if frame is None:
            return None
        return Answer(*tb2_worker.decode(frame))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def interrupt(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGVTALRM)

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


class WorkerPool:
    """`size` toulbar2 worker processes, started lazily; use as a context manager."""

    def __init__(self, size: int = 2, grace_s: float = 1.5) -> None:
        if size < 1:
            raise ValueError(f"WorkerPool: size must be >= 1, got {size=}")
        self.size = size
        self.grace_s = grace_s
        self.workers: list[_Worker | None] = [None] * size
        self.killed = 0

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for i, w in enumerate(self.workers):
            if w is not None:
                try:
                    w.proc.stdin.close()
                    w.proc.wait(timeout=2.0)
                except (OSError, subprocess.TimeoutExpired):
                    pass
                w.kill()
                self.workers[i] = None

    def _worker(self, i: int) -> _Worker:
        w = self.workers[i]
        if w is None or not w.alive():
            if w is not None:
                w.kill()
            w = self.workers[i] = _Worker()
        return w

    def warm_up(self) -> None:
        """Starts every worker now (their imports overlap the caller's work)."""
        for i in range(self.size):
            self._worker(i)

    def run(self, requests: list[Request], deadline: float,
            stop_when: Callable[[Answer], float | None] | None = None,
            ) -> list[Answer | None]:
        """Answers to `requests` (time.perf_counter() deadline), in request order.

        Request i runs on worker i % size; requests beyond the pool size wait for the
        previous request of their worker.  `stop_when(answer)` may bring the deadline
        forward: it returns the new deadline (e.g. now, once an optimum is proved: the
        other requests are interrupted and answer with their best so far) or None.
        """
        return self.wait(self.start(requests), deadline, stop_when)

    def start(self, requests: list[Request]) -> _Batch:
        """Sends `requests` to the workers and returns at once (see `wait`)."""
        batch = _Batch(requests, self.size)
        for wi in range(self.size):
            self._dispatch(batch, wi)
        return batch

    def _dispatch(self, batch: _Batch, wi: int) -> None:
        while batch.queues[wi]:
            ri = batch.queues[wi].pop(0)
            req = batch.requests[ri]
            w = self._worker(wi)
            try:
                if req.base is not None and w.cached != req.base:
                    w.send(req.base_arrays, {"cache": req.base, "load_only": True})
                    if w.receive() is None:
                        raise OSError("worker died while loading")
                    w.cached = req.base
                w.send(req.arrays, dict(req.meta, base=req.base))
                batch.busy[wi] = ri
                return
            except OSError:
                w.kill()
                self.workers[wi] = None

    def wait(self, batch: _Batch, deadline: float,
             stop_when: Callable[[Answer], float | None] | None = None,
             ) -> list[Answer | None]:
        """Collects a started batch's answers (see `run`)."""
        busy, answers = batch.busy, batch.answers
        last_signal = 0.0
        while busy:
            now = time.perf_counter()
            if now >= deadline + self.grace_s:
                for wi in list(busy):
                    self.workers[wi].kill()
                    self.workers[wi] = None
                    self.killed += 1
                    del busy[wi]
                    batch.queues[wi].clear()
                break
            if now >= deadline and now - last_signal >= _SIGNAL_EVERY_S:
                for wi in busy:
                    self.workers[wi].interrupt()
                last_signal = now
            wait = min(_SIGNAL_EVERY_S, max(0.01, deadline + self.grace_s - now))
            if now < deadline:
                wait = min(wait, max(0.01, deadline - now))
            fds = {self.workers[wi].out_fd: wi for wi in busy}
            ready, _, _ = select.select(list(fds), [], [], wait)
            for fd in ready:
                wi = fds[fd]
                ans = self.workers[wi].receive()
                ri = busy.pop(wi)
                if ans is None:
                    self.workers[wi].kill()
                    self.workers[wi] = None
                else:
                    answers[ri] = ans
                    sooner = None if stop_when is None else stop_when(ans)
                    if sooner is not None and sooner < deadline:
                        deadline = sooner
                        for q in batch.queues:
                            q.clear()
                self._dispatch(batch, wi)
        return answers


class _Batch:
    """Requests in flight: per-worker queues, the busy workers, the answers so far."""

    def __init__(self, requests: list[Request], size: int) -> None:
        self.requests = requests
        self.queues = [list(range(i, len(requests), size)) for i in range(size)]
        self.busy: dict[int, int] = {}  # worker index -> request index
        self.answers: list[Answer | None] = [None] * len(requests)


class InlinePool:
    """`WorkerPool`'s interface, one solve at a time in this process: for small exact
    models, where a worker's start-up (0.2-0.4 s) costs more than the solve.

    toulbar2's timer limits CPU seconds (whole seconds, at least 1) instead of the wall
    clock: a request gets the seconds left before `deadline`, rounded up.  toulbar2 keeps
    its options in process-wide state; every request sets all it relies on (tb2_worker).
    """

    size = 1
    killed = 0

    def __enter__(self) -> InlinePool:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def warm_up(self) -> None:
        pass

    def run(self, requests: list[Request], deadline: float,
            stop_when: Callable[[Answer], float | None] | None = None,
            ) -> list[Answer | None]:
        """Answers to `requests` in order; those still waiting when `deadline` (or the one
        `stop_when` brings forward) has passed get None."""
        answers: list[Answer | None] = []
        for req in requests:
            left = deadline - time.perf_counter()
            if left <= 0:
                answers.append(None)
                continue
            model = {**req.base_arrays, **req.arrays}
            meta = dict(req.meta, time_limit_s=max(1, int(-(-left // 1))))
            ans = Answer(*tb2_worker.solve_inline(model, meta))
            answers.append(ans)
            if stop_when is not None:
                new = stop_when(ans)
                if new is not None:
                    deadline = min(deadline, new)
        return answers
