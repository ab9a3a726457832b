"""The solver worker process: reads requests on stdin, answers each on stdout.

    python -m autopar.passes.solver.worker solve|tb2

One handler per process, named by the argument: "solve" (solve_request.py: a
`ShardingProblem` through `solve()`) or "tb2" (tb2_handler.py: one toulbar2 model).
Messages are wire.py frames.  The worker imports the solver package only (numpy; PuLP and
the solver backends when a request needs them), never JAX, so it starts in a fraction of a
second.  It serves until stdin closes, dies with its parent (Linux), and ignores an
interrupt (SIGVTALRM) that arrives between two solves: toulbar2 answers one mid-solve with
its best solution so far (pool.py sends it at a deadline).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

from . import wire

Handler = Callable[[wire.Arrays, wire.Meta], tuple[wire.Arrays, wire.Meta]]
HANDLERS = ("solve", "tb2")


def handler(name: str) -> Handler:
    """The request handler called `name` (one of HANDLERS)."""
    if name == "solve":
        from . import solve_request  # noqa: PLC0415  (PuLP and the backends: "solve" only)

        return solve_request.handle
    if name == "tb2":
        from .tb2_handler import Handler as Tb2Handler  # noqa: PLC0415

        return Tb2Handler()
    raise ValueError(f"solver worker: handler must be one of {list(HANDLERS)}, got {name!r}")


def serve(handle: Handler) -> None:
    """Answers requests from stdin with `handle` until stdin closes."""
    if sys.platform.startswith("linux"):  # die with the parent, even mid-solve
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    out = wire.private_stdout()
    signal.signal(signal.SIGVTALRM, lambda *_: None)  # an early interrupt is a no-op
    fd_in = sys.stdin.fileno()
    while True:
        frame = wire.read_frame(fd_in)
        if frame is None:
            return
        wire.write_frame(out, wire.encode(*handle(*wire.decode(frame))))


if __name__ == "__main__":
    serve(handler(sys.argv[1]))
