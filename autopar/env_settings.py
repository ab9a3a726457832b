"""Positive numbers read from environment variables (the waits' bounds), with an error that
names the variable and the value when it is not one."""

from __future__ import annotations

import os


def positive(name: str, kind: type = float, what: str = "seconds") -> float | int | None:
    """The environment variable `name` as a positive `kind` (float or int), None when it is
    not set; ValueError naming it when it is set to anything else."""
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        value = kind(text)
    except ValueError:
        value = 0
    if not value > 0:
        raise ValueError(f"{name}={text!r}: expected a positive number of {what}")
    return value
