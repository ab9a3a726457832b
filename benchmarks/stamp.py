"""Where a results file came from: the commit, date, machine and command that wrote it.

    meta = stamp()                       # {"commit", "date", "machine", "command"}
    json.dump({"meta": meta, ...}, f)
    md = f"# Title\\n\\n{stamp_markdown(meta)}\\n\\n..."

Cheap and side-effect free: git is asked with a timeout (commit "unknown" without git or a
checkout), the JAX versions come from the installed packages' metadata, and the device kind
is named only if a JAX backend is already up (this never starts one).
"""

from __future__ import annotations

import datetime
import os
import pathlib
import platform
import shlex
import subprocess
import sys
from importlib import metadata

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_GIT_TIMEOUT_S = 5.0


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True,
                              timeout=_GIT_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _commit() -> str:
    head = _git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    # Uncommitted changes to tracked files only (untracked files do not make a tree dirty),
    # and not to the results files themselves: a post-pass (audit, explain) rewrites the
    # page it stamps, and a run of several parts rewrites earlier parts' files.
    changes = _git("status", "--porcelain", "--untracked-files=no", "--", ".",
                   ":(exclude)benchmarks/results")
    return f"{head}-dirty" if changes else head


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _device() -> str | None:
    """'N x KIND' of the default backend if one is already initialized; None otherwise."""
    if "jax" not in sys.modules:
        return None
    try:
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():
            return None
        import jax

        devices = jax.devices()
    except Exception:  # a private API that moved, or a backend that failed: say nothing
        return None
    kinds = sorted({d.device_kind for d in devices})
    return f"{len(devices)} x {'/'.join(kinds)}"


def machine() -> str:
    """A short description: platform, CPU count, jax/jaxlib versions, device kind if known."""
    parts = [f"{platform.system()} {platform.machine()}", f"{os.cpu_count() or '?'} CPUs",
             f"Python {platform.python_version()}"]
    for package in ("jax", "jaxlib"):
        version = _version(package)
        if version:
            parts.append(f"{package} {version}")
    device = _device()
    if device:
        parts.append(device)
    return ", ".join(parts)


def _command() -> str:
    argv = list(sys.argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        name = spec.name.removesuffix(".__main__")
        return shlex.join(["python", "-m", name, *argv[1:]])
    if not argv or not argv[0]:
        return "python"
    return shlex.join(["python", *argv])


def stamp(command: str | None = None) -> dict:
    """{"commit", "date", "machine", "command"} for a results file; `command` defaults to
    the running command line (`python -m MODULE ARGS` when run as a module)."""
    date = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return {"commit": _commit(), "date": date.isoformat().replace("+00:00", "Z"),
            "machine": machine(), "command": command if command is not None else _command()}


def stamp_markdown(meta: dict) -> str:
    """One line for under a results md's title."""
    return (f"_Commit `{meta.get('commit', 'unknown')}`, {meta.get('date', '?')}, "
            f"{meta.get('machine', '?')}; `{meta.get('command', '?')}`._")
