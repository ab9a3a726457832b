"""Cost model: cluster specs and presets, α-β collectives, roofline compute (DESIGN §6)."""

from . import (
    collectives,
    compile_log,
    compute,
    devices,
    efficiency,
    hlo_audit,
    profiler,
    units,
)
from .cluster import ClusterSpec, Link
from .hlo_audit import Audit, audit
from .profiler import ProfileResult, profile
from .units import format_bytes, parse_size

__all__ = [
    "Audit",
    "ClusterSpec",
    "Link",
    "ProfileResult",
    "audit",
    "collectives",
    "compile_log",
    "compute",
    "devices",
    "efficiency",
    "format_bytes",
    "hlo_audit",
    "parse_size",
    "profile",
    "profiler",
    "units",
]
