"""The primitive registry: what the planner, the memory model and the runtime know about
each JAX primitive, in one place (issue 42 item 1).  Imports no JAX.

`info(name)` is the `PrimitiveInfo` of a primitive as a jaxpr names it (`eqn.primitive.name`);
a name the registry does not know gets `DEFAULT` (no facts: no FLOPs, no sharding rule, a
buffer of its own, never passed through).  Each primitive has one canonical spelling (the
name the installed JAX gives it); other spellings (`scatter_add` for `scatter-add`, and the
names of other JAX versions: `copy_p`, `pjit`, `checkpoint`) are `ALIASES` of it and read
the same entry.

The facts are the ones the modules used to keep as their own name tables.  Where two tables
disagreed, each call site keeps its answer through a fact of its own (e.g. `neg` is
`linear` but not `layout_only`); the field docstrings of `PrimitiveInfo` name each such
difference.  The FLOP rule of control flow (`scan`, `while`, `cond`: their bodies' FLOPs)
and the strategy rules themselves stay with their readers (`autopar.graph`,
`passes.strategies`), which need the jaxpr or the sharding types.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Iterator, Mapping, Sequence

FlopRule = Callable[[dict, Sequence[tuple[int, ...]], Sequence[tuple[int, ...]]], float]


@dataclasses.dataclass(frozen=True)
class PrimitiveInfo:
    """Facts about one primitive.

    Attributes:
      name: the canonical name ("" for `DEFAULT`).
      elementwise: output element i depends only on operand elements i (operands of the
        output's shape; scalars broadcast): takes its operands' layout (strategy family
        "elementwise"), and `autopar.outer` ties its output's stage layout to its
        same-shape operands.  Conversions, comparisons and bit operations included.
      flops: FLOPs of one equation from (params, operand shapes, output shapes), whole and
        unsharded; None: no FLOPs (`autopar.graph.equation_flops`, which counts control
        flow's bodies itself).  The arithmetic elementwise primitives count one per output
        element (not the conversions, comparisons or bit operations); reductions and
        cumulative scans one per input element (`reduce_xor` and `cummin` included,
        which `fusion_reduce` leaves out).
      fusible: XLA fuses it into its consumers (loop fusion): no buffer of its own when
        every consumer can take it as a fused operand (`passes.memory`).  Every
        elementwise primitive, and the layout changes and slices — a wider set than
        `layout_only` (`slice`, `pad`, `iota`, ... are fusible, not pass-through).
      fusion_reduce: a reduction XLA input-fuses: it reads its operand's fusible producers
        inside its own kernel (`passes.memory`'s fusing consumers are `fusible` or this).
        `reduce_xor` and the cumulative scans are not listed (the memory model never
        listed them), though `strategy` and `flops` treat `reduce_xor` as a reduction.
      expensive: XLA keeps its buffer rather than recompute it in each of several fusions
        (xla::HloInstruction::IsElementwise + "do not duplicate expensive ops");
        `passes.memory` treats `div` by a broadcast non-scalar as cheap on its own.
      indexed: reads or writes at computed indices (gather, scatters): `passes.memory`
        marks the index operand urgent.  Lists `gather`, `scatter-add` and `scatter` only
        (not `scatter-mul` & co., which no table listed).
      critical: the critical path waits for its operands (matmuls, gathers, sorts, loops):
        a partial sum it reads is reduced at once, not deferred and bucketed
        (`passes.memory`).  Wider than `param_use`.
      random: draws random bits: its output is never folded into a constant even when
        computed from constants only (`passes.memory`).
      layout_only: a parameter reaches its use through it unchanged in layout (the
        planner's parameter-use walk, `autopar.planner`).  `neg` is not one (it is
        `linear`), although it too keeps the layout.
      linear: maps a sum of parts to the sum of its images (one operand): a deferred
        gradient goes through it unreduced (`autopar.grad_accum.passes_sums`).  The
        `layout_only` primitives and `neg`.
      linear_sum: adds its operands (`add`, `add_any`): a deferred gradient's parts are
        summed part by part (`autopar.grad_accum`).
      param_use: where the planner's parameter-use walk stops: the parameter's layout
        matters here (`autopar.planner`).  Narrower than `critical` (no scatters, sort,
        top_k or cond).
      heavy: the equations whose count paces a program's repeated layers (matmuls and
        convolutions, `passes.layering`).
      source: its outputs are computed from its parameters alone, so with fixed operands
        its outputs are fixed (`passes.strategies` / `passes.intra_op`: a primitive with no
        strategy rule is still fixed when it is one).  `broadcast_in_dim` and the PRNG
        key primitives have a rule too; `random_bits` and `rng_bit_generator` are not
        sources.
      strategy: the name of its sharding rule family in `passes.strategies` (e.g.
        "elementwise", "reduce", "window", "replicated", or a rule of its own); None: no
        rule (it runs replicated, reported as a fallback).
      body_param: the parameter holding its one sub-jaxpr when inlining it keeps the
        values the same (calls, custom_jvp/vjp, remat): `autopar.graph` inlines it.
      connects_body: `autopar.outer` looks inside it (at `body_param`) for elementwise
        equations that tie a stage's layouts: the plain calls only, not custom_vjp,
        remat or `autopar_compute_grad`.
      jit_call: a `jit` call, which its author may ask to be inlined (`inline=True`,
        `autopar.inline`).
      remat: a rematerialization (`jax.checkpoint`): `autopar.graph` ties a
        differentiated one's operands through an optimization barrier, and
        `autopar.pipeline` rematerializes every stage when the loss has one.
    """

    name: str
    elementwise: bool = False
    flops: FlopRule | None = None
    fusible: bool = False
    fusion_reduce: bool = False
    expensive: bool = False
    indexed: bool = False
    critical: bool = False
    random: bool = False
    layout_only: bool = False
    linear: bool = False
    linear_sum: bool = False
    param_use: bool = False
    heavy: bool = False
    source: bool = False
    strategy: str | None = None
    body_param: str | None = None
    connects_body: bool = False
    jit_call: bool = False
    remat: bool = False

    @property
    def reads_fused(self) -> bool:
        """Reads fused operands: a loop fusion (`fusible`) or an input fusion
        (`fusion_reduce`); `passes.memory` and `passes.intra_op` ask it."""
        return self.fusible or self.fusion_reduce


DEFAULT = PrimitiveInfo("")


# ---- FLOP rules ---------------------------------------------------------------------------


def _dot_flops(params: dict, ins: Sequence[tuple[int, ...]], outs: Sequence) -> float:
    (lc, _), _ = params["dimension_numbers"]
    contract = math.prod(ins[0][d] for d in lc)
    return 2.0 * math.prod(outs[0]) * contract


def _conv_flops(params: dict, ins: Sequence[tuple[int, ...]], outs: Sequence) -> float:
    dn = params["dimension_numbers"]
    rhs = ins[1]
    # rhs spec: (out feature dim, in feature dim, spatial...)
    in_features = rhs[dn.rhs_spec[1]]
    window = math.prod(rhs[d] for d in dn.rhs_spec[2:])
    return 2.0 * math.prod(outs[0]) * in_features * window


def _out_elems(params: dict, ins: Sequence, outs: Sequence) -> float:
    return float(sum(math.prod(o) for o in outs))


def _in_elems(params: dict, ins: Sequence, outs: Sequence) -> float:
    return float(math.prod(ins[0])) if ins else 0.0


def _sort_flops(params: dict, ins: Sequence, outs: Sequence) -> float:
    n = math.prod(ins[0]) if ins else 0
    return float(n * max(1.0, math.log2(max(n, 2))))


# ---- the entries --------------------------------------------------------------------------

_ENTRIES: dict[str, PrimitiveInfo] = {}


def _facts(names: str, **facts) -> None:
    """Adds `facts` to each primitive of `names` (space-separated, canonical spellings)."""
    for name in names.split():
        _ENTRIES[name] = dataclasses.replace(_ENTRIES.get(name, PrimitiveInfo(name)), **facts)


# Elementwise arithmetic: one FLOP per output element.  jax >= 0.11: tanh's derivative
# 1 - y² (jax.lax.one_minus_square) is its own primitive.
_facts("add add_any sub mul div max min neg exp exp2 log log1p tanh logistic sin cos tan sqrt "
       "rsqrt cbrt pow integer_pow abs sign floor ceil round erf erfc erf_inv select_n clamp "
       "square expm1 atan2 asin acos atan sinh cosh asinh acosh atanh rem nextafter is_finite "
       "one_minus_square",
       elementwise=True, flops=_out_elems, fusible=True, strategy="elementwise")
# Elementwise without FLOPs: conversions, comparisons, bit operations.
_facts("convert_element_type bitcast_convert_type reduce_precision copy stop_gradient "
       "eq ne lt le gt ge and or not xor shift_left shift_right_logical shift_right_arithmetic "
       "population_count clz real imag conj complex optimization_barrier",
       elementwise=True, fusible=True, strategy="elementwise")
_facts("broadcast_in_dim reshape squeeze expand_dims iota transpose slice dynamic_slice "
       "concatenate pad rev", fusible=True)
_facts("exp exp2 log log1p tanh logistic sin cos tan sqrt rsqrt cbrt pow div rem erf erfc "
       "erf_inv atan2 asin acos atan sinh cosh asinh acosh atanh expm1", expensive=True)

_facts("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin",
       fusion_reduce=True)
_facts("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor "
       "argmax argmin", flops=_in_elems, strategy="reduce")
_facts("cumsum cumprod cummax cummin cumlogsumexp", flops=_in_elems, strategy="cumulative")

_facts("dot_general", flops=_dot_flops, heavy=True, param_use=True, critical=True,
       strategy="dot_general")
_facts("conv_general_dilated", flops=_conv_flops, heavy=True, param_use=True, critical=True,
       strategy="conv_general_dilated")
_facts("sort", flops=_sort_flops, critical=True, strategy="sort")
_facts("top_k", flops=_sort_flops, critical=True, strategy="top_k")
_facts("gather", indexed=True, critical=True, param_use=True, strategy="gather")
_facts("scatter-add", indexed=True, critical=True, strategy="scatter-add")
_facts("scatter", indexed=True, critical=True)
_facts("scatter scatter-mul scatter-min scatter-max scatter-sub", strategy="scatter")
_facts("scan while", critical=True, param_use=True, strategy="opaque")
_facts("cond", critical=True, strategy="replicated")

_facts("convert_element_type reshape transpose broadcast_in_dim copy squeeze expand_dims "
       "reduce_precision", layout_only=True, linear=True)
_facts("neg", linear=True)
_facts("add add_any", linear_sum=True)

# Layout changes and slices with a rule of their own (the rule family is the name).
for _name in ("broadcast_in_dim reshape transpose squeeze expand_dims slice dynamic_slice "
              "dynamic_update_slice concatenate pad rev split").split():
    _facts(_name, strategy=_name)
del _name
_facts("reduce_window_sum reduce_window_max reduce_window_min reduce_window "
       "select_and_scatter_add select_and_gather_add", strategy="window")

# Sources (outputs from parameters alone), and the PRNG: key plumbing (tiny values,
# replicated on purpose) and the random bits themselves.
_facts("iota broadcast_in_dim random_seed random_wrap random_unwrap random_fold_in random_split "
       "threefry2x32", source=True)
_facts("random_seed random_wrap random_unwrap random_split random_fold_in threefry2x32 "
       "rng_bit_generator", strategy="replicated")
_facts("random_bits", strategy="random_bits")
_facts("random_bits rng_bit_generator", random=True)

# Calls whose one sub-jaxpr can be inlined with the same results.
_facts("jit closed_call core_call custom_jvp_call", connects_body=True)
_facts("jit", body_param="jaxpr", jit_call=True)
_facts("closed_call core_call custom_jvp_call custom_vjp_call", body_param="call_jaxpr")
_facts("custom_vjp_call_jaxpr", body_param="fun_jaxpr")
_facts("remat2", body_param="jaxpr", remat=True)

# autopar's own primitives: the compute-grad marker (inlined by the graph) and the
# pipeline cut marker (no operands, no results: replicated on purpose, no warning).
_facts("autopar_compute_grad", body_param="grad_jaxpr")
_facts("autopar_pipeline_boundary", strategy="replicated")

REGISTRY: Mapping[str, PrimitiveInfo] = types.MappingProxyType(_ENTRIES)

# Other spellings of a canonical name: the names other JAX versions give the same
# primitive (`copy_p`, `pjit`, `checkpoint`) and the underscore spelling of `scatter-add`
# the tables used to list as well.
ALIASES: Mapping[str, str] = types.MappingProxyType({
    "scatter_add": "scatter-add",
    "copy_p": "copy",
    "pjit": "jit",
    "checkpoint": "remat2",
})

_LOOKUP: dict[str, PrimitiveInfo] = {**_ENTRIES, **{a: _ENTRIES[c] for a, c in ALIASES.items()}}


def info(name: str) -> PrimitiveInfo:
    """The facts of primitive `name` (any spelling); `DEFAULT` for one the registry does not
    know."""
    return _LOOKUP.get(name, DEFAULT)


def known(name: str) -> bool:
    """Whether the registry has an entry for `name` (any spelling)."""
    return name in _LOOKUP


def canonical(name: str) -> str:
    """The canonical spelling of `name` (itself when it is not an alias)."""
    return ALIASES.get(name, name)


def spellings(where: Callable[[PrimitiveInfo], object]) -> Iterator[str]:
    """Every name (canonical names, then aliases) whose entry satisfies `where`, in
    registry order."""
    return (name for name, p in _LOOKUP.items() if where(p))
