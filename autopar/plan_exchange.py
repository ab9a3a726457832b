"""One plan in every process (`one_plan`): process 0 searches, its plan JSON reaches the
others through the `jax.distributed` key-value store, every process checks it against its
own trace, and all of them confirm the same (fingerprint, plan hash) before the first step.
Two searches never run two plans.

Every wait follows the heartbeat of the process waited for (`kv_store.Store.wait`): a search
may take hours while process 0 reports; one that stops reporting is given up on within
PLAN_MISSED_HEARTBEATS x PLAN_HEARTBEAT_S.  Process 0's search error reaches every process
as that error.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import sys
import time
from collections.abc import Callable, Sequence

import jax

from .kv_store import EXITED_KEY, Heartbeat, Store, announces_exit
from .plan import Plan, PlanError

# A process whose plan exchange fails (process 0: its search raised) first waits, at most
# this many seconds, for every other process to leave the exchange (and, where its exit hook
# is installed, to exit), so that they read its error from the key-value store process 0
# hosts (which ends when process 0 exits) and end with it.
PLAN_ERROR_LINGER_S = 10.0


def spans_processes(devices: Sequence[jax.Device] | None) -> bool:
    """Whether `devices` belong to more than one process (None: offline, no devices)."""
    return devices is not None and len({d.process_index for d in devices}) > 1


def plan_hash(plan: Plan) -> str:
    """16 hex digits of SHA-256 over the plan's JSON."""
    text = json.dumps(plan.to_json(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# Every process plans its steps in the same order (the same script), so the k-th plan of
# one process is the k-th plan of every other: the k-th exchange uses keys "autopar/plan/k".
_exchange_ids = itertools.count()


def one_plan(fp: str | None, devices: Sequence[jax.Device] | None, search: Callable[[], Plan],
             check: Callable[[Plan], Plan], fixed: Plan | None) -> Plan:
    """The plan every process runs.

    One process (or offline): `check(fixed)` when a plan is given, else `search()`.
    Several: process 0 publishes its plan (given, or searched), which the processes without
    a given plan take; every process checks the plan it holds against its own trace (`check`
    raises for a plan that does not fit the program, e.g. `FingerprintError`).  Then every
    process publishes the fingerprint and plan hash it will run and compares them with
    everyone's; any difference or error raises `PlanError` in every process, before the
    first step.  With `fp` None, process 0's plan decides what is traced (e.g. its
    micro-batch count under num_micro_batches="auto"): the caller traces accordingly and
    checks the plan afterwards.

    Every wait is bounded by the heartbeat of the process waited for (PLAN_HEARTBEAT_S,
    PLAN_MISSED_HEARTBEATS): a search may take hours while process 0 keeps reporting.  When
    process 0's search raises, every process raises `PlanError` with that error (process 0
    waits up to PLAN_ERROR_LINGER_S for them to read it before it raises).
    """
    if not spans_processes(devices):
        return check(fixed) if fixed is not None else search()
    key = f"autopar/plan/{next(_exchange_ids)}"
    rank, count = jax.process_index(), jax.process_count()
    store = Store()
    if rank == 0:
        doing = "searching the plan" if fixed is None else "publishing its plan"
    else:
        doing = "waiting for process 0's plan" if fixed is None else "checking its plan"
    beat = Heartbeat(store, f"{key}/alive/{rank}", doing)
    beat.start()
    try:
        return _exchange(key, rank, count, store, beat, fp, search, check, fixed)
    except Exception as err:
        if rank == 0:   # the others read this error from the store process 0 hosts
            _linger(store, key, count)
        else:   # said before `done` lets process 0, and the store, end (and maybe this one)
            print(f"autopar: process {rank} leaves the plan exchange: {type(err).__name__}: "
                  f"{err}", file=sys.stderr, flush=True)
        raise
    finally:
        beat.stop()
        with contextlib.suppress(Exception):
            store.client.key_value_set(f"{key}/done/{rank}", "exits" if announces_exit() else "1")


def _exchange(key: str, rank: int, count: int, store: Store, beat: Heartbeat,
              fp: str | None, search: Callable[[], Plan], check: Callable[[Plan], Plan],
              fixed: Plan | None) -> Plan:
    """`one_plan` in a process of several, under the keys `key/...`."""
    try:
        if rank == 0:
            try:
                plan = fixed if fixed is not None else search()
            except BaseException as err:
                store.put(f"{key}/plan", {"error": f"{type(err).__name__}: {err}"})
                raise
            store.put(f"{key}/plan", {"plan": plan.to_json()})
        elif fixed is not None:
            plan = fixed
        else:
            sent = store.wait(f"{key}/plan", f"{key}/alive/0", 0,
                              "process 0's plan (process 0 searches it)")
            if "error" in sent:
                raise PlanError(f"process 0 could not plan this step: {sent['error']}")
            plan = Plan.from_json(sent["plan"], source="process 0's plan")
        if fp is not None and plan.fingerprint != fp:
            raise PlanError(
                f"process {rank} traced a different program than process 0 (fingerprint {fp} "
                f"here, {plan.fingerprint} in process 0's plan): every process must call the "
                f"step with the same global argument shapes (build batches with "
                f"autopar.distributed.global_batch)")
        beat.doing = "checking the plan against its own trace"
        plan = check(plan)
    except Exception as err:
        # Tell the others why, so that they stop at once with this reason (best effort: the
        # error raised here is the one that matters).
        with contextlib.suppress(Exception):
            store.put(f"{key}/ack/{rank}", {"error": f"{type(err).__name__}: {err}"})
        raise
    mine = {"fingerprint": plan.fingerprint if fp is None else fp, "plan": plan_hash(plan)}
    store.put(f"{key}/ack/{rank}", mine)
    beat.doing = "waiting for the other processes' plan checks"
    acks = {k: store.wait(f"{key}/ack/{k}", f"{key}/alive/{k}", k, f"process {k}'s plan check")
            for k in range(count) if k != rank}
    bad = {k: a for k, a in acks.items() if a != mine}
    if bad:
        lines = "; ".join(f"process {k}: " + (a["error"] if "error" in a else
                          f"fingerprint {a['fingerprint']}, plan {a['plan']}")
                          for k, a in sorted(bad.items()))
        raise PlanError(f"the processes do not run one plan (process {rank}: fingerprint "
                        f"{fp}, plan {mine['plan']}); {lines}")
    return plan


def _linger(store: Store, key: str, count: int) -> None:
    """Waits, at most PLAN_ERROR_LINGER_S in all, until every other process has left the
    exchange `key` (it writes `key/done/<rank>` on leaving) and, where it said it would
    ("exits": its exit hook is installed), until it has announced its exit: a process that
    still runs when process 0 ends would be stopped by JAX's "lost the coordinator" before
    its own error ends it."""
    deadline = time.monotonic() + PLAN_ERROR_LINGER_S

    def get(name: str) -> str | None:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        with contextlib.suppress(Exception):
            return store.client.blocking_key_value_get(name, max(1, int(left * 1000)))
        return None

    for k in range(1, count):
        if get(f"{key}/done/{k}") == "exits":
            get(f"{EXITED_KEY}/{k}")
