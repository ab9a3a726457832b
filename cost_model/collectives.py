"""α-β cost of collectives on one mesh axis (DESIGN §6).

Every function takes ``nbytes`` = S, the bytes of the full logical tensor (see each function
for which side of the collective that is), ``n`` = devices in each group along the axis, and
the axis' :class:`~autopar.cost_model.Link`; it returns seconds. Groups of ``n <= 1`` devices
need no communication and cost 0.0. The bandwidth terms are those of ring / pairwise
algorithms, the latency term is one α per collective (the link's α is measured or assumed for
a whole collective, not per step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeAlias

from .cluster import Link

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
