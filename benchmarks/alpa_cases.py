"""The layer families of Alpa's intra-op test suite, and the hand-written plans they expect.

Alpa's `tests/shard_parallel/` (alpa-projects/alpa: test_mlp.py, test_conv.py, test_bert.py,
test_moe.py, test_gradient_accumulation.py) states, for small models on 4 devices, the plan
an intra-op pass should find: data parallel (one all-reduce of the gradients), Megatron-style
tensor parallel (column then row splits: one all-reduce of the activations per pair), or
expert parallel (all-to-alls around the experts).  Here each case is the same model family at
the sizes Alpa's tests use (models written here in Flax: an MLP, a conv + BatchNorm stack, a
depthwise-conv stack, BERT layers and BERT MLM with a fused qkv projection cut by `jnp.split`,
a GShard MoE layer and MoE LM), with the train step a user writes, and each reference plan
is a `jax.jit` program a user would write by hand: parameter and optimizer-state layouts
(`RULES`) and a batch layout, compiled by XLA.

Every step takes ``(state, batch)`` and returns ``(new_state, loss)``; state is
``{"params", "opt"[, "batch_stats"][, "rng"]}``.  Every builder takes ``tx``: an optimizer in
place of the one Alpa's test uses (None: Alpa's).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.models.moe import MoE, MoEConfig, MoEFFN

Axes = tuple[str, ...]


# ---- models -------------------------------------------------------------------------------


class MLP(nn.Module):
    """`layers` Dense layers (ReLU between), `hidden` wide, `out` outputs."""

    layers: int
    hidden: int
    out: int
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers - 1):
            x = nn.relu(nn.Dense(self.hidden, use_bias=self.use_bias)(x))
        return nn.Dense(self.out, use_bias=self.use_bias)(x)


class ConvNet(nn.Module):
    """`layers` x (3x3 conv stride 2, BatchNorm, ReLU, 2x2 max-pool stride 1), `channel` wide."""

    layers: int
    channel: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = nn.Conv(self.channel, (3, 3), strides=(2, 2), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=False)(x))
            x = nn.max_pool(x, (2, 2), strides=(1, 1), padding="SAME")
        return x


class DepthwiseNet(nn.Module):
    """3x3 conv to 8 x `channel`, a depthwise 3x3 conv, a 3x3 conv back, ReLU, BatchNorm."""

    channel: int

    @nn.compact
    def __call__(self, x):
        wide = 8 * self.channel
        x = nn.Conv(wide, (3, 3), use_bias=False)(x)
        x = nn.Conv(wide, (3, 3), feature_group_count=wide, use_bias=False)(x)
        x = nn.Conv(self.channel, (3, 3), use_bias=False)(x)
        return nn.BatchNorm(use_running_average=False)(nn.relu(x))


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused qkv projection [H, 3, heads, head_dim], cut
    into q, k, v by `jnp.split`; `mask` [B, S] (1 = attend)."""

    hidden: int
    heads: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, mask, deterministic: bool):
        hd = self.hidden // self.heads
        qkv = nn.DenseGeneral((3, self.heads, hd), name="qkv")(x)  # [B, S, 3, h, d]
        q, k, v = (t[:, :, 0] for t in jnp.split(qkv, 3, axis=2))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        scores = scores + jnp.where(mask[:, None, None, :] > 0, 0.0, -1e9)
        probs = nn.Dropout(self.dropout)(jax.nn.softmax(scores, axis=-1),
                                         deterministic=deterministic)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return nn.DenseGeneral(self.hidden, axis=(-2, -1), name="out")(out)


class BertLayer(nn.Module):
    """Post-LayerNorm BERT layer: attention, residual + LN, 4x GELU FFN, residual + LN."""

    hidden: int
    heads: int
    dropout: float = 0.1

    @nn.compact
    def __call__(self, x, mask, deterministic: bool):
        drop = lambda t: nn.Dropout(self.dropout)(t, deterministic=deterministic)
        h = SelfAttention(self.hidden, self.heads, self.dropout, name="attention")(
            x, mask, deterministic)
        x = nn.LayerNorm(name="attention_ln")(x + drop(h))
        h = nn.gelu(nn.Dense(4 * self.hidden, name="intermediate")(x))
        return nn.LayerNorm(name="output_ln")(x + drop(nn.Dense(self.hidden, name="output")(h)))


class BertLayers(nn.Module):
    """`layers` BERT layers on hidden states [B, S, H]."""

    layers: int
    hidden: int
    heads: int

    @nn.compact
    def __call__(self, x, mask, deterministic: bool = False):
        for i in range(self.layers):
            x = BertLayer(self.hidden, self.heads, name=f"layer_{i}")(x, mask, deterministic)
        return x


