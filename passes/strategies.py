"""Sharding strategies per primitive: the rule table of the intra-op pass.

Adding a primitive means naming its rule family in its `passes.primitives` entry (`strategy`;
a new family goes into `_FAMILIES`), which `strategy_rules` reads.  A rule is one of:

- **follow**: the equation takes the layout of one operand (its "leader"); for each layout
  of the leader the rule gives the output specs, the specs the other operands must have,
  and any communication (e.g. an all-reduce when a reduced dim is split).  Followers are
  merged into their leader's ILP node (Alpa's "follow").
- **enumerate**: the rule lists whole strategies (output specs, required input specs,
  compute and communication seconds), e.g. the splits of a `dot_general`.

The rules live in `follow_rules` and `enumerate_rules`, what they work with in
`strategy_types`; this module is the table, and names them all for its callers.
An unknown primitive gets the replicated strategy and one warning naming it.
Units: seconds for costs, bytes for sizes.
"""

from __future__ import annotations

from collections.abc import Callable

from . import fallbacks, primitives
from .enumerate_rules import (
    enumerate_conv,
    enumerate_dot,
    enumerate_gather,
    enumerate_opaque,
    enumerate_outputs,
    enumerate_scatter,
    enumerate_scatter_add,
)
from .follow_rules import (
    first_operand,
    follow_broadcast,
    follow_concatenate,
    follow_dynamic_update_slice,
    follow_elementwise,
    follow_pad,
    follow_reduce,
    follow_reshape,
    follow_slice_like,
    follow_sort,
    follow_split,
    follow_squeeze,
    follow_top_k,
    follow_transpose,
    follow_unsplit,
    follow_window,
    largest_operand,
)
from .strategy_types import (
    EqnInfo,
    FollowResult,
    Strategy,
    StrategyRule,
    compute_s,
    replicated_strategy,
)

__all__ = [
    "EqnInfo", "FollowResult", "Strategy", "StrategyRule", "compute_s", "enumerate_conv",
    "enumerate_dot", "enumerate_gather", "enumerate_opaque", "enumerate_outputs",
    "enumerate_scatter", "enumerate_scatter_add", "first_operand", "follow_broadcast",
    "follow_concatenate", "follow_dynamic_update_slice", "follow_elementwise", "follow_pad",
    "follow_reduce", "follow_reshape", "follow_slice_like", "follow_sort", "follow_split",
    "follow_squeeze", "follow_top_k", "follow_transpose", "follow_unsplit", "follow_window",
    "largest_operand", "replicated_strategy", "rule_for", "strategy_rules",
]

# ---- the table ----------------------------------------------------------------------------

_follow = lambda fn, leader=largest_operand: StrategyRule("follow", follow=fn, leader=leader)
_enum = lambda fn: StrategyRule("enumerate", enumerate=fn)

# Rule families by name: a primitive's family is its registry entry's `strategy`
# (`passes.primitives`).  Each spelling of each primitive gets a rule object of its own.
_FAMILIES: dict[str, Callable[[], StrategyRule]] = {
    "elementwise": lambda: _follow(follow_elementwise),
    "reduce": lambda: _follow(follow_reduce, first_operand),
    "cumulative": lambda: _follow(follow_unsplit(lambda info: [info.params["axis"]]),
                                  first_operand),
    "broadcast_in_dim": lambda: _follow(follow_broadcast, first_operand),
    "reshape": lambda: _follow(follow_reshape, first_operand),
    "transpose": lambda: _follow(follow_transpose, first_operand),
    "squeeze": lambda: _follow(follow_squeeze, first_operand),
    "expand_dims": lambda: _follow(follow_reshape, first_operand),
    "slice": lambda: _follow(follow_slice_like, first_operand),
    "dynamic_slice": lambda: _follow(follow_slice_like, first_operand),
    "dynamic_update_slice": lambda: _follow(follow_dynamic_update_slice, first_operand),
    "concatenate": lambda: _follow(follow_concatenate),
    "pad": lambda: _follow(follow_pad, first_operand),
    "rev": lambda: _follow(follow_unsplit(lambda info: list(info.params["dimensions"])),
                           first_operand),
    "top_k": lambda: _follow(follow_top_k, first_operand),
    "sort": lambda: _follow(follow_sort),
    "split": lambda: _follow(follow_split, first_operand),
    "dot_general": lambda: _enum(enumerate_dot),
    "conv_general_dilated": lambda: _enum(enumerate_conv),
    "gather": lambda: _enum(enumerate_gather),
    "scatter-add": lambda: _enum(enumerate_scatter_add),
    "scatter": lambda: _enum(enumerate_scatter),
    "random_bits": lambda: _enum(enumerate_outputs),
    "opaque": lambda: _enum(enumerate_opaque),
    "window": lambda: _follow(follow_window, first_operand),
    # `cond`, PRNG key plumbing (tiny values) and autopar's own pipeline cut marker (no
    # operands, no results): replicated on purpose, no warning.
    "replicated": lambda: _enum(lambda info, mesh: [replicated_strategy(info, mesh)]),
}

strategy_rules: dict[str, StrategyRule] = {
    name: _FAMILIES[primitives.info(name).strategy]()
    for name in primitives.spellings(lambda p: p.strategy is not None)}


def rule_for(name: str, where: str = "") -> StrategyRule | None:
    """The rule of primitive `name`, or None: the equation (at the user's source line
    `where`) runs replicated, reported as a fallback."""
    rule = strategy_rules.get(name)
    if rule is None:
        fallbacks.report("intra-op", f"no sharding rule for primitive {name!r}: it runs "
                         "replicated", where)
    return rule

