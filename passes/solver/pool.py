"""A pool of solver worker processes (worker.py) with a wall-clock guard.

`WorkerPool.run(requests, deadline)` sends each request to a worker, waits for all the
answers and returns them in request order, so the caller's result never depends on which
worker finished first.  A worker still busy at `deadline` is sent SIGVTALRM (toulbar2
stops and answers with its best solution), repeatedly; one still busy `grace_s` later is
killed and its answer is None (a fresh worker replaces it on the next request).
`WorkerPool.ask(i, request, deadline)` is one request on worker i, for callers that keep
one thread per worker (solve_futures.py).  Answers are decoded one at a time (see
`_decode`).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from . import wire
from .tb2_handler import solve_inline

_SIGNAL_EVERY_S = 0.25
# np.load parses each array's header with ast.literal_eval, and CPython 3.11's AST
# constructor keeps one recursion counter per interpreter, not per thread: two pool threads
# decoding answers at once failed with "SystemError: AST constructor recursion depth
# mismatch" (CPython gh-106905; seen on 3.11.7 in a pipeline test).  One decode at a time.
_DECODE_LOCK = threading.Lock()


def worker_command(handler: str) -> list[str]:
    """The command line of a worker process serving `handler` (worker.HANDLERS)."""
    return [sys.executable, "-m", f"{__package__}.worker", handler]


def _package_root() -> str:
    """The folder that holds this package's top-level package: a worker started there
    (`python -m` puts its working folder first on sys.path) imports the same solver as
    this process, even where the caller's working folder holds another copy (a source
    checkout next to an installed autopar)."""
    top = sys.modules[__package__.partition(".")[0]]
    return os.path.dirname(os.path.dirname(os.path.abspath(top.__file__)))


@dataclass
class Request:
    """One solve: arrays and meta (see the handler's module).  With `base`, the worker must
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
    """One worker process and its two pipes."""

    def __init__(self, command: Sequence[str], cwd: str | None = None) -> None:
        self.proc = subprocess.Popen(
            list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, close_fds=True, cwd=cwd,
        )
        self.cached: str | None = None

    @property
    def out_fd(self) -> int:
        return self.proc.stdout.fileno()

    def send(self, arrays: dict, meta: dict) -> None:
        wire.write_frame(self.proc.stdin.fileno(), wire.encode(arrays, meta))

    def receive(self, deadline: float | None = None) -> Answer | None:
        """The next answer; None at the end of the stream.  `deadline`
        (`time.monotonic()` seconds): `TimeoutError` when it has not come by then."""
        frame = wire.read_frame(self.out_fd, deadline)
        return None if frame is None else Answer(*_decode(frame))

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
            if f is not None:
                f.close()

    def stop(self) -> None:
        """Ends the worker: closes its input (it exits after its current request),
        killed if still running 2 s later."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=2.0)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


def _decode(frame: bytes) -> tuple[dict, dict]:
    with _DECODE_LOCK:
        try:
            return wire.decode(frame)
        except SystemError:  # the same bug, from an AST built outside the pool: once more
            return wire.decode(frame)


class WorkerPool:
    """`size` worker processes serving `handler`, started lazily; use as a context
    manager.  `command` replaces the worker's command line (an experiment's own worker:
    `[sys.executable, "-m", module]` of a module that calls `worker.serve`; it runs in
    this process's working folder)."""

    def __init__(self, size: int = 2, grace_s: float = 1.5, handler: str = "tb2",
                 command: Sequence[str] | None = None) -> None:
        if size < 1:
            raise ValueError(f"WorkerPool: size must be >= 1, got {size=}")
        self.size = size
        self.grace_s = grace_s
        if command is None:
            self.command, self.cwd = worker_command(handler), _package_root()
        else:
            self.command, self.cwd = list(command), None
        self.workers: list[_Worker | None] = [None] * size
        self.killed = 0

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Ends every worker (see `stop_worker`)."""
        for i in range(self.size):
            self.stop_worker(i)

    def _worker(self, i: int) -> _Worker:
        w = self.workers[i]
        if w is None or not w.alive():
            if w is not None:
                w.kill()
            self.workers[i] = None
            w = self.workers[i] = _Worker(self.command, self.cwd)
        return w

    def _drop(self, i: int) -> None:
        """Kills worker i (a fresh one replaces it on its next request)."""
        w, self.workers[i] = self.workers[i], None
        if w is not None:
            w.kill()

    def warm_up(self) -> None:
        """Starts every worker now (their imports overlap the caller's work)."""
        for i in range(self.size):
            self._worker(i)

    def start_worker(self, i: int) -> None:
        """Starts worker i now where it is not running; one that cannot start is left to
        its first request (`ask` answers None)."""
        try:
            self._worker(i)
        except OSError:
            pass

    def stop_worker(self, i: int) -> None:
        """Ends worker i after its current request (see `_Worker.stop`)."""
        w, self.workers[i] = self.workers[i], None
        if w is not None:
            w.stop()

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

    def ask(self, wi: int, request: Request, deadline: float) -> Answer | None:
        """The answer of worker `wi` to `request` (time.monotonic() deadline), None where
        the worker cannot start or dies; `TimeoutError` where it has not answered by the
        deadline.  A worker that fails is killed (a fresh one serves the next request).
        Safe to call from one thread per worker index."""
        try:
            w = self._worker(wi)
            w.send(request.arrays, request.meta)
            answer = w.receive(deadline)
        except TimeoutError:  # (an OSError: before the next clause)
            self._drop(wi)
            raise
        except OSError:
            answer = None
        except BaseException:  # an error mid-frame: the stream is unusable
            self._drop(wi)
            raise
        if answer is None:
            self._drop(wi)
        return answer

    def _dispatch(self, batch: _Batch, wi: int) -> None:
        while batch.queues[wi]:
            ri = batch.queues[wi].pop(0)
            req = batch.requests[ri]
            try:
                w = self._worker(wi)
                if req.base is not None and w.cached != req.base:
                    w.send(req.base_arrays, {"cache": req.base, "load_only": True})
                    if w.receive() is None:
                        raise OSError("worker died while loading")
                    w.cached = req.base
                w.send(req.arrays, dict(req.meta, base=req.base))
                batch.busy[wi] = ri
                return
            except OSError:
                self._drop(wi)

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
                    self._drop(wi)
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
                try:
                    ans = self.workers[wi].receive()
                except OSError:  # a corrupt stream: as from a worker that died
                    ans = None
                ri = busy.pop(wi)
                if ans is None:
                    self._drop(wi)
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
    """`WorkerPool`'s interface for the "tb2" handler, one solve at a time in this
    process: for small exact models, where a worker's start-up (0.2-0.4 s) costs more than
    the solve.

    toulbar2's timer limits CPU seconds (whole seconds, at least 1) instead of the wall
    clock: a request gets the seconds left before `deadline`, rounded up.  toulbar2 keeps
    its options in process-wide state; every request sets all it relies on (tb2_handler).
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
            ans = Answer(*solve_inline(model, meta))
            answers.append(ans)
            if stop_when is not None:
                new = stop_when(ans)
                if new is not None:
                    deadline = min(deadline, new)
        return answers

