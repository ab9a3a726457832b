"""α-β cost of collectives on one mesh axis (DESIGN §6).

Every function takes ``nbytes`` = S, the bytes of the full logical tensor (see each function
for which side of the collective that is), ``n`` = devices in each group along the axis, and
the axis' :class:`~autopar.cost_model.Link`; it returns seconds. Groups of ``n <= 1`` devices
need no communication and cost 0.0. The bandwidth terms are those of ring / pairwise
algorithms, the latency term is one α per collective (the link's α is measured or assumed for
a whole collective, not per step).

A backend does not run every kind natively: :data:`LOWERINGS` says, per backend, which kind
really runs (XLA:CPU: a reduce-scatter is an all-reduce), and :func:`collective_s` prices a
kind as its backend runs it; every time model (the intra-op strategies and reshards through
``passes.sharding_spec.MeshContext``, the HLO audit, the profiler's link fit) goes through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeAlias

from .cluster import Backend, Link

CollectiveCost: TypeAlias = Callable[[float, int, Link], float]
CollectiveKind = Literal["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send-recv"]


# XLA:GPU's collective combiners merge independent collectives of one kind into ops of up to
# 30 MiB (kDefaultAllGatherCombineThreshold = kDefaultAllReduceCombineThreshold = 30 MiB + 7 B,
# xla/service/collective_utils.h; AllGatherCombiner in the GPU pass pipeline): a few hundred
# parameters all-gathered after a ZeRO-2 update pay one α per 30 MiB, not one each.  XLA:CPU
# runs them one by one (checked on jax 0.10.2: five independent all-gathers stay five).
COMBINE_THRESHOLD_BYTES = {"cpu": 0.0}
GPU_COMBINE_THRESHOLD_BYTES = 30 * 2**20


def combined_alpha_share(nbytes: float, device_kind: str) -> float:
    """The fraction of one α a collective whose result is `nbytes` (per device) pays when
    the compiler combines it with independent ones of its kind on `device_kind`: its share
    of a combined op, at most one whole α (a collective over the threshold runs alone; on
    a backend that does not combine, every collective pays its α)."""
    threshold = COMBINE_THRESHOLD_BYTES.get(device_kind, GPU_COMBINE_THRESHOLD_BYTES)
    if threshold <= 0:
        return 1.0
    return min(1.0, max(nbytes, 0.0) / threshold)


def _check(nbytes: float, n: int) -> None:
    if nbytes < 0:
        raise ValueError(f"collective cost requires nbytes >= 0, got {nbytes=}")
    if n < 0:
        raise ValueError(f"collective cost requires a group size n >= 0, got {n=}")


def all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    """All-reduce of an S-byte tensor over n devices: α + 2(n−1)/n·S·β seconds.

    Args:
      nbytes: S, bytes of the tensor each device holds (and receives back reduced).
      n: devices in the group.
      link: the axis' link (α seconds, β seconds/byte).
    """
    _check(nbytes, n)
    if n <= 1:
        return 0.0
    return link.alpha_s + 2.0 * (n - 1) / n * nbytes * link.beta_s_per_byte


def all_gather_s(nbytes: float, n: int, link: Link) -> float:
    """All-gather to an S-byte result over n devices: α + (n−1)/n·S·β seconds.

    Args:
      nbytes: S, bytes of the full (gathered, unsharded) result; each device starts with S/n.
      n: devices in the group.
      link: the axis' link (α seconds, β seconds/byte).
    """
    _check(nbytes, n)
    if n <= 1:
        return 0.0
    return link.alpha_s + (n - 1) / n * nbytes * link.beta_s_per_byte


def reduce_scatter_s(nbytes: float, n: int, link: Link) -> float:
    """Reduce-scatter of an S-byte input over n devices: α + (n−1)/n·S·β seconds.

    Args:
      nbytes: S, bytes of the full input each device holds; each device ends with S/n.
      n: devices in the group.
      link: the axis' link (α seconds, β seconds/byte).
    """
    return all_gather_s(nbytes, n, link)   # the same ring volume, in reverse


def all_to_all_s(nbytes: float, n: int, link: Link) -> float:
    """All-to-all of an S-byte tensor over n devices: α + (n−1)/n²·S·β seconds.

    Args:
      nbytes: S, bytes of the full logical tensor; each device holds S/n and sends
        (n−1)/n of its shard away.
      n: devices in the group.
      link: the axis' link (α seconds, β seconds/byte).
    """
    _check(nbytes, n)
    if n <= 1:
        return 0.0
    return link.alpha_s + (n - 1) / (n * n) * nbytes * link.beta_s_per_byte


def send_recv_s(nbytes: float, n: int, link: Link) -> float:
    """Point-to-point transfer of S bytes: α + S·β seconds (0.0 when ``n <= 1``).

    Args:
      nbytes: S, bytes sent.
      n: devices involved (2 for a transfer between two devices; ``n <= 1`` means the data
        stays on its device).
      link: the link crossed (α seconds, β seconds/byte).
    """
    _check(nbytes, n)
    if n <= 1:
        return 0.0
    return link.alpha_s + nbytes * link.beta_s_per_byte


COLLECTIVES: dict[CollectiveKind, CollectiveCost] = {
    "all-reduce": all_reduce_s,
    "all-gather": all_gather_s,
    "reduce-scatter": reduce_scatter_s,
    "all-to-all": all_to_all_s,
    "send-recv": send_recv_s,
}
"""Cost function per collective kind (HLO spelling), for table-driven callers."""


# ---- how each backend runs a collective ----------------------------------------------------

LOWERINGS: dict[Backend, dict[CollectiveKind, CollectiveKind]] = {
    "cpu": {"reduce-scatter": "all-reduce"},
    "gpu": {},
    "tpu": {},
}
"""Backend → {collective kind asked for: the kind that runs}; a kind not listed runs natively.
Priced with the same S (a reduce-scatter's S, the full input each device holds, is the
all-reduce's S); the local slice that follows is fused into its reader and costs no time.

Evidence (jax/jaxlib 0.10.2, 8 emulated CPU devices; ``compiled.as_text()`` of tiny programs
on meshes (4,) and (2, 4), and their timings; tests/test_collective_lowering.py re-checks the
HLO part):

* CPU, reduce-scatter → all-reduce.  What the SPMD partitioner emits for a partial sum whose
  result is split (``jax.jit`` of ``a @ b``, f32 (64, 256) @ (256, 128), k split over x and the
  result's rows over x; also ``v.sum(0)`` of a row-split v into a split result) is
  ``all-reduce f32[64,128]`` of the whole result and a ``dynamic-slice`` to ``f32[16,128]`` —
  no reduce-scatter: XLA:CPU has no ``ReduceScatterCreator`` pass (XLA:GPU runs it right
  after partitioning, ``RunCollectiveOptimizationPasses`` in xla/service/gpu/gpu_compiler.cc,
  and turns exactly that all-reduce + dynamic-slice into one reduce-scatter).  An explicit
  ``jax.lax.psum_scatter`` in ``jax.shard_map`` does stay a ``reduce-scatter`` on CPU (over
  (4,) and over either axis of (2, 4)), but it is no cheaper than the all-reduce: medians of
  31 runs on 4 devices, 1 / 4 / 16 MiB: ``psum`` 0.69 / 2.29 / 7.88 ms, ``psum_scatter``
  0.91 / 3.52 / 11.37 ms.  So on CPU every reduce-scatter costs the all-reduce of its input.
* CPU, native: all-reduce; all-gather (partitioner: rows split → replicated is one
  ``all-gather f32[64,256]``; ``all_gather`` in shard_map likewise); all-to-all (partitioner:
  rows split over x → columns split over x is one tuple ``all-to-all`` of four
  ``f32[16,1,64]``; ``all_to_all`` in shard_map likewise, not decomposed); collective-permute
  (``ppermute``).
* GPU: native (NCCL's reduce-scatter; the ``ReduceScatterCreator`` pass above).  TPU: native,
  as GSPMD describes it (not checked here: no TPU compiler on this machine).
"""


def lowered_kind(kind: CollectiveKind, backend: Backend) -> CollectiveKind:
    """The collective that runs on `backend` when a program asks for `kind` (`LOWERINGS`)."""
    return LOWERINGS.get(backend, {}).get(kind, kind)


def collective_s(kind: CollectiveKind, nbytes: float, n: int, link: Link,
                 backend: Backend) -> float:
    """Seconds of collective `kind` of S = `nbytes` over `n` devices on `link`, as `backend`
    runs it (`lowered_kind`; a CPU reduce-scatter costs ``all_reduce_s``)."""
    return COLLECTIVES[lowered_kind(kind, backend)](nbytes, n, link)
