"""A persistent plan cache, like JAX's compilation cache: searched plans stored as JSON.

An entry is `<cache dir>/<key>.json`; the key is a SHA-256 over everything the search
reads (`cache_key`): the program fingerprint (program text with avals, cluster, micro-batch
count), the cluster's JSON, the method's options, the input roles, names and ties, the
device ids, the plan format version, the autopar version and a digest of the planner's
source (so editing the planner or the cost model invalidates every entry).

The directory is `AUTOPAR_CACHE_DIR` when set (an empty value disables the cache), else
`$XDG_CACHE_HOME/autopar/plans` (default `~/.cache/autopar/plans`).  Entries are written
atomically; a corrupt, foreign or stale entry is never trusted: it is ignored with a
`PlanCacheWarning` and the search runs (then overwrites it).  A hit is also checked by the
caller with `verify_plan` against the traced program.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import warnings
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

from autopar.cost_model import ClusterSpec
from autopar.cost_model.jsonio import write_json_atomic

from .plan import PLAN_FORMAT_VERSION, Plan, PlanError

CACHE_FORMAT_VERSION = 1
ENV_VAR = "AUTOPAR_CACHE_DIR"
# Source folders (relative to the installed `autopar` package and its mapped subpackages)
# whose code decides which plan the search returns.
_SOURCE_PACKAGES = ("autopar", "autopar.passes", "autopar.cost_model")


class PlanCacheWarning(UserWarning):
    """A plan cache entry was ignored (corrupt, for another key, or failing verification),
    or the cache directory could not be written."""


def cache_dir() -> pathlib.Path | None:
    """The cache directory, or None when the cache is disabled (`AUTOPAR_CACHE_DIR=""`)."""
    env = os.environ.get(ENV_VAR)
    if env is not None:
        return pathlib.Path(env).expanduser() if env.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "autopar" / "plans"


@functools.cache
def code_version() -> str:
    """autopar's version and 16 hex digits of SHA-256 over the planner's source files."""
    import importlib

    h = hashlib.sha256()
    for name in _SOURCE_PACKAGES:
        root = pathlib.Path(importlib.import_module(name).__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    try:
        version = metadata.version("autopar")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"{version}+{h.hexdigest()[:16]}"


def method_fields(method: Any) -> dict[str, Any]:
    """The method's class and options (a frozen dataclass: its fields), JSON-able."""
    out: dict[str, Any] = {"class": type(method).__name__}
    if dataclasses.is_dataclass(method):
        for f in dataclasses.fields(method):
            out[f.name] = repr(getattr(method, f.name))
    else:
        out["repr"] = repr(method)
    return out


def cache_key(fingerprint: str, method: Any, cluster: ClusterSpec, *,
              device_ids: Sequence[int], roles: Sequence[str] = (),
              input_names: Sequence[str] = (),
              ties: Sequence[tuple[int, int]] = (), extra: str = "") -> tuple[str, dict]:
    """(64 hex digits, the fields hashed) for one search."""
    fields = {
        "cache_format": CACHE_FORMAT_VERSION,
        "plan_format": PLAN_FORMAT_VERSION,
        "code": code_version(),
        "fingerprint": fingerprint,
        "method": method_fields(method),
        "cluster": cluster.to_json(),
        "device_ids": [int(d) for d in device_ids],
        "roles": list(roles),
        "input_names": list(input_names),
        "ties": [list(t) for t in ties],
        "extra": extra,
    }
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest(), fields


#: What reading a damaged entry can raise, each meaning "ignore it": bytes that are not
#: UTF-8 (UnicodeDecodeError) or not JSON (JSONDecodeError), JSON nested past the
#: parser's recursion limit (RecursionError), and a plan of the wrong shape or values
#: (PlanError, a ValueError; TypeError, KeyError, IndexError, AttributeError from fields
#: of the wrong type).
_UNREADABLE = (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError)


@dataclasses.dataclass(frozen=True)
class PlanCache:
    """Plans stored under `directory` (None: a disabled cache that stores nothing)."""

    directory: pathlib.Path | None

    @staticmethod
    def default() -> PlanCache:
        return PlanCache(cache_dir())

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def path(self, key: str) -> pathlib.Path:
        if self.directory is None:
            raise ValueError("the plan cache is disabled (AUTOPAR_CACHE_DIR is empty)")
        return self.directory / f"{key}.json"

    def load(self, key: str, fingerprint: str,
             verify: Callable[[Plan], None] | None = None) -> Plan | None:
        """The stored plan for `key`, or None (no entry, or an entry ignored with a
        `PlanCacheWarning`: unreadable, for another key or fingerprint, or rejected by
        `verify`, which raises `PlanError` / `ValueError` on a plan that does not fit)."""
        if self.directory is None:
            return None
        path = self.path(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            _warn(path, f"cannot be read ({err})")
            return None
        try:
            data = json.loads(raw.decode("utf-8"))
            if not isinstance(data, dict):
                raise PlanError(f"holds a JSON {type(data).__name__}, not an object")
            if data.get("cache_format") != CACHE_FORMAT_VERSION:
                raise PlanError(f"cache_format {data.get('cache_format')!r} is not "
                                f"{CACHE_FORMAT_VERSION}")
            if data.get("key") != key:
                raise PlanError(f"was written for key {str(data.get('key'))[:16]}..., not "
                                f"{key[:16]}...")
            if not isinstance(data.get("plan"), dict):
                raise PlanError("has no plan object")
            plan = Plan.from_json(data["plan"], source=str(path))
            if plan.fingerprint != fingerprint:
                raise PlanError(f"holds a plan with fingerprint {plan.fingerprint}, this "
                                f"program's is {fingerprint}")
            if verify is not None:
                verify(plan)
        except _UNREADABLE as err:
            _warn(path, f"{type(err).__name__}: {err}")
            return None
        return plan

    def store(self, key: str, plan: Plan, fields: dict | None = None) -> pathlib.Path | None:
        """Writes `plan` under `key` atomically; returns the path (None when disabled or
        the directory cannot be written, which warns)."""
        if self.directory is None:
            return None
        path = self.path(key)
        entry = {"cache_format": CACHE_FORMAT_VERSION, "key": key,
                 "key_fields": fields or {}, "plan": plan.to_json()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, entry, indent=None)
        except OSError as err:
            warnings.warn(f"autopar: cannot write the plan cache entry {path}: {err} (set "
                          f"{ENV_VAR} to another folder, or to '' to disable the cache)",
                          PlanCacheWarning, stacklevel=3)
            return None
        return path


def _warn(path: pathlib.Path, reason: str) -> None:
    warnings.warn(f"autopar: ignoring plan cache entry {path}: {reason}; searching again",
                  PlanCacheWarning, stacklevel=4)