class BertMLM(nn.Module):
    """BERT for masked-LM: word, position and token-type embeddings, `layers` BERT layers,
    a dense + GELU + LN transform, logits from the tied word embedding plus a bias."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int

    @nn.compact
    def __call__(self, ids, mask, deterministic: bool = False):
        word = nn.Embed(self.vocab, self.hidden, name="word_embeddings")
        pos = nn.Embed(self.seq, self.hidden, name="position_embeddings")
        kind = nn.Embed(2, self.hidden, name="token_type_embeddings")
        x = word(ids) + pos(jnp.arange(ids.shape[1])[None]) + kind(jnp.zeros_like(ids))
        x = nn.Dropout(0.1)(nn.LayerNorm(name="embeddings_ln")(x), deterministic=deterministic)
        for i in range(self.layers):
            x = BertLayer(self.hidden, self.heads, name=f"layer_{i}")(x, mask, deterministic)
        x = nn.LayerNorm(name="transform_ln")(nn.gelu(nn.Dense(self.hidden,
                                                               name="transform")(x)))
        bias = self.param("decoder_bias", nn.initializers.zeros, (self.vocab,))
        return word.attend(x) + bias


class MoELayer(nn.Module):
    """Alpa's MoE layer: self-attention, residual + LN, a GShard top-2 MoE FFN
    (`autopar.models.moe.MoEFFN`), residual + LN."""

    cfg: MoEConfig

    @nn.compact
    def __call__(self, x, mask, deterministic: bool = True):
        h = SelfAttention(self.cfg.hidden, self.cfg.heads, name="attention")(
            x, mask, deterministic)
        x = nn.LayerNorm(name="attention_ln")(x + h)
        return nn.LayerNorm(name="output_ln")(x + MoEFFN(self.cfg, name="moe")(x))


# ---- train steps --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Built:
    """A case's step and its first arguments."""

    step: Callable
    state: dict
    batch: dict


def _apply_updates(tx, state: dict, grads) -> dict:
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {**state, "params": optax.apply_updates(state["params"], updates), "opt": opt}


def _regression(model: nn.Module, tx, x: jax.Array, y: jax.Array, seed: int = 0,
                value_and_grad: Callable = jax.value_and_grad) -> Built:
    """MSE on model(x) vs y (Alpa's MLP and conv tests), BatchNorm statistics if any."""
    variables = model.init(jax.random.PRNGKey(seed), x)
    params, stats = variables["params"], variables.get("batch_stats")

    def step(state, batch):
        def loss_fn(p):
            if stats is None:
                return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2), None
            out, new = model.apply({"params": p, "batch_stats": state["batch_stats"]},
                                   batch["x"], mutable=["batch_stats"])
            return jnp.mean((out - batch["y"]) ** 2), new["batch_stats"]

        (loss, new_stats), grads = value_and_grad(loss_fn, has_aux=True)(state["params"])
        new_state = _apply_updates(tx, state, grads)
        if stats is not None:
            new_state["batch_stats"] = new_stats
        return new_state, loss

    state = {"params": params, "opt": tx.init(params)}
    if stats is not None:
        state["batch_stats"] = stats
    return Built(step, state, {"x": x, "y": y})


def _ramp(shape: Sequence[int], scale: float = 1.0) -> jax.Array:
    """A deterministic, non-constant float32 input."""
    n = int(np.prod(shape))
    return jnp.asarray(np.sin(np.arange(n, dtype=np.float32) * 0.37).reshape(shape) * scale)


def mlp(layers: int, batch: int, hidden: int, tx=None) -> Built:
    """Alpa's test_n_layer_mlp_*: MSE, Adam."""
    return _regression(MLP(layers, hidden, hidden), tx or optax.adam(1e-2),
                       _ramp((batch, hidden)), _ramp((batch, hidden), 0.5))


def mlp_momentum(layers: int, batch: int, hidden: int, tx=None) -> Built:
    """Alpa's test_gradient_accumulation: MSE, SGD with momentum; the gradients taken with
    `autopar.value_and_grad`, which marks the per-micro-batch part of the step (plain
    `jax.value_and_grad` outside `parallelize`)."""
    return _regression(MLP(layers, hidden, hidden), tx or optax.sgd(1e-2, momentum=0.9),
                       _ramp((batch, hidden)), _ramp((batch, hidden), 0.5),
                       value_and_grad=autopar.value_and_grad)


