"""The `jax.distributed` key-value store as autopar's processes use it: JSON and byte
values in chunks (`Store`), bounded waits that follow the heartbeat of the process waited
for (`Store.wait`, `Heartbeat`), and a process's last word before an error ends it
(`announce_exit`).

jax 0.10.2 has no public API for the store: its client lives in
`jax._src.distributed.global_state` (Orbax reaches it the same way).  The store is hosted
by process 0 and ends when process 0 exits.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
import zlib

import jax

from . import env_settings
from .plan import PlanError

# Every process in a plan exchange rewrites a heartbeat key every PLAN_HEARTBEAT_S seconds
# (process 0's says how far its search is), and a process waiting for another's value gives
# up once that process's heartbeat has not changed for PLAN_MISSED_HEARTBEATS intervals (60 s;
# under `autopar launch` launch.PLAN_MISSED_HEARTBEATS, 20 s; the environment variable
# AUTOPAR_PLAN_MISSED_HEARTBEATS sets it), or, before its first heartbeat, after the
# initialization timeout (it never reached the exchange).  AUTOPAR_PLAN_TIMEOUT_S=S instead
# waits a fixed S seconds for each value, heartbeats ignored.
PLAN_HEARTBEAT_S = 2.0
PLAN_MISSED_HEARTBEATS = 30
_CHUNK_BYTES = 1 << 20  # values are sent in chunks of at most 1 MiB
# A process that an uncaught exception ends writes EXITED_KEY/<rank> first, waiting at most
# ANNOUNCE_TIMEOUT_S seconds for the store to take it (the store may be gone already).
EXITED_KEY = "autopar/exited"
ANNOUNCE_TIMEOUT_S = 2.0


# Set by `distributed.initialize` (JAX's own default, 300 s, when the process joined through
# `jax.distributed.initialize`): how long a wait for a process's first heartbeat lasts before
# it counts as never arrived, seconds.
_initialization_timeout_s = 300.0
# Set by `distributed.initialize` once its exit hook is installed: this process then writes
# EXITED_KEY/<rank> just before an uncaught exception ends it.
_announces_exit = False


def set_initialization_timeout(seconds: float) -> None:
    """How long `Store.wait` waits for a process that has not reached the exchange, s."""
    global _initialization_timeout_s
    _initialization_timeout_s = float(seconds)


def mark_exit_announced() -> None:
    """Records that this process's exit hook calls `announce_exit` (the plan exchange then
    tells process 0 to wait for it)."""
    global _announces_exit
    _announces_exit = True


def announces_exit() -> bool:
    """Whether this process announces its exit (`mark_exit_announced`)."""
    return _announces_exit


def fixed_timeout_s() -> float | None:
    """AUTOPAR_PLAN_TIMEOUT_S in seconds, or None when it is not set."""
    return env_settings.positive("AUTOPAR_PLAN_TIMEOUT_S")


def missed_heartbeats() -> int:
    """AUTOPAR_PLAN_MISSED_HEARTBEATS (set by `autopar launch`), or PLAN_MISSED_HEARTBEATS."""
    value = env_settings.positive("AUTOPAR_PLAN_MISSED_HEARTBEATS", int, "heartbeats")
    return PLAN_MISSED_HEARTBEATS if value is None else value


class Heartbeat:
    """This process's heartbeat in one plan exchange: `key` rewritten every PLAN_HEARTBEAT_S
    seconds (by a daemon thread) with a count, the seconds since the exchange began and what
    this process is doing (`doing`; while it searches, where the search is: the innermost
    autopar function of the calling thread)."""

    def __init__(self, store: Store, key: str, doing: str):
        self.store, self.key = store, key
        self.doing = doing
        self.count = 0
        self._t0 = time.monotonic()
        self._caller = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="autopar-plan-heartbeat")

    def start(self) -> None:
        self.beat()   # at once: the others know this process has arrived
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=PLAN_HEARTBEAT_S + 5.0)

    def beat(self) -> None:
        self.count += 1
        doing = self.doing
        if doing.startswith("searching"):
            doing += _where(self._caller)
        value = {"beat": self.count, "s": round(time.monotonic() - self._t0, 1),
                 "doing": doing}
        self.store.client.key_value_set(self.key, json.dumps(value), allow_overwrite=True)

    def _run(self) -> None:
        while not self._stop.wait(PLAN_HEARTBEAT_S):
            with contextlib.suppress(Exception):   # the next beat may go through
                self.beat()


def _where(thread_id: int) -> str:
    """ ", in <module>.<function> (line N)" for the innermost autopar frame of a thread."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("autopar") and module != __name__:
            return f", in {module}.{frame.f_code.co_name} (line {frame.f_lineno})"
        frame = frame.f_back
    return ""


