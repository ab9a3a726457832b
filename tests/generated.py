"""Generated train steps (issue 43, item 6): a seeded generator of small models, and the
check of one under an autopar method against the single-device `jax.jit` step.

    case = generate(seed)                 # or generate(seed, family="moe")
    state = case.init(); batch = case.batch(0)
    new_state, metrics = case.step(state, batch)       # pure, not jitted
    result = check(case, "pipeshard-2")   # {"outcome": "equal" | "differ" | ..., ...}

Families (`FAMILIES`; seed s gives FAMILIES[s % 6] unless `family` says; everything else
is drawn from the seed):

* mlp: 1-4 hidden Dense layers, widths multiples of 8 in 16..128, activation (relu, gelu,
  tanh, silu), biases on or off, loss cross-entropy, MSE or Huber (regression targets from
  a fixed random teacher);
* attention: 1-3 pre-LN transformer blocks (linen MultiHeadDotProductAttention, LayerNorm,
  an MLP), causal or not, classification from the mean over the sequence;
* conv_bn: 1-4 linen Conv + BatchNorm (batch statistics in the state, `batch_stats`
  mutable in the train step), kernel 1 or 3, stride 1 or 2;
* moe: 1-2 GShard mixture-of-experts layers: a softmax gate, top-1 or top-2 routing with a
  capacity, einsum dispatch and combine with one-hot [B, S, E, C] masks, optionally the
  load-balancing loss; one routing group per sequence, so that micro-batches route
  exactly as the whole batch does;
* tied_embed: token embedding, 0-2 blocks, logits from the same embedding (`attend`),
  next-token cross-entropy;
* scan: `nn.scan` over 2-4 identical blocks (residual MLP or attention), between an input
  and an output projection.

Optimizers: SGD (momentum 0.9, lr 0.05), Adam or AdamW (lr 1e-2, eps 1e-4: the raised eps
keeps Adam's normalization from turning reduction-order noise in near-zero gradients into
±lr steps, as tests/models.py does), optionally after `clip_by_global_norm(1.0)`.  The
rates are chosen so that 3 steps move every parameter leaf by several tolerances (below):
at Adam's usual 1e-3 a LayerNorm scale (|x| = 1) moves 3e-3 against a tolerance of 1.1e-3,
and a method that dropped its update would pass nearly unseen.  Gradients come from
`autopar.value_and_grad`; `Case.make_step(value_and_grad)` builds the same step with another
implementation (the micro-batched reference).  Where drawn (`cuts`), the model calls
`autopar.mark_pipeline_boundary()` between its blocks (one case in three: such cuts often
leave fewer layers than 4 stages need); otherwise pipelines cut it into layers themselves.
float32, batch 16 or 32 (divisible by 8 devices and by the micro-batch counts), sizes that
compile in seconds on CPU.

`check(case, method)` runs STEPS optimizer steps from the same state and batches under
`jax.jit` (for micro-batched methods: the jitted step that averages loss and gradients over
the same strided micro-batches, `benchmarks.toy.micro_batched_value_and_grad`, which
tests/helpers.py re-exports) and under the autopar method, and compares losses and every
state leaf with `np.allclose`'s criterion |got - ref| <= atol + rtol·|ref| at the tolerances
of tests/test_equivalence.py and tests/test_pipeline.py (`TOL`): SGD rtol 2e-4 / atol 2e-5
(summation order only), Adam/AdamW rtol 1e-3 / atol 1e-4.  `err_over_tol` is the largest
|got - ref| / (atol + rtol·|ref|) over all of them: equal iff ≤ 1.  The methods plan with
the cost model `comm(seed)` unless told: this machine's, or one where communication is
almost free (tests/helpers.py's), so that the search splits nearly every value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import autopar
from autopar.passes import fallbacks as _fallbacks
from benchmarks.toy import leaf_tolerance, micro_batched_value_and_grad, run_steps

FAMILIES = ("mlp", "attention", "conv_bn", "moe", "tied_embed", "scan")
OPTIMIZERS = ("sgd", "adam", "adamw")
ACTIVATIONS: dict[str, Callable] = {"relu": nn.relu, "gelu": nn.gelu, "tanh": jnp.tanh,
                                    "silu": nn.silu}
LOSSES = ("xent", "mse", "huber")
TOL = {"sgd": dict(rtol=2e-4, atol=2e-5), "adam": dict(rtol=1e-3, atol=1e-4),
       "adamw": dict(rtol=1e-3, atol=1e-4)}
STEPS = 3
MICRO_BATCHES = 2
TIME_LIMIT_S = 5.0   # the ILP limits: plans need only be valid here (tests/test_pipeline.py)
# name -> micro-batches; `method(name)` builds the autopar method: ShardParallel on the
# whole batch and on MICRO_BATCHES micro-batches, PipeshardParallel with 1, 2 and 4 stages.
METHODS = {"shard": 1, "shard-2mb": MICRO_BATCHES, "pipeshard-1": MICRO_BATCHES,
           "pipeshard-2": MICRO_BATCHES, "pipeshard-4": MICRO_BATCHES,
           "pipeshard-1-tight": MICRO_BATCHES, "pipeshard-2-tight": MICRO_BATCHES,
           "pipeshard-4-tight": MICRO_BATCHES}
# "-tight" methods: the pipeline under a memory budget of this fraction of the largest stage
# of its plan without one (GPipe on one stage, so that both micro-batches are in flight):
# the time-optimal layouts no longer fit, and the search must rematerialize layers (issue
# 47) or lay them out leaner.  The run records which layers it rematerialized and each
# stage's compiled peak against the budget.
TIGHT_FRACTION = 0.85
# `generate(..., small=True)`: the same draws with at most this many layers (lists are
# truncated): programs that compile in about half the time (the CI test's cases).
# `generate(..., scale=k)`: the same draws with these sizes multiplied by k (model widths
# and the batch; depths, sequence lengths and expert counts unchanged), e.g. scale 4 gives
# steps of tens of ms on 8 CPU devices, the size benchmarks.runtime_overhead measures.
SCALED = ("batch", "in_features", "widths", "dim", "ffn", "channels", "vocab")
SMALL = {"widths": 2, "blocks": 1, "length": 2, "layers": 1, "channels": 2, "kernels": 2,
         "strides": 2}
# `movement`: a leaf moved by at most this x the largest move is exempt (Adam moves a leaf
# whose gradient is rounding noise g ~ 1e-9 by lr·g/eps ~ 1e-7, 3e-6 of its usual 3 x lr)
NO_GRADIENT = 1e-4
# Errors a method documents for a case it cannot plan (not a bug): the pipeline planner's
# "N stages need at least as many layers, the forward has M" (autopar/pipeline_search.py)
# when user cuts (`mark_pipeline_boundary`) leave fewer layers than stages.
DOCUMENTED_SKIPS = (re.compile(r"stages need at least as many layers"),)
# ... and, under a "-tight" budget, that no layout fits it.
BUDGET_SKIPS = (re.compile(r"no stage layout fits|does not fit|budget"),)


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
    """One generated train step.

    Attributes:
      name: "<family>-<seed>", "-small" added for small cases, "-x<k>" for scale k (unique
        per draw).
      family: one of FAMILIES.
      seed: what it was drawn from.
      config: the drawn configuration (JSON-able).
      make_step: value_and_grad -> step(state, batch) -> (state, {"loss"}); pure.
      init: () -> a fresh initial state (device arrays; a step may donate them).
      batch: i -> the batch of step i (a dict of arrays; deterministic).
      batch_size: rows of every batch.
      step: make_step(autopar.value_and_grad).
    """

    name: str
    family: str
    seed: int
    config: Mapping[str, Any]
    make_step: Callable[[Callable], Callable]
    init: Callable[[], dict]
    batch: Callable[[int], dict]
    batch_size: int
    step: Callable

    @property
    def description(self) -> str:
        """The drawn config in one line."""
        return f"{self.name}: " + json.dumps(dict(self.config), sort_keys=True)

    @property
    def optimizer(self) -> str:
        return self.config["optimizer"]

    @property
    def tol(self) -> dict:
        return TOL[self.optimizer]


# ------------------------------------------------------------------------------ modules


def _cut(enabled: bool) -> None:
    if enabled:
        autopar.mark_pipeline_boundary()


class _MLP(nn.Module):
    widths: tuple
    act: str
    bias: bool
    out: int
    cuts: bool

    @nn.compact
    def __call__(self, x):
        for w in self.widths:
            x = ACTIVATIONS[self.act](nn.Dense(w, use_bias=self.bias)(x))
            _cut(self.cuts)
        return nn.Dense(self.out, use_bias=self.bias)(x)


class _Block(nn.Module):
    """A pre-LN residual block on [B, S, D]: attention (when heads > 0) then an MLP."""

    heads: int
    ffn: int
    act: str
    causal: bool

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        if self.heads:
            mask = nn.make_causal_mask(x[..., 0]) if self.causal else None
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(d)(ACTIVATIONS[self.act](nn.Dense(self.ffn)(h)))
        return x + h


class _Attention(nn.Module):
    dim: int
    blocks: int
    heads: int
    ffn: int
    act: str
    causal: bool
    out: int
    cuts: bool

    @nn.compact
    def __call__(self, x):  # [B, S, F]
        x = nn.Dense(self.dim, name="in_proj")(x)
        for _ in range(self.blocks):
            _cut(self.cuts)
            x = _Block(self.heads, self.ffn, self.act, self.causal)(x)
        x = nn.LayerNorm()(x)
        return nn.Dense(self.out, name="head")(x.mean(axis=1))


class _ConvBN(nn.Module):
    channels: tuple
    kernels: tuple
    strides: tuple
    act: str
    out: int
    cuts: bool

    @nn.compact
    def __call__(self, x):  # [B, H, W, C]
        for c, k, s in zip(self.channels, self.kernels, self.strides):
            x = nn.Conv(c, (k, k), strides=(s, s), padding="SAME", use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=False, momentum=0.9)(x)
            x = ACTIVATIONS[self.act](x)
            _cut(self.cuts)
        return nn.Dense(self.out)(x.mean(axis=(1, 2)))


class _MoE(nn.Module):
    """GShard-style experts on [B, S, M]: one routing group per sequence."""

    experts: int
    top_k: int
    capacity_factor: float
    ffn: int
    act: str

    @nn.compact
    def __call__(self, x):
        b, s, m = x.shape
        e = self.experts
        cap = max(1, math.ceil(self.top_k * s * self.capacity_factor / e))
        probs = jax.nn.softmax(nn.Dense(e, use_bias=False, name="gate")(x), axis=-1)  # [B,S,E]
        top_p, top_i = jax.lax.top_k(probs, self.top_k)  # [B, S, K]
        if self.top_k > 1:
            top_p = top_p / top_p.sum(-1, keepdims=True)
        masks = jax.nn.one_hot(top_i, e, dtype=x.dtype)  # [B, S, K, E]
        dispatch = combine = 0.0
        taken = jnp.zeros((b, 1, e), x.dtype)   # slots each expert's earlier choices used
        for k in range(self.top_k):
            mk = masks[:, :, k]
            pos = jnp.cumsum(mk, axis=1) - mk + taken  # [B, S, E]
            taken = taken + mk.sum(axis=1, keepdims=True)
            keep = mk * (pos < cap)
            slot = jax.nn.one_hot(jnp.sum(pos * keep, -1).astype(jnp.int32), cap,
                                  dtype=x.dtype)  # [B, S, C]
            d = keep[..., None] * slot[:, :, None, :]  # [B, S, E, C]
            dispatch = dispatch + d
            combine = combine + d * top_p[:, :, k, None, None]
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        wi = self.param("wi", init, (e, m, self.ffn))
        wo = self.param("wo", init, (e, self.ffn, m))
        xe = jnp.einsum("bsec,bsm->becm", dispatch, x)
        h = ACTIVATIONS[self.act](jnp.einsum("becm,emh->bech", xe, wi))
        ye = jnp.einsum("bech,ehm->becm", h, wo)
        y = jnp.einsum("bsec,becm->bsm", combine, ye)
        # GShard's auxiliary loss: mean gate probability x fraction of first choices.
        balance = e * jnp.mean(jnp.sum(probs.mean(axis=1) * masks[:, :, 0].mean(axis=1), -1))
        return y, balance


class _MoEModel(nn.Module):
    dim: int
    layers: int
    experts: int
    top_k: int
    capacity_factor: float
    ffn: int
    act: str
    out: int
    cuts: bool

    @nn.compact
    def __call__(self, x):  # [B, S, F] -> (logits, balance loss)
        x = nn.Dense(self.dim, name="in_proj")(x)
        balance = 0.0
        for _ in range(self.layers):
            _cut(self.cuts)
            y, aux = _MoE(self.experts, self.top_k, self.capacity_factor, self.ffn,
                          self.act)(nn.LayerNorm()(x))
            x, balance = x + y, balance + aux
        return nn.Dense(self.out, name="head")(x.mean(axis=1)), balance / self.layers


class _Tied(nn.Module):
    vocab: int
    dim: int
    blocks: int
    heads: int
    ffn: int
    act: str
    cuts: bool

    @nn.compact
    def __call__(self, tokens):  # int [B, S] -> logits [B, S, V]
        embed = nn.Embed(self.vocab, self.dim)
        pos = self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
        x = embed(tokens) + pos
        for _ in range(self.blocks):
            _cut(self.cuts)
            x = _Block(self.heads, self.ffn, self.act, causal=True)(x)
        return embed.attend(nn.LayerNorm()(x))


class _ScanBody(nn.Module):
    heads: int
    ffn: int
    act: str
    causal: bool

    @nn.compact
    def __call__(self, x, _):
        return _Block(self.heads, self.ffn, self.act, self.causal)(x), None


class _Scan(nn.Module):
    dim: int
    length: int
    heads: int
    ffn: int
    act: str
    causal: bool
    out: int
    cuts: bool

    @nn.compact
    def __call__(self, x):  # [B, S, F]
        x = nn.Dense(self.dim, name="in_proj")(x)
        _cut(self.cuts)
        stack = nn.scan(_ScanBody, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=self.length)(self.heads, self.ffn, self.act, self.causal,
                                            name="layers")
        x, _ = stack(x, None)
        _cut(self.cuts)
        return nn.Dense(self.out, name="head")(nn.LayerNorm()(x).mean(axis=1))


# ------------------------------------------------------------------------------ drawing


def _width(r: np.random.Generator, lo: int = 16, hi: int = 128) -> int:
    return int(r.integers(lo // 8, hi // 8 + 1)) * 8


def _choice(r: np.random.Generator, options):
    return options[int(r.integers(len(options)))]


def _heads(r: np.random.Generator, dim: int) -> int:
    return _choice(r, [h for h in (1, 2, 4) if dim % h == 0 and dim // h >= 4])


def _draw(seed: int, family: str | None, small: bool = False, scale: int = 1) -> dict:
    r = np.random.default_rng([seed, 43])
    fam = FAMILIES[seed % len(FAMILIES)] if family is None else family
    if fam not in FAMILIES:
        raise ValueError(f"unknown family {fam!r}; expected one of {FAMILIES}")
    cfg: dict[str, Any] = {"family": fam, "optimizer": _choice(r, OPTIMIZERS),
                           "clip": bool(r.integers(2)), "batch": _choice(r, (16, 32)),
                           "act": _choice(r, tuple(ACTIVATIONS)),
                           "cuts": bool(r.integers(3) == 0)}
    if fam == "mlp":
        depth = int(r.integers(1, 5))
        cfg.update(in_features=_width(r, 16, 64), widths=[_width(r) for _ in range(depth)],
                   bias=bool(r.integers(2)), loss=_choice(r, LOSSES))
    elif fam in ("attention", "scan"):
        dim = _width(r, 16, 64)
        cfg.update(in_features=_width(r, 8, 32), seq=_choice(r, (4, 8)), dim=dim,
                   heads=_heads(r, dim), ffn=dim * _choice(r, (1, 2)),
                   causal=bool(r.integers(2)))
        if fam == "attention":
            cfg.update(blocks=int(r.integers(1, 4)), loss="xent")
        else:
            cfg.update(length=int(r.integers(2, 5)), loss=_choice(r, LOSSES))
            if not r.integers(2):
                cfg["heads"] = 0   # residual MLP blocks
    elif fam == "conv_bn":
        layers = int(r.integers(1, 5))
        strides = [1] * layers
        for i in r.permutation(layers)[:int(r.integers(0, min(2, layers) + 1))]:
            strides[int(i)] = 2
        cfg.update(size=8, in_channels=_choice(r, (1, 3, 4)),
                   channels=[_width(r, 8, 32) for _ in range(layers)],
                   kernels=[_choice(r, (1, 3)) for _ in range(layers)], strides=strides,
                   loss="xent")
    elif fam == "moe":
        dim = _width(r, 16, 64)
        cfg.update(in_features=_width(r, 8, 32), seq=_choice(r, (4, 8)), dim=dim,
                   layers=int(r.integers(1, 3)), experts=_choice(r, (2, 4, 8)),
                   top_k=int(r.integers(1, 3)), capacity_factor=_choice(r, (1.0, 1.25, 2.0)),
                   ffn=_width(r, 16, 64), balance_loss=bool(r.integers(2)), loss="xent")
    else:  # tied_embed
        dim = _width(r, 16, 64)
        cfg.update(vocab=_width(r, 32, 128), seq=_choice(r, (4, 8)), dim=dim,
                   blocks=int(r.integers(0, 3)), heads=_heads(r, dim),
                   ffn=dim * _choice(r, (1, 2)), loss="xent")
    outputs = _choice(r, (8, 16))
    if fam != "tied_embed":   # its outputs are the vocabulary
        cfg["classes" if cfg["loss"] == "xent" else "targets"] = outputs
    if small:
        cfg["small"] = True
        for key, cap in SMALL.items():
            if isinstance(cfg.get(key), list):
                cfg[key] = cfg[key][:cap]
            elif key in cfg:
                cfg[key] = min(cfg[key], cap)
    if scale != 1:
        cfg["scale"] = scale
        for key in SCALED:
            if isinstance(cfg.get(key), list):
                cfg[key] = [v * scale for v in cfg[key]]
            elif key in cfg:
                cfg[key] *= scale
    return cfg


def _optimizer(cfg: dict) -> optax.GradientTransformation:
    name = cfg["optimizer"]
    if name == "sgd":
        tx = optax.sgd(0.05, momentum=0.9)
    elif name == "adam":
        tx = optax.adam(1e-2, eps=1e-4)
    else:
        tx = optax.adamw(1e-2, eps=1e-4, weight_decay=1e-2)
    return optax.chain(optax.clip_by_global_norm(1.0), tx) if cfg["clip"] else tx


def _model(cfg: dict) -> nn.Module:
    fam, act, cuts = cfg["family"], cfg["act"], cfg["cuts"]
    out = cfg.get("classes", cfg.get("targets"))
    if fam == "mlp":
        return _MLP(tuple(cfg["widths"]), act, cfg["bias"], out, cuts)
    if fam == "attention":
        return _Attention(cfg["dim"], cfg["blocks"], cfg["heads"], cfg["ffn"], act,
                          cfg["causal"], out, cuts)
    if fam == "scan":
        return _Scan(cfg["dim"], cfg["length"], cfg["heads"], cfg["ffn"], act, cfg["causal"],
                     out, cuts)
    if fam == "conv_bn":
        return _ConvBN(tuple(cfg["channels"]), tuple(cfg["kernels"]), tuple(cfg["strides"]),
                       act, out, cuts)
    if fam == "moe":
        return _MoEModel(cfg["dim"], cfg["layers"], cfg["experts"], cfg["top_k"],
                         cfg["capacity_factor"], cfg["ffn"], act, out, cuts)
    return _Tied(cfg["vocab"], cfg["dim"], cfg["blocks"], cfg["heads"], cfg["ffn"], act, cuts)


def _loss(kind: str, out, target):
    if kind == "xent":
        return optax.softmax_cross_entropy_with_integer_labels(out, target).mean()
    if kind == "mse":
        return jnp.mean((out - target) ** 2)
    return optax.huber_loss(out, target, delta=1.0).mean()


def _batches(seed: int, cfg: dict) -> Callable[[int], dict]:
    """Deterministic batches: random inputs, targets from a fixed random teacher (a
    learnable task); for tied_embed, arithmetic progressions mod the vocabulary."""
    b, fam = cfg["batch"], cfg["family"]
    if fam == "tied_embed":
        vocab, seq = cfg["vocab"], cfg["seq"]

        def tokens(i: int) -> dict:
            r = np.random.default_rng([seed, 1, i])
            start, stride = r.integers(0, vocab, (b, 1)), r.integers(1, 4, (b, 1))
            full = (start + stride * np.arange(seq + 1)[None]) % vocab
            return {"tokens": jnp.asarray(full[:, :-1], jnp.int32),
                    "labels": jnp.asarray(full[:, 1:], jnp.int32)}

        return tokens
    if fam == "mlp":
        shape = (cfg["in_features"],)
    elif fam == "conv_bn":
        shape = (cfg["size"], cfg["size"], cfg["in_channels"])
    else:
        shape = (cfg["seq"], cfg["in_features"])
    width = int(np.prod(shape))
    out = cfg.get("classes", cfg.get("targets"))
    teacher = np.random.default_rng([seed, 2]).standard_normal((width, out)) / np.sqrt(width)

    def batch(i: int) -> dict:
        x = np.random.default_rng([seed, 1, i]).standard_normal((b, *shape)).astype(np.float32)
        z = x.reshape(b, width) @ teacher
        y = (np.argmax(z, -1).astype(np.int32) if cfg["loss"] == "xent"
             else np.tanh(z).astype(np.float32))
        return {"x": jnp.asarray(x), "y": jnp.asarray(y)}

    return batch


def generate(seed: int, family: str | None = None, *, small: bool = False,
             scale: int = 1) -> Case:
    """The train step drawn from `seed`: family FAMILIES[seed % 6] unless `family` is given
    (every other draw is the same either way); `small`: capped at SMALL layers; `scale`: the
    SCALED sizes multiplied by it (a positive integer)."""
    if not isinstance(scale, int) or scale < 1:
        raise ValueError(f"generate(scale={scale!r}): expected a positive integer")
    cfg = _draw(seed, family, small, scale)
    fam = cfg["family"]
    model, tx, batch = _model(cfg), _optimizer(cfg), _batches(seed, cfg)
    mutable = fam == "conv_bn"
    balance = 0.01 if cfg.get("balance_loss") else 0.0

    def forward(params, batch_stats, batch):
        """(loss, updated batch_stats or None)."""
        if fam == "tied_embed":
            logits = model.apply({"params": params}, batch["tokens"])
            return _loss("xent", logits, batch["labels"]), None
        if mutable:
            out, new = model.apply({"params": params, "batch_stats": batch_stats}, batch["x"],
                                   mutable=["batch_stats"])
            return _loss(cfg["loss"], out, batch["y"]), new["batch_stats"]
        out = model.apply({"params": params}, batch["x"])
        if fam == "moe":
            out, aux = out
            return _loss(cfg["loss"], out, batch["y"]) + balance * aux, None
        return _loss(cfg["loss"], out, batch["y"]), None

    def make_step(value_and_grad: Callable) -> Callable:
        def step(state, batch):
            params = state["params"]
            if mutable:
                (loss, stats), grads = value_and_grad(forward, has_aux=True)(
                    params, state["batch_stats"], batch)
            else:
                loss, grads = value_and_grad(lambda p, bt: forward(p, None, bt)[0])(
                    params, batch)
            updates, opt_state = tx.update(grads, state["opt_state"], params)
            new = {"params": optax.apply_updates(params, updates), "opt_state": opt_state}
            if mutable:
                new["batch_stats"] = stats
            return new, {"loss": loss}

        return step

    host: list = []

    def init() -> dict:
        if not host:
            example = batch(0)
            inputs = example["tokens"] if fam == "tied_embed" else example["x"]
            variables = jax.jit(model.init)(jax.random.PRNGKey(seed % 2**31), inputs)
            state = {"params": variables["params"],
                     "opt_state": tx.init(variables["params"])}
            if mutable:
                state["batch_stats"] = variables["batch_stats"]
            host.append(jax.device_get(state))
        return jax.tree.map(jnp.asarray, host[0])

    name = f"{fam}-{seed}" + ("-small" if small else "") + (f"-x{scale}" if scale != 1 else "")
    return Case(name, fam, seed, cfg, make_step, init, batch, cfg["batch"],
                make_step(autopar.value_and_grad))


# ------------------------------------------------------------------------------ checking


def method(name: str, time_limit_s: float = TIME_LIMIT_S,
           memory_budget_bytes: float | None = None):
    """The autopar method of METHODS' `name` (a "-tight" one under `memory_budget_bytes`,
    `tight_budget`)."""
    if name.startswith("shard") and name in METHODS:
        return autopar.ShardParallel(num_micro_batches=METHODS[name], time_limit_s=time_limit_s)
    if name.startswith("pipeshard-") and name in METHODS:
        stages = int(name.split("-")[1])
        tight = name.endswith("-tight")
        return autopar.PipeshardParallel(
            num_micro_batches=METHODS[name], num_stages=stages, time_limit_s=time_limit_s,
            schedule="gpipe" if tight and stages == 1 else "1f1b",
            memory_budget_bytes=memory_budget_bytes if tight else None)
    raise ValueError(f"unknown method {name!r}; expected one of {tuple(METHODS)}")


def tight_budget(case: Case, name: str, time_limit_s: float = TIME_LIMIT_S,
                 **kw: Any) -> float:
    """Bytes per device a "-tight" method `name` plans `case` under: TIGHT_FRACTION of the
    largest stage of the same method's plan without a budget (`kw`: `parallelize`'s)."""
    free = autopar.parallelize(case.step, method=method(name, time_limit_s), **kw)
    plan = free.get_plan(case.init(), case.batch(0))
    return TIGHT_FRACTION * max(st.memory_bytes for st in plan.stages)


def documented_skip(err: BaseException, method_name: str = "") -> bool:
    """Whether `err` is an error method `method_name` documents for a case it cannot plan
    (a "-tight" method: also that nothing fits its budget)."""
    skips = DOCUMENTED_SKIPS + (BUDGET_SKIPS if method_name.endswith("-tight") else ())
    return isinstance(err, ValueError) and any(p.search(str(err)) for p in skips)


def _tight_record(par: Any, case: Case, budget: float) -> dict[str, Any]:
    """What a "-tight" run planned under `budget` bytes: the layers it rematerialized (of
    how many), and each stage's compiled peak over the budget and over the planner's."""
    state, batch = case.init(), case.batch(0)
    plan = par.get_plan(state, batch)
    compiled = par.lower(state, batch).compile().stage_memory_bytes()
    return {"budget": budget,
            "remat_layers": sum(lp.remat for st in plan.stages for lp in st.layer_plans),
            "layers": sum(len(st.layer_plans) for st in plan.stages),
            "compiled_over_budget": max(c / budget for c in compiled),
            "compiled_over_planned": max(c / st.memory_bytes
                                         for c, st in zip(compiled, plan.stages))}


_REFERENCES: dict[tuple[str, int, int], tuple] = {}


def reference_step(case: Case, micro_batches: int) -> Callable:
    """The jitted single-device step of `case`, averaging loss and gradients over
    `micro_batches` strided micro-batches when > 1: the reference every method is held to."""
    grad = (jax.value_and_grad if micro_batches == 1
            else micro_batched_value_and_grad(micro_batches))
    return jax.jit(case.make_step(grad))


def reference(case: Case, micro_batches: int, steps: int = STEPS) -> tuple:
    """(final state, losses) of `steps` steps of the jitted step on the host (averaging
    over `micro_batches` strided micro-batches when > 1); once per case per process."""
    key = (case.name, micro_batches, steps)
    if key not in _REFERENCES:
        batches = [case.batch(i) for i in range(steps)]
        _REFERENCES[key] = jax.device_get(
            run_steps(reference_step(case, micro_batches), case.init(), batches))
    return _REFERENCES[key]


def clear_references() -> None:
    _REFERENCES.clear()


def compare(ref: tuple, got: tuple, rtol: float, atol: float, init=None) -> dict:
    """{"equal", "err_over_tol", "max_abs_err", "max_rel_err", "worst"} of `got` = (state,
    losses) against `ref` (see the module docstring).  With the initial state `init`, also
    "err_over_move_tol": the largest state-leaf error over the toy suite's movement-scaled
    tolerance (`benchmarks.toy.leaf_tolerance`: 1e-7 + 2^-20·max|x| + 1e-3·max|x - x0|;
    leaves the reference moves by at most NO_GRADIENT of the largest movement left out, as
    in `movement`), a stricter diagnostic (not part of `equal`) for deciding whether TOL
    could be tightened."""
    (ref_state, ref_losses), (state, losses) = ref, got
    pairs = [("loss", np.asarray(ref_losses, np.float64), np.asarray(losses, np.float64))]
    ref_flat = jax.tree_util.tree_flatten_with_path(ref_state)
    got_flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state))
    if ref_flat[1] != got_flat[1]:
        return {"equal": False, "err_over_tol": math.inf, "max_abs_err": math.inf,
                "max_rel_err": math.inf, "worst": "the state's tree differs from the reference's"}
    for (path, r), (_, g) in zip(ref_flat[0], got_flat[0]):
        pairs.append((jax.tree_util.keystr(path), np.asarray(r, np.float64),
                      np.asarray(g, np.float64)))
    worst, where, max_abs, max_rel = 0.0, None, 0.0, 0.0
    inits = ([None] + [np.asarray(x, np.float64) for x in jax.tree.leaves(init)]
             if init is not None else None)
    inexact = [True] + [np.issubdtype(np.asarray(x).dtype, np.inexact) for _, x in ref_flat[0]]
    moves = ([0.0] + [float(np.max(np.abs(r - x0))) if r.size and x0.shape == r.shape
                      and ok else 0.0
                      for (_, r, _), x0, ok in zip(pairs[1:], inits[1:], inexact[1:])]
             if inits is not None else None)
    floor = NO_GRADIENT * max(moves) if moves else 0.0
    move_ratio = 0.0
    for i, (name, r, g) in enumerate(pairs):
        if r.shape != g.shape:
            return {"equal": False, "err_over_tol": math.inf, "max_abs_err": math.inf,
                    "max_rel_err": math.inf, "worst": f"{name}: shape {g.shape} != {r.shape}"}
        if r.size == 0:
            continue
        diff = np.abs(g - r)
        diff = np.where(np.isnan(diff) & ~(np.isnan(g) & np.isnan(r)), np.inf, diff)
        diff = np.nan_to_num(diff, nan=0.0, posinf=np.inf)
        ratio = float(np.max(diff / (atol + rtol * np.abs(r))))
        if moves is not None and i > 0 and moves[i] > floor:
            move_ratio = max(move_ratio, float(np.max(diff)) / leaf_tolerance(inits[i], r))
        max_abs = max(max_abs, float(np.max(diff)))
        max_rel = max(max_rel, float(np.max(diff / np.maximum(np.abs(r), atol))))
        if where is None or ratio > worst:
            worst, where = ratio, name
    out = {"equal": bool(worst <= 1.0), "err_over_tol": worst, "max_abs_err": max_abs,
           "max_rel_err": max_rel, "worst": where}
    if inits is not None:
        out["err_over_move_tol"] = move_ratio
    return out


def stepwise(case: Case, par: Any, micro_batches: int, steps: int = STEPS) -> dict:
    """Where a run differs from the reference's trajectory, whether its steps do: `par`
    runs `steps` steps from `case.init()` again, and each is compared (`compare`) with the
    jitted reference step (averaging over `micro_batches` strided micro-batches) applied to
    the state `par` was given.  {"step_err_over_tol": the largest err/tol of one step,
    "step_worst": its step and leaf}.  Every step within tolerance while the trajectory is
    not: the reference amplifies rounding-level differences of the input state (Adam
    normalizing near-zero gradients), which no method's arithmetic order avoids: `check`
    calls that outcome "drift", not "differ" (conv_bn-92 under 2 stages, and under
    ShardParallel with the same 2 micro-batches alike: err/tol 47.4 after 3 steps, each step
    within 0.0035 of the tolerance)."""
    ref_step = reference_step(case, micro_batches)
    state, worst, where = case.init(), 0.0, None
    for i in range(steps):
        batch = case.batch(i)
        given = jax.device_get(state)   # `par` donates its input
        state, metrics = par(state, batch)
        want, want_metrics = ref_step(given, batch)
        res = compare((jax.device_get(want), [float(want_metrics["loss"])]),
                      (state, [float(metrics["loss"])]), **case.tol)
        if where is None or res["err_over_tol"] > worst:
            worst, where = res["err_over_tol"], f"step {i}: {res['worst']}"
    return {"step_err_over_tol": worst, "step_worst": where}


def movement(init_params, ref_params, rtol: float, atol: float) -> float:
    """The smallest over parameter leaves of max|ref - init| / max(atol + rtol·|ref|): how
    many tolerances the reference moves its least-moved leaf (a method that dropped that
    leaf's update would differ by about this much).  Leaves moved by at most NO_GRADIENT
    of the largest movement are left out: their gradient is 0 up to rounding (attention key
    biases: softmax ignores them), no comparison can see their update.  A diagnostic, not
    part of `equal`."""
    moves = []
    for x0, x in zip(jax.tree.leaves(init_params), jax.tree.leaves(ref_params)):
        x0, x = np.asarray(x0, np.float64), np.asarray(x, np.float64)
        if x.size:
            moves.append((float(np.max(np.abs(x - x0))), float(np.max(atol + rtol * np.abs(x)))))
    largest = max((m for m, _ in moves), default=0.0)
    return min((m / tol for m, tol in moves if m > NO_GRADIENT * largest), default=math.inf)


def fallback_key(fb: _fallbacks.Fallback) -> str:
    """A fallback's tally key: its stage and the primitive it names (else its text's head)."""
    named = re.search(r"'([\w.-]+)'", fb.what)
    return f"{fb.stage}: {named.group(1) if named else fb.what[:60]}"


def comm(seed: int) -> str:
    """The cost model `check` plans a case with by default, drawn from its seed: "local"
    (this machine's, `ClusterSpec.from_devices`) or "cheap" (tests/helpers.py's
    communication at almost no cost: the search then splits nearly every value, which
    exercises the strategies and the emitter far harder than on tiny models otherwise)."""
    return ("local", "cheap")[int(np.random.default_rng([seed, 44]).integers(2))]


def _cluster(name: str):
    if name == "local":
        return None
    if name == "cheap":
        from helpers import cheap_comm_cluster  # tests/ is on sys.path with this module

        return cheap_comm_cluster()
    raise ValueError(f"unknown comm {name!r}; expected 'local' or 'cheap'")


def check(case: Case, method_name: str, *, steps: int = STEPS,
          time_limit_s: float = TIME_LIMIT_S, comm_name: str | None = None) -> dict:
    """Runs `case` under METHODS' `method_name` (planned with the cost model `comm_name`,
    default `comm(case.seed)`) and the jitted reference; the outcome:

    {"case", "family", "method", "outcome": "equal" | "drift" (the trajectory is not, every
    step is: `stepwise`) | "differ" | "error" | "skip" | "invalid" (the reference itself is
    not finite), the `compare` fields (and `stepwise`'s where not equal), "move_over_tol"
    (`movement`), "fallbacks"
    (str of each reported fallback), "fallback_keys", "error" (type: message head, for error
    and skip), "traceback" (error), "seconds"}.  FallbackWarnings are recorded, not raised;
    every other warning follows the caller's filters.
    """
    comm_name = comm(case.seed) if comm_name is None else comm_name
    out: dict[str, Any] = {"case": case.name, "family": case.family, "method": method_name,
                           "seed": case.seed, "comm": comm_name}
    t0 = time.perf_counter()
    micro = METHODS[method_name]
    ref = reference(case, micro, steps)
    if not all(np.all(np.isfinite(x)) for x in jax.tree.leaves(ref)
               if np.issubdtype(np.asarray(x).dtype, np.inexact)):
        out.update(outcome="invalid", error="the reference run is not finite", fallbacks=[],
                   fallback_keys=[], seconds=time.perf_counter() - t0)
        return out
    out["move_over_tol"] = movement(case.init()["params"], ref[0]["params"], **case.tol)
    found: list = []
    try:
        with warnings.catch_warnings(record=True), _fallbacks.collecting() as found:
            warnings.simplefilter("always", autopar.FallbackWarning)
            cluster = _cluster(comm_name)
            kw = {} if cluster is None else {"cluster": cluster}
            budget = (tight_budget(case, method_name, time_limit_s, **kw)
                      if method_name.endswith("-tight") else None)
            par = autopar.parallelize(case.step, method=method(method_name, time_limit_s,
                                                               budget), **kw)
            if budget is not None:
                out.update(_tight_record(par, case, budget))
            got = run_steps(par, case.init(), [case.batch(i) for i in range(steps)])
            got = (jax.device_get(got[0]), got[1])
    except Exception as err:  # every failure is an outcome here
        head = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        skip = documented_skip(err, method_name)
        out.update(outcome="skip" if skip else "error", error=head,
                   traceback="" if skip else traceback.format_exc()[-4000:])
    else:
        res = compare(ref, got, init=case.init(), **case.tol)
        out.update(res, outcome="equal" if res["equal"] else "differ")
        if not res["equal"]:
            out.update(stepwise(case, par, micro, steps))
            if out["step_err_over_tol"] <= 1.0:
                out["outcome"] = "drift"
    out.update(fallbacks=[str(f) for f in found],
               fallback_keys=sorted({fallback_key(f) for f in found}),
               seconds=time.perf_counter() - t0)
    return out