def conv(layers: int, batch: int, image: int, channel: int, tx=None) -> Built:
    """Alpa's test_n_layer_conv_*: MSE, SGD momentum 0.9, BatchNorm in training mode."""
    out = image // 2 ** layers
    return _regression(ConvNet(layers, channel), tx or optax.sgd(0.1, momentum=0.9),
                       _ramp((batch, image, image, channel)),
                       _ramp((batch, out, out, channel), 0.5))


def depthwise(batch: int, image: int, channel: int, tx=None) -> Built:
    """Alpa's test_n_layer_depthwise_conv_model_parallel."""
    return _regression(DepthwiseNet(channel), tx or optax.sgd(0.1, momentum=0.9),
                       _ramp((batch, image, image, channel)),
                       _ramp((batch, image, image, channel), 0.5))


def _rng_step(model: nn.Module, tx, loss_of: Callable, inputs: dict, seed: int = 0) -> Built:
    """A step with dropout: the key lives in the state and is split every step."""
    params = model.init(jax.random.PRNGKey(seed), *inputs["args"](inputs), deterministic=True)
    params = params["params"]

    def step(state, batch):
        rng, drop = jax.random.split(state["rng"])

        def loss_fn(p):
            out = model.apply({"params": p}, *inputs["args"](batch), deterministic=False,
                              rngs={"dropout": drop})
            return loss_of(out, batch)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        return {**_apply_updates(tx, state, grads), "rng": rng}, loss

    state = {"params": params, "opt": tx.init(params), "rng": jax.random.PRNGKey(seed + 1)}
    batch = {k: v for k, v in inputs.items() if k != "args"}
    return Built(step, state, batch)


def bert_layers(batch: int, seq: int, layers: int, hidden: int, heads: int, tx=None) -> Built:
    """Alpa's test_bert_layer_*: MSE on the hidden states, dropout on, Adam."""
    inputs = {"x": _ramp((batch, seq, hidden)), "mask": jnp.ones((batch, seq), jnp.int32),
              "y": _ramp((batch, seq, hidden), 0.5), "args": lambda b: (b["x"], b["mask"])}
    return _rng_step(BertLayers(layers, hidden, heads), tx or optax.adam(1e-2),
                     lambda out, b: jnp.mean((out - b["y"]) ** 2), inputs)


def _masked_lm_loss(logits, b):
    labels = b["labels"]
    weight = jnp.where(labels > 0, 1.0, 0.0)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(weight * nll) / jnp.maximum(jnp.sum(weight), 1.0)


def _tokens(shape: Sequence[int], vocab: int, salt: int) -> jax.Array:
    n = int(np.prod(shape))
    return jnp.asarray(((np.arange(n) * 7 + salt) % vocab).reshape(shape), jnp.int32)


def bert_mlm(batch: int, seq: int, layers: int, hidden: int, heads: int, vocab: int,
             tx=None) -> Built:
    """Alpa's test_bert_mlm_*: masked-LM cross-entropy, dropout on, Adam."""
    inputs = {"ids": _tokens((batch, seq), vocab, 1), "mask": jnp.ones((batch, seq), jnp.int32),
              "labels": _tokens((batch, seq), vocab, 3), "args": lambda b: (b["ids"], b["mask"])}
    return _rng_step(BertMLM(layers, hidden, heads, vocab, seq), tx or optax.adam(1e-2),
                     _masked_lm_loss, inputs)