class Store:
    """JSON values (compressed) and bytes in the key-value store of `jax.distributed`, in
    chunks of at most 1 MiB."""

    def __init__(self):
        from jax._src import distributed as _distributed

        self.client = _distributed.global_state.client
        if self.client is None:
            raise RuntimeError("several JAX processes but no jax.distributed client: start "
                               "the processes with autopar.distributed.initialize()")

    def put(self, key: str, value: dict) -> None:
        self.put_bytes(key, zlib.compress(json.dumps(value).encode()))

    def put_bytes(self, key: str, data: bytes) -> None:
        chunks = [data[i:i + _CHUNK_BYTES] for i in range(0, len(data), _CHUNK_BYTES)] or [b""]
        for i, chunk in enumerate(chunks):
            self.client.key_value_set_bytes(f"{key}/{i}", chunk)
        self.client.key_value_set(key, str(len(chunks)))  # written last: the value is whole

    def get(self, key: str, timeout_s: float, what: str) -> dict:
        return json.loads(zlib.decompress(self.get_bytes(key, timeout_s, what)))

    def get_bytes(self, key: str, timeout_s: float, what: str) -> bytes:
        ms = max(1, int(timeout_s * 1000))
        try:
            count = int(self.client.blocking_key_value_get(key, ms))
            return self._chunks(key, count, timeout_s)
        except Exception as err:  # the client raises JaxRuntimeError (DEADLINE_EXCEEDED)
            raise PlanError(f"process {jax.process_index()} waited {timeout_s:g} s for "
                            f"{what} and gave up ({type(err).__name__}: "
                            f"{str(err).splitlines()[0]}); set AUTOPAR_PLAN_TIMEOUT_S to wait "
                            f"longer") from None

    def _chunks(self, key: str, count: int, timeout_s: float) -> bytes:
        """The `count` chunks of a value whose chunk count is published (they were written
        before it)."""
        ms = max(1, int(timeout_s * 1000))
        return b"".join(self.client.blocking_key_value_get_bytes(f"{key}/{i}", ms)
                        for i in range(count))

    def wait(self, key: str, alive_key: str, peer: int, what: str) -> dict:
        """The value under `key`, which process `peer` publishes; `what` names it in errors.

        Waits while `peer`'s heartbeat (`alive_key`, `Heartbeat`) keeps changing: gives up
        with `PlanError` when it has not changed for `missed_heartbeats()` x
        PLAN_HEARTBEAT_S seconds, or when there is none after the initialization timeout
        (`peer` never reached the exchange), or when the key-value store is lost.  With
        AUTOPAR_PLAN_TIMEOUT_S set: waits that many seconds, heartbeats ignored."""
        fixed = fixed_timeout_s()
        if fixed is not None:
            return self.get(key, fixed, what)
        me = jax.process_index()
        beats = missed_heartbeats()
        stale_s = beats * PLAN_HEARTBEAT_S
        t0 = time.monotonic()
        last, changed_at = None, t0
        while True:
            try:
                count = int(self.client.blocking_key_value_get(
                    key, max(1, int(PLAN_HEARTBEAT_S * 1000))))
                break
            except Exception as err:  # JaxRuntimeError: DEADLINE_EXCEEDED, or the store is gone
                text = str(err)
                if "DEADLINE_EXCEEDED" not in text:
                    raise PlanError(
                        f"process {me} lost the jax.distributed key-value store (hosted by "
                        f"process 0) after waiting {time.monotonic() - t0:.0f} s for {what} "
                        f"({type(err).__name__}: {text.splitlines()[0] if text else ''})"
                    ) from None
            now = time.monotonic()
            try:
                seen = json.loads(self.client.key_value_try_get(alive_key))
            except Exception:   # NOT_FOUND: no heartbeat yet
                seen = None
            if seen is not None and seen != last:
                last, changed_at = seen, now
            waited = now - t0
            if last is None and waited > _initialization_timeout_s:
                raise PlanError(
                    f"process {me} waited {waited:.0f} s for {what}, but process {peer} has "
                    f"not reached this plan exchange (no heartbeat from it within the "
                    f"initialization timeout, {_initialization_timeout_s:g} s); set "
                    f"AUTOPAR_PLAN_TIMEOUT_S=<seconds> to wait a fixed time instead")
            if last is not None and now - changed_at > stale_s:
                raise PlanError(
                    f"process {me} waited {waited:.1f} s for {what} and gave up: process "
                    f"{peer} published no heartbeat for {now - changed_at:.1f} s (the bound: "
                    f"{beats} x {PLAN_HEARTBEAT_S:g} s; AUTOPAR_PLAN_MISSED_HEARTBEATS). Its "
                    f"last heartbeat, {last.get('s')} s into the exchange, said: "
                    f"{last.get('doing')}. Process {peer} is stuck or too busy to report; set "
                    f"AUTOPAR_PLAN_TIMEOUT_S=<seconds> to wait a fixed time, heartbeats "
                    f"ignored")
        try:
            data = self._chunks(key, count, stale_s)
        except Exception as err:
            raise PlanError(f"process {me} could not read {what} from the key-value store "
                            f"({type(err).__name__}: {str(err).splitlines()[0]})") from None
        return json.loads(zlib.decompress(data))


def announce_exit() -> None:
    """Writes `EXITED_KEY/<rank>` from a helper thread, waiting at most
    ANNOUNCE_TIMEOUT_S (the store may already be gone)."""
    from jax._src import distributed as _distributed

    state = _distributed.global_state
    client, rank = state.client, state.process_id
    if client is None or rank == 0:
        return

    def announce():
        with contextlib.suppress(Exception):
            client.key_value_set(f"{EXITED_KEY}/{rank}", "1")

    thread = threading.Thread(target=announce, name="autopar-exit", daemon=True)
    thread.start()
    thread.join(ANNOUNCE_TIMEOUT_S)
