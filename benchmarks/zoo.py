"""Benchmark model zoo (Flax) with the Alpa paper's configurations (Zheng et al., OSDI'22,
Table 4 and §8.1).

* GPT (vocab 51200, seq 1024): name → (hidden, layers, heads).
* GShard MoE (vocab 32000, seq 1024, expert group 2048 tokens, 16 heads, FFN 8 x hidden,
  top-2 routing, every other block's FFN is a mixture of experts): name → (hidden, layers,
  experts).  With these the parameter counts match the names (380M … 70B).
* Wide-ResNet (image 224, 50 layers = bottleneck stages (3, 4, 6, 3), fp32, 1024 classes):
  name → (channels, width factor); the width factor widens each block's 3x3 convolution's
  output, which gives the names' parameter counts (250M … 6.8B).

Every block is rematerialized in the backward (`nn.remat`; `remat=False` turns it off), as
in the Alpa paper's benchmarks and Megatron-LM's large runs.  Every family has a `toy` size
for real runs on CPU.  `train_step_and_args(name, batch)`
returns a plain train step (AdamW, gradients via autopar.value_and_grad) and abstract
arguments (`jax.ShapeDtypeStruct`s), so planning needs no memory for the weights.
`flops_per_step(name, batch)` is the model FLOP count used for TFLOP/s (see each formula).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import autopar


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    hidden: int
    layers: int
    heads: int
    vocab: int = 51200
    seq: int = 1024
    dtype: str = "float16"
    remat: bool = True


GPT_CONFIGS: dict[str, GPTConfig] = {
    "gpt-toy": GPTConfig(64, 4, 4, vocab=256, seq=32, dtype="float32"),
    "gpt-125m": GPTConfig(768, 12, 12),
    "gpt-350m": GPTConfig(1024, 24, 16),
    "gpt-760m": GPTConfig(1536, 24, 16),
    "gpt-1.3b": GPTConfig(2048, 24, 32),
    "gpt-2.6b": GPTConfig(2560, 32, 32),
    "gpt-6.7b": GPTConfig(4096, 32, 32),
    "gpt-15b": GPTConfig(5120, 48, 40),
    "gpt-39b": GPTConfig(8192, 48, 64),
}


class _Block(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x, mask):
        dt = jnp.dtype(self.cfg.dtype)
        h = nn.LayerNorm(dtype=dt)(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.cfg.heads, dtype=dt)(h, h, mask=mask)
        x = x + h
        h = nn.LayerNorm(dtype=dt)(x)
        h = nn.Dense(4 * self.cfg.hidden, dtype=dt)(h)
        h = nn.Dense(self.cfg.hidden, dtype=dt)(nn.gelu(h))
        return x + h


class GPT(nn.Module):
    """A decoder: token + position embeddings, `cfg.layers` blocks (`block(i)`), a final
    LayerNorm, and logits from the tied embedding."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        embed = nn.Embed(cfg.vocab, cfg.hidden, dtype=dt)
        pos = self.param("pos", nn.initializers.normal(0.02), (cfg.seq, cfg.hidden))
        x = embed(tokens) + pos[: tokens.shape[1]].astype(dt)
        mask = nn.make_causal_mask(tokens)
        for i in range(cfg.layers):
            x = self.block(i)(x, mask)
        x = nn.LayerNorm(dtype=dt)(x)
        return embed.attend(x).astype(jnp.float32)

    def block(self, i: int) -> nn.Module:
        """Block `i` (rematerialized when `cfg.remat`)."""
        return (nn.remat(_Block) if self.cfg.remat else _Block)(self.cfg)


def gpt_flops_per_step(cfg: GPTConfig, batch: int) -> float:
    """Model FLOPs of one training step (forward + backward, no recomputation), the formula
    of Narayanan et al. (SC'21, eq. 3) that the Alpa paper uses for GPT:
    72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))."""
    b, s, layer, h, v = batch, cfg.seq, cfg.layers, cfg.hidden, cfg.vocab
    return 72.0 * b * s * layer * h * h * (1 + s / (6 * h) + v / (12 * layer * h))


def gpt_train_step(cfg: GPTConfig | MoEConfig, value_and_grad: Callable | None = None
                   ) -> tuple[Callable, nn.Module, optax.GradientTransformation]:
    """AdamW train step of a token model (GPT or MoE): next-token cross-entropy.
    `value_and_grad` defaults to `autopar.value_and_grad` (a reference may swap it)."""
    grad_fn = value_and_grad or autopar.value_and_grad
    model = GPT(cfg) if isinstance(cfg, GPTConfig) else MoE(cfg)
    tx = optax.adamw(1e-4)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    def train_step(state, batch):
        loss, grads = grad_fn(loss_fn)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, {"loss": loss}

    return train_step, model, tx




