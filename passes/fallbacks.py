"""Fallbacks: legal but weaker choices autopar makes in place of the planned one, reported.

A fallback keeps the program correct (an equation with no sharding rule runs replicated; a
rule that raises is replaced by the replicated strategy; a gradient reduction the runtime
cannot split is summed and laid out by XLA's partitioner) but the program then is not
quite the plan that was priced.  Each one is

* warned as a `FallbackWarning` (a `UserWarning`: `warnings.simplefilter("error",
  autopar.FallbackWarning)` turns every fallback into an error, as the test suite does);
* appended to every active `collecting()` list: the search puts its own into
  `plan.solver["fallbacks"]` (shown by `plan.summary()`), the runtime's go into
  `Traced.fallbacks`.

JAX-free, so that the passes can report without importing the runtime.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Iterator


class FallbackWarning(UserWarning):
    """autopar ran something other than the plan it priced (correct, maybe slower)."""


@dataclasses.dataclass(frozen=True)
class Fallback:
    """One fallback.

    Attributes:
      stage: which part of autopar fell back ("intra-op", "gradient reduction", ...).
      what: what was done instead (e.g. "no sharding rule for 'foo': replicated").
      where: the user's source line or the value it concerns ("" when unknown).
    """

    stage: str
    what: str
    where: str = ""

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return f"{self.stage}: {self.what}" + (f" (at {self.where})" if self.where else "")


_ACTIVE: contextvars.ContextVar[tuple[list[Fallback], ...]] = contextvars.ContextVar(
    "autopar_fallbacks", default=())


def report(stage: str, what: str, where: str = "") -> Fallback:
    """Records a fallback: a `FallbackWarning` and an entry in every active collection
    (each distinct fallback once per collection)."""
    fb = Fallback(stage, what, where)
    for sink in _ACTIVE.get():
        if fb not in sink:
            sink.append(fb)
    warnings.warn(FallbackWarning(f"autopar fell back: {fb}"), stacklevel=3)
    return fb


@contextlib.contextmanager
def collecting() -> Iterator[list[Fallback]]:
    """The fallbacks reported inside the block (nested blocks each see theirs)."""
    sink: list[Fallback] = []
    token = _ACTIVE.set(_ACTIVE.get() + (sink,))
    try:
        yield sink
    finally:
        _ACTIVE.reset(token)
