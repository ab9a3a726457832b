"""The solver workers' wire format: framing and serialization, no pickle.

Each message is an 8-byte little-endian length followed by an `np.savez` archive, read
back with allow_pickle=False: numpy arrays by name, and a "meta" entry that is UTF-8 JSON
for everything else.  What the arrays and meta of a request and of its answer hold is up
to its handler (solve_request.py: a `ShardingProblem`; tb2_handler.py: a toulbar2 model).
"""

from __future__ import annotations

import io
import json
import os
import select
import struct
import sys
import time
from typing import Any

import numpy as np

_HEADER = struct.Struct("<Q")
MAX_FRAME_BYTES = 1 << 40  # 1 TiB: far above any problem, far below 8 bytes of ASCII text

Arrays = dict[str, np.ndarray]
Meta = dict[str, Any]


def encode(arrays: Arrays, meta: Meta) -> bytes:
    """One message: the arrays and the JSON-encoded meta in an npz archive."""
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta, default=_json_default).encode(),
                                     dtype=np.uint8), **arrays)
    return buf.getvalue()


def decode(payload: bytes) -> tuple[Arrays, Meta]:
    """The arrays and meta of one message (`encode`'s inverse)."""
    with np.load(io.BytesIO(payload), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != "meta"}
        meta = json.loads(z["meta"].tobytes().decode())
    return arrays, meta


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def write_frame(fd: int, payload: bytes) -> None:
    """Writes one frame (length, then `payload`) to file descriptor `fd`."""
    data = _HEADER.pack(len(payload)) + payload
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_frame(fd: int, deadline: float | None = None) -> bytes | None:
    """The next frame's payload (None at the end of the stream).  `deadline`
    (`time.monotonic()` seconds): `TimeoutError` if the frame has not arrived by then.
    `OSError` where the announced length is not one `write_frame` wrote."""
    head = _read_exact(fd, _HEADER.size, deadline)
    if head is None:
        return None
    (size,) = _HEADER.unpack(head)
    if size > MAX_FRAME_BYTES:  # not a length we wrote: text on the stream (a stray print)
        raise OSError(f"solver worker stream: frame of {size:,} bytes announced, at most "
                      f"{MAX_FRAME_BYTES:,} expected (the stream is corrupt)")
    return _read_exact(fd, size, deadline)


def _read_exact(fd: int, size: int, deadline: float | None = None) -> bytes | None:
    chunks, left = [], size
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError(f"no answer on the solver worker's stream by the deadline "
                                   f"({size - left:,} of {size:,} bytes read)")
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def private_stdout() -> int:
    """A worker's answer channel: a private copy of stdout (returned), with file
    descriptor 1 and `sys.stdout` pointed at stderr, so that a library printing from C
    (toulbar2, HiGHS's banner) cannot write into the answer stream and leave the parent
    waiting for a frame that never ends."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return fd