# ----------------------------------------------------------------------------- GShard MoE


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    hidden: int
    layers: int
    experts: int
    heads: int = 16
    vocab: int = 32000
    seq: int = 1024
    group: int = 2048
    ffn: int = 8
    dtype: str = "float16"
    remat: bool = True


MOE_CONFIGS: dict[str, MoEConfig] = {
    "moe-toy": MoEConfig(64, 4, 4, heads=4, vocab=256, seq=32, group=32, dtype="float32"),
    "moe-380m": MoEConfig(768, 8, 8),
    "moe-690m": MoEConfig(768, 8, 16),
    "moe-1.3b": MoEConfig(768, 16, 16),
    "moe-2.4b": MoEConfig(1024, 16, 16),
    "moe-10b": MoEConfig(1536, 16, 32),
    "moe-27b": MoEConfig(2048, 16, 48),
    "moe-70b": MoEConfig(2048, 32, 64),
}


class MoEFFN(nn.Module):
    """GShard top-2 mixture of experts (Lepikhin et al., ICLR'21) with expert capacity
    C = 2·group / experts: tokens are routed in groups of `group`; a token's k-th choice is
    dropped when its expert already holds C tokens of the group.  Dispatch and combine are
    einsums with one-hot [G, S, E, C] masks, so the experts dim is an ordinary array dim
    the sharding pass can split (expert parallelism)."""

    cfg: MoEConfig

    @nn.compact
    def __call__(self, x):  # [B, S, M]
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        b, s, m = x.shape
        group = min(cfg.group, b * s)
        g, e = b * s // group, cfg.experts
        cap = max(1, 2 * group // e)
        xg = x.reshape(g, group, m)
        probs = jax.nn.softmax(nn.Dense(e, use_bias=False, dtype=jnp.float32, name="gate")(
            xg.astype(jnp.float32)), axis=-1)  # [G, S, E]
        top_p, top_i = jax.lax.top_k(probs, 2)  # [G, S, 2]
        masks = jax.nn.one_hot(top_i, e, dtype=jnp.float32)  # [G, S, 2, E]
        first = masks[:, :, 0]
        pos1 = jnp.cumsum(first, axis=1) - first
        pos2 = jnp.cumsum(masks[:, :, 1], axis=1) - masks[:, :, 1] + first.sum(1, keepdims=True)
        dispatch = combine = 0.0
        for k, pos in ((0, pos1), (1, pos2)):
            keep = masks[:, :, k] * (pos < cap)  # [G, S, E]
            slot = jax.nn.one_hot(jnp.sum(pos * keep, -1).astype(jnp.int32), cap)  # [G, S, C]
            d = keep[..., None] * slot[:, :, None, :]  # [G, S, E, C]
            dispatch = dispatch + d
            combine = combine + d * top_p[:, :, k, None, None]
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        wi = self.param("wi", init, (e, m, cfg.ffn * m))
        wo = self.param("wo", init, (e, cfg.ffn * m, m))
        xe = jnp.einsum("gsec,gsm->egcm", dispatch.astype(dt), xg.astype(dt))
        h = nn.gelu(jnp.einsum("egcm,emh->egch", xe, wi.astype(dt)))
        ye = jnp.einsum("egch,ehm->egcm", h, wo.astype(dt))
        y = jnp.einsum("gsec,egcm->gsm", combine.astype(dt), ye)
        return y.reshape(b, s, m)


class _MoEBlock(nn.Module):
    cfg: MoEConfig
    expert: bool

    @nn.compact
    def __call__(self, x, mask):
        dt = jnp.dtype(self.cfg.dtype)
        h = nn.LayerNorm(dtype=dt)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.cfg.heads, dtype=dt)(
            h, h, mask=mask)
        h = nn.LayerNorm(dtype=dt)(x)
        if self.expert:
            return x + MoEFFN(self.cfg)(h)
        h = nn.Dense(self.cfg.ffn * self.cfg.hidden, dtype=dt)(h)
        return x + nn.Dense(self.cfg.hidden, dtype=dt)(nn.gelu(h))


class MoE(GPT):
    """GPT-style decoder whose odd blocks use `MoEFFN` (GShard's every-other-layer MoE)."""

    cfg: MoEConfig

    def block(self, i: int) -> nn.Module:
        block = nn.remat(_MoEBlock, static_argnums=()) if self.cfg.remat else _MoEBlock
        return block(self.cfg, expert=i % 2 == 1)


