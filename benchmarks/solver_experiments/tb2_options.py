"""toulbar2 search settings chosen per request: the "tb2" handler with meta "options".

    WorkerPool(size, command=COMMAND)    workers that read meta["options"]
    solve_inline(model, meta)            the same in this process

meta "options" names toulbar2 settings by their option name (see TUNABLE_OPTIONS) and
the value for this solve; every other request gets autopar's (tb2_handler.SEARCH_OPTIONS),
since toulbar2's options are process-wide.  An unknown name is an error answer that names
it.  For benchmarks/solver_tb2_settings.py.

    python -m benchmarks.solver_experiments.tb2_options    (a worker process)
"""

from __future__ import annotations

import sys
from typing import Any

from autopar.passes.solver import tb2_handler, worker
from autopar.passes.solver.wire import Arrays, Meta

# The settings a request may choose (name -> autopar's value).
TUNABLE_OPTIONS = dict(tb2_handler.SEARCH_OPTIONS)
# A worker process serving them (run from the repository root, as the benchmarks are).
COMMAND = [sys.executable, "-m", "benchmarks.solver_experiments.tb2_options"]


def set_options(tb2: Any, meta: Meta) -> None:
    """Applies meta["options"] after autopar's settings (tb2_handler.Configure)."""
    extra = meta.get("options") or {}
    unknown = sorted(set(extra) - set(TUNABLE_OPTIONS))
    if unknown:
        raise ValueError(f"toulbar2 options {unknown} cannot be set per request "
                         f"(tunable: {sorted(TUNABLE_OPTIONS)})")
    for name, value in extra.items():
        setattr(tb2.option, name, int(value))


def solve_inline(model: Arrays, meta: Meta) -> tuple[Arrays, Meta]:
    """`tb2_handler.solve_inline` with meta["options"] applied."""
    return tb2_handler.solve_inline(model, meta, set_options)


if __name__ == "__main__":
    worker.serve(tb2_handler.Handler(set_options))
