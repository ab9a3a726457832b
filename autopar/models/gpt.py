"""GPT (Flax decoder) with the Alpa paper's configurations (Zheng et al., OSDI'22, Table 4):
vocab 51200, seq 1024, name → (hidden, layers, heads); and the model FLOPs of a step."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A GPT's shape: `hidden` width, `layers` blocks, `heads` attention heads, `vocab`
    tokens, `seq` positions; `dtype` of the activations; `remat` rematerializes every block
    in the backward; `tied` reads the logits from the token embedding (else an untied
    bias-free `nn.Dense` head); `param_dtype` the parameters are stored in (below float32
    the zoo's train step keeps a float32 master copy in the optimizer state: mixed
    precision as Alpa's GPT benchmark trains, `TrainState(use_master_copy=True)`);
    `optimizer` the train step's optimizer by name (`autopar.models.optimizers`)."""

    hidden: int
    layers: int
    heads: int
    vocab: int = 51200
    seq: int = 1024
    dtype: str = "float16"
    remat: bool = True
    tied: bool = True
    param_dtype: str = "float32"
    optimizer: str = "adamw"


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

# The demo's and the tests' GPT (vocab 64, seq 16, hidden 32, 2 layers, 4 heads, float32, no
# remat): seconds on CPU.  Not a benchmark size, so not in `GPT_CONFIGS`.
GPT_TINY = GPTConfig(32, 2, 4, vocab=64, seq=16, dtype="float32", remat=False)


class _Block(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x, mask):
        dt, pt = jnp.dtype(self.cfg.dtype), jnp.dtype(self.cfg.param_dtype)
        h = nn.LayerNorm(dtype=dt, param_dtype=pt)(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.cfg.heads, dtype=dt,
                                            param_dtype=pt)(h, h, mask=mask)
        x = x + h
        h = nn.LayerNorm(dtype=dt, param_dtype=pt)(x)
        h = nn.Dense(4 * self.cfg.hidden, dtype=dt, param_dtype=pt)(h)
        h = nn.Dense(self.cfg.hidden, dtype=dt, param_dtype=pt)(nn.gelu(h))
        return x + h


class GPT(nn.Module):
    """A decoder: token + position embeddings, `cfg.layers` blocks (`block(i)`), a final
    LayerNorm, and logits from the tied embedding (`cfg.tied`, else a Dense head).

    tokens int32 [batch, seq ≤ cfg.seq] → logits float32 [batch, seq, vocab]."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        dt, pt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        embed = nn.Embed(cfg.vocab, cfg.hidden, dtype=dt, param_dtype=pt)
        pos = self.param("pos", nn.initializers.normal(0.02), (cfg.seq, cfg.hidden), pt)
        x = embed(tokens) + pos[: tokens.shape[1]].astype(dt)
        mask = nn.make_causal_mask(tokens)
        for i in range(cfg.layers):
            x = self.block(i)(x, mask)
        x = nn.LayerNorm(dtype=dt, param_dtype=pt)(x)
        logits = embed.attend(x) if cfg.tied else nn.Dense(cfg.vocab, use_bias=False,
                                                           dtype=dt, param_dtype=pt)(x)
        return logits.astype(jnp.float32)

    def block(self, i: int) -> nn.Module:
        """Block `i` (rematerialized when `cfg.remat`)."""
        return (nn.remat(_Block) if self.cfg.remat else _Block)(self.cfg)


def gpt_flops_per_step(cfg: GPTConfig, batch: int) -> float:
    """Model FLOPs of one training step (forward + backward, no recomputation), the formula
    of Narayanan et al. (SC'21, eq. 3) that the Alpa paper uses for GPT:
    72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))."""
    b, s, layer, h, v = batch, cfg.seq, cfg.layers, cfg.hidden, cfg.vocab
    return 72.0 * b * s * layer * h * h * (1 + s / (6 * h) + v / (12 * layer * h))

