"""What XLA says while it compiles: the partitioner's warnings, captured and parsed.

XLA's SPMD partitioner logs, from C++ straight to the process's stderr (file descriptor 2,
not Python's ``sys.stderr``), a warning each time it cannot turn one sharding into another
with a collective and instead replicates the whole tensor and slices it again::

    [SPMD] Involuntary full rematerialization. The compiler cannot go from sharding
    {devices=[8,1]<=[8]} to {devices=[1,2,4]<=[8] last_tile_dim_replicate} efficiently for
    HLO operation %param = f32[32,1024]{1,0} parameter(31), ...

Such a reshard costs a full all-gather (and a full-size buffer) where a plan may have
priced an all-to-all or a slice.  :func:`compile_logged` compiles with file descriptor 2
redirected to a temporary file, re-emits what it caught, and returns the parsed warnings,
so an audit can count them per plan (:attr:`CompileLog.involuntary_rematerializations`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

_REMAT = re.compile(
    r"Involuntary full rematerialization.*?cannot go from sharding (\{.*?\}) to (\{.*?\}) "
    r"efficiently for HLO operation %?([\w.\-]+) = ([a-z0-9]+\[[^\]]*\])", re.S)


@dataclasses.dataclass(frozen=True)
class Rematerialization:
    """One involuntary full rematerialization: the HLO value, its type and the two
    shardings (XLA's notation)."""

    operation: str
    shape: str
    source: str
    target: str


@dataclasses.dataclass(frozen=True)
class CompileLog:
    """The compiler's stderr output during one compile, and what it reported."""

    text: str
    rematerializations: tuple[Rematerialization, ...]

    @property
    def involuntary_rematerializations(self) -> int:
        return len(self.rematerializations)


def parse(text: str) -> CompileLog:
    """The involuntary full rematerializations reported in compiler output `text`."""
    found = tuple(Rematerialization(m.group(3), m.group(4), m.group(1), m.group(2))
                  for m in _REMAT.finditer(text))
    return CompileLog(text, found)


@contextlib.contextmanager
def captured_fd2() -> Iterator[list[str]]:
    """Redirects file descriptor 2 (where XLA's C++ logging writes) into a temporary file
    for the block; the list it yields receives the captured text afterwards, which is also
    written back to the real stderr so nothing is hidden from the user."""
    box: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            data = tmp.read()
            box.append(data.decode(errors="replace"))
            if data:
                os.write(2, data)


def compile_logged(lowered: Any) -> tuple[Any, CompileLog]:
    """``lowered.compile()`` with the compiler's stderr captured and parsed."""
    with captured_fd2() as box:
        compiled = lowered.compile()
    return compiled, parse(box[0] if box else "")