def moe_layer(batch: int, seq: int, hidden: int, heads: int, group: int, experts: int,
              tx=None) -> Built:
    """Alpa's test_moe_layer: MSE on the hidden states, Adam, no dropout."""
    cfg = MoEConfig(hidden, 1, experts, heads=heads, seq=seq, group=group, ffn=4,
                    dtype="float32", remat=False)
    model, tx = MoELayer(cfg), tx or optax.adam(1e-2)
    x, mask = _ramp((batch, seq, hidden)), jnp.ones((batch, seq), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), x, mask)["params"]

    def step(state, batch):
        def loss_fn(p):
            out = model.apply({"params": p}, batch["x"], batch["mask"])
            return jnp.mean((out - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        return _apply_updates(tx, state, grads), loss

    state = {"params": params, "opt": tx.init(params)}
    return Built(step, state, {"x": x, "mask": mask, "y": _ramp((batch, seq, hidden), 0.5)})


def moe_lm(batch: int, seq: int, layers: int, hidden: int, heads: int, vocab: int,
           group: int, experts: int, tx=None) -> Built:
    """Alpa's test_moe_lm: a GShard decoder (odd blocks MoE; `autopar.models.moe.MoE`),
    masked cross-entropy, Adafactor (min_dim_size_to_factor=4, as Alpa's test)."""
    cfg = MoEConfig(hidden, layers, experts, heads=heads, vocab=vocab, seq=seq, group=group,
                    ffn=4, dtype="float32", remat=False)
    model = MoE(cfg)
    tx = tx or optax.adafactor(1e-2, min_dim_size_to_factor=4)
    ids, labels = _tokens((batch, seq), vocab, 1), _tokens((batch, seq), vocab, 3)
    params = model.init(jax.random.PRNGKey(0), ids)["params"]

    def step(state, batch):
        def loss_fn(p):
            return _masked_lm_loss(model.apply({"params": p}, batch["ids"]), batch)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        return _apply_updates(tx, state, grads), loss

    return Built(step, {"params": params, "opt": tx.init(params)},
                 {"ids": ids, "labels": labels})


# ---- hand-written layouts -----------------------------------------------------------------


def _split(ndim: int, dim: int, axes: Axes) -> tuple:
    out: list = [None] * ndim
    out[dim % ndim] = axes
    return tuple(out)


def _even(match: re.Match) -> bool:
    return int(match.group(1)) % 2 == 0


# Megatron-LM's layouts (Shoeybi et al. 2019): the first matmul of each pair split on its
# output features (column), the second on its input features (row); attention split by
# heads; the (tied) word embedding by vocabulary; BatchNorm after a column-split conv split
# by channel; experts split by expert.  (regex on the leaf path, rule (match, ndim, tp)).
MEGATRON: tuple[tuple[str, Callable[[re.Match, int, Axes], tuple]], ...] = (
    (r"Dense_(\d+)/kernel$", lambda m, n, tp: _split(n, -1 if _even(m) else -2, tp)),
    (r"Dense_(\d+)/bias$", lambda m, n, tp: _split(n, -1, tp) if _even(m) else (None,) * n),
    (r"Conv_(\d+)/kernel$", lambda m, n, tp: _split(n, -1 if _even(m) else -2, tp)),
    (r"BatchNorm_(\d+)/(scale|bias|mean|var)$",
     lambda m, n, tp: _split(n, -1, tp) if _even(m) else (None,) * n),
    (r"qkv/kernel$", lambda m, n, tp: _split(n, 2, tp)),
    (r"qkv/bias$", lambda m, n, tp: _split(n, 1, tp)),
    (r"attention/out/kernel$", lambda m, n, tp: _split(n, 0, tp)),
    (r"intermediate/(kernel|bias)$", lambda m, n, tp: _split(n, -1, tp)),
    (r"/output/kernel$", lambda m, n, tp: _split(n, 0, tp)),
    (r"word_embeddings/embedding$", lambda m, n, tp: _split(n, 0, tp)),
    (r"decoder_bias$", lambda m, n, tp: _split(n, 0, tp)),
    (r"moe/(wi|wo)$", lambda m, n, tp: _split(n, 0, tp)),
)
# The depthwise stack (conv out, depthwise, conv in): the middle conv splits its channels.
DEPTHWISE_MEGATRON = (
    (r"Conv_(\d+)/kernel$", lambda m, n, tp: _split(n, -2 if m.group(1) == "2" else -1, tp)),
)
# Expert parallelism (GShard): experts split, everything else replicated.
EXPERTS = ((r"moe/(wi|wo)$", lambda m, n, tp: _split(n, 0, tp)),)


def leaf_name(path) -> str:
    """'params/Dense_0/kernel' for a tree path (dict keys, attributes and indices)."""
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return "/".join(parts)


def layout(tree: Any, rules, tp: Axes, mesh: Mesh) -> Any:
    """A NamedSharding per leaf of `tree` on `mesh`, by the first rule matching its path
    (the leaf split over the tensor-parallel axes `tp`); a leaf no rule matches, or whose
    split dim the axes do not divide, stays replicated."""
    shards = int(np.prod([mesh.shape[a] for a in tp])) if tp else 1

    def spec(path, leaf) -> NamedSharding:
        ndim, name = np.ndim(leaf), leaf_name(path)
        out = (None,) * ndim
        for pattern, rule in rules:
            m = re.search(pattern, name)
            if m and ndim:
                want = rule(m, ndim, tp)
                if all(e is None or np.shape(leaf)[d] % shards == 0 for d, e in enumerate(want)):
                    out = want
                break
        return NamedSharding(mesh, P(*out))

    return jax.tree_util.tree_map_with_path(spec, tree)