def moe_flops_per_step(cfg: MoEConfig, batch: int) -> float:
    """Model FLOPs of one MoE training step: 3 x the forward's matmul FLOPs (backward = 2 x
    forward, no recomputation; the counting of Narayanan et al. eq. 3), derived here from
    the layer definition above.  Per token and block: attention projections 8h² and
    scores/context 4·s·h; a dense FFN 4·f·h² (f = FFN factor); an MoE FFN 2 x 4·f·h² (top-2
    capacity slots), gate 2·h·E, dispatch + combine einsums 2 x 2·E·C·h = 8·group·h;
    logits 2·h·V."""
    b, s, h, layers = batch, cfg.seq, cfg.hidden, cfg.layers
    group = min(cfg.group, b * s)
    e, f = cfg.experts, cfg.ffn
    dense = 8 * h * h + 4 * s * h + 4 * f * h * h
    moe = 8 * h * h + 4 * s * h + 8 * f * h * h + 2 * h * e + 8 * group * h
    n_moe = layers // 2
    per_token = (layers - n_moe) * dense + n_moe * moe + 2 * h * cfg.vocab
    return 3.0 * b * s * per_token


# ----------------------------------------------------------------------------- Wide-ResNet


@dataclasses.dataclass(frozen=True)
class WRNConfig:
    channels: int
    width: int
    stages: tuple[int, ...] = (3, 4, 6, 3)
    image: int = 224
    classes: int = 1024
    dtype: str = "float32"
    remat: bool = True


WRN_CONFIGS: dict[str, WRNConfig] = {
    "wrn-toy": WRNConfig(8, 2, stages=(1, 1, 1, 1), image=32, classes=16),
    "wrn-250m": WRNConfig(160, 2),
    "wrn-500m": WRNConfig(224, 2),
    "wrn-1b": WRNConfig(320, 2),
    "wrn-2b": WRNConfig(448, 2),
    "wrn-4b": WRNConfig(640, 2),
    "wrn-6.8b": WRNConfig(320, 16),
}


def _wrn_convs(cfg: WRNConfig) -> list[tuple[int, int, int, int]]:
    """(output spatial size, in channels, out channels, kernel size) of every convolution,
    in order (the architecture the model below builds): a 7x7/2 stem and a 3x3/2 max pool,
    then bottleneck blocks 1x1 (m = channels·2^i) → 3x3 (m·width, stride 2 on a stage's
    first block after the first stage) → 1x1 (4m), with a 1x1 projection on each stage's
    first block."""
    size = cfg.image // 2
    convs = [(size, 3, cfg.channels, 7)]
    size //= 2
    cin = cfg.channels
    for i, blocks in enumerate(cfg.stages):
        mid, out = cfg.channels * 2 ** i, 4 * cfg.channels * 2 ** i
        for j in range(blocks):
            stride = 2 if i > 0 and j == 0 else 1
            convs.append((size, cin, mid, 1))
            size //= stride
            convs.append((size, mid, mid * cfg.width, 3))
            convs.append((size, mid * cfg.width, out, 1))
            if j == 0:
                convs.append((size, cin, out, 1))
            cin = out
    return convs


def wrn_flops_per_step(cfg: WRNConfig, batch: int) -> float:
    """Model FLOPs of one Wide-ResNet training step: 3 x the forward's convolution and dense
    FLOPs (2·H·W·k²·C_in·C_out per conv per image), as for GPT; BatchNorm and pooling are
    left out, as matmul-only counts do."""
    convs = sum(2 * s * s * k * k * ci * co for s, ci, co, k in _wrn_convs(cfg))
    dense = 2 * 4 * cfg.channels * 2 ** (len(cfg.stages) - 1) * cfg.classes
    return 3.0 * batch * (convs + dense)


class _Bottleneck(nn.Module):
    mid: int
    width: int
    out: int
    stride: int
    project: bool

    @nn.compact
    def __call__(self, x):
        bn = lambda: nn.BatchNorm(use_running_average=False, momentum=0.9)
        y = nn.relu(bn()(nn.Conv(self.mid, (1, 1), use_bias=False)(x)))
        y = nn.relu(bn()(nn.Conv(self.mid * self.width, (3, 3), (self.stride, self.stride),
                                 use_bias=False)(y)))
        y = bn()(nn.Conv(self.out, (1, 1), use_bias=False)(y))
        if self.project:
            x = bn()(nn.Conv(self.out, (1, 1), (self.stride, self.stride), use_bias=False)(x))
        return nn.relu(x + y)


class WideResNet(nn.Module):
    """ResNet-50-style network of bottleneck blocks with widened 3x3 convolutions (Zagoruyko &
    Komodakis, 2016; the Alpa benchmark's variant), NHWC."""

    cfg: WRNConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        x = nn.Conv(cfg.channels, (7, 7), (2, 2), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9)(x))
        x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
        block = nn.remat(_Bottleneck) if cfg.remat else _Bottleneck
        for i, blocks in enumerate(cfg.stages):
            for j in range(blocks):
                stride = 2 if i > 0 and j == 0 else 1
                x = block(cfg.channels * 2 ** i, cfg.width, 4 * cfg.channels * 2 ** i,
                                stride, j == 0)(x)
        return nn.Dense(cfg.classes)(x.mean(axis=(1, 2)))


def wrn_train_step(cfg: WRNConfig, value_and_grad: Callable | None = None
                   ) -> tuple[Callable, WideResNet, optax.GradientTransformation]:
    """AdamW train step with BatchNorm statistics carried in the state."""
    grad_fn = value_and_grad or autopar.value_and_grad
    model = WideResNet(cfg)
    tx = optax.adamw(1e-4)

    def loss_fn(params, batch_stats, batch):
        logits, mutated = model.apply({"params": params, "batch_stats": batch_stats},
                                      batch["images"], mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
        return loss, mutated["batch_stats"]

    def train_step(state, batch):
        (loss, stats), grads = grad_fn(loss_fn, has_aux=True)(
            state["params"], state["batch_stats"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state, "batch_stats": stats}, {"loss": loss}

    return train_step, model, tx


# ----------------------------------------------------------------------------- registry


CONFIGS: dict[str, GPTConfig | MoEConfig | WRNConfig] = {
    **GPT_CONFIGS, **MOE_CONFIGS, **WRN_CONFIGS}


def config(name: str) -> GPTConfig | MoEConfig | WRNConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(CONFIGS)}")
    return CONFIGS[name]


def flops_per_step(name: str, batch: int) -> float:
    """Model FLOPs of one training step of zoo model `name` at global batch `batch`."""
    cfg = config(name)
    rule = {GPTConfig: gpt_flops_per_step, MoEConfig: moe_flops_per_step,
            WRNConfig: wrn_flops_per_step}[type(cfg)]
    return rule(cfg, batch)


def param_count(name: str) -> int:
    """Number of parameters (from abstract initialization)."""
    state = _abstract_state(name)
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(state["params"]))


def _model(name: str, value_and_grad: Callable | None = None):
    cfg = config(name)
    if isinstance(cfg, WRNConfig):
        return wrn_train_step(cfg, value_and_grad)
    return gpt_train_step(cfg, value_and_grad)


def _example_input(name: str, batch: int) -> dict:
    cfg = config(name)
    if isinstance(cfg, WRNConfig):
        return {"images": jax.ShapeDtypeStruct((batch, cfg.image, cfg.image, 3), jnp.float32),
                "labels": jax.ShapeDtypeStruct((batch,), jnp.int32)}
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq), jnp.int32)
    return {"tokens": tokens, "labels": tokens}


def _abstract_state(name: str) -> dict:
    _, model, tx = _model(name)
    example = {k: jnp.zeros((1,) + v.shape[1:], v.dtype)
               for k, v in _example_input(name, 1).items()}
    key = "images" if "images" in example else "tokens"

    def init():
        variables = model.init(jax.random.key(0), example[key])
        state = {"params": variables["params"], "opt_state": tx.init(variables["params"])}
        if "batch_stats" in variables:
            state["batch_stats"] = variables["batch_stats"]
        return state

    return jax.eval_shape(init)


def train_step_and_args(name: str, batch: int, value_and_grad: Callable | None = None):
    """(train_step, (abstract_state, abstract_batch)) for a zoo model at global batch size;
    `value_and_grad` replaces `autopar.value_and_grad` in the step (e.g. a reference)."""
    step = _model(name, value_and_grad)[0]
    return step, (_abstract_state(name), _example_input(name, batch))


def init_state(name: str, seed: int = 0) -> dict:
    """Concrete initial state (for toy sizes: real runs on CPU)."""
    _, model, tx = _model(name)
    abstract = _abstract_state(name)
    example = {k: jnp.zeros((1,) + v.shape[1:], v.dtype)
               for k, v in _example_input(name, 1).items()}
    key = "images" if "images" in example else "tokens"
    variables = model.init(jax.random.key(seed), example[key])
    state = {"params": variables["params"], "opt_state": tx.init(variables["params"])}
    if "batch_stats" in variables:
        state["batch_stats"] = variables["batch_stats"]
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(abstract)
    return state


def example_batch(name: str, batch: int, seed: int = 1) -> dict:
    """A concrete random batch (for toy sizes)."""
    cfg = config(name)
    k1, k2 = jax.random.split(jax.random.key(seed))
    if isinstance(cfg, WRNConfig):
        return {"images": jax.random.normal(k1, (batch, cfg.image, cfg.image, 3)),
                "labels": jax.random.randint(k2, (batch,), 0, cfg.classes)}
    tokens = jax.random.randint(k1, (batch, cfg.seq), 0, cfg.vocab)
    return {"tokens": tokens, "labels": jnp.roll(tokens, -1, axis=1)}
