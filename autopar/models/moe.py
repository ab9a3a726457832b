"""GShard mixture-of-experts decoder (Lepikhin et al., ICLR'21) with the Alpa paper's
configurations (Zheng et al., OSDI'22, Table 4): vocab 32000, seq 1024, expert group 2048
tokens, 16 heads, FFN 8 x hidden, top-2 routing, every other block's FFN is a mixture of
experts; name → (hidden, layers, experts).  With these the parameter counts match the names
(380M … 70B).  And the model FLOPs of a step."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from autopar.models.gpt import GPT


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """An MoE decoder's shape: `hidden` width, `layers` blocks (odd ones MoE), `experts` per
    MoE FFN, `heads`, `vocab`, `seq`; tokens are routed in groups of `group`; the FFNs are
    `ffn` x hidden wide; `dtype`, `remat`, `tied`, `param_dtype` and `optimizer` as in
    `GPTConfig`."""

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
    tied: bool = True
    param_dtype: str = "float32"
    optimizer: str = "adamw"


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
    the sharding pass can split (expert parallelism).

    x [B, S, M] → [B, S, M]; uses `cfg.experts`, `cfg.group`, `cfg.ffn`, `cfg.dtype`."""

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
        pt = jnp.dtype(cfg.param_dtype)
        probs = jax.nn.softmax(nn.Dense(e, use_bias=False, dtype=jnp.float32, param_dtype=pt,
                                        name="gate")(
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
        wi = self.param("wi", init, (e, m, cfg.ffn * m), pt)
        wo = self.param("wo", init, (e, cfg.ffn * m, m), pt)
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
        dt, pt = jnp.dtype(self.cfg.dtype), jnp.dtype(self.cfg.param_dtype)
        h = nn.LayerNorm(dtype=dt, param_dtype=pt)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.cfg.heads, dtype=dt,
                                                param_dtype=pt)(h, h, mask=mask)
        h = nn.LayerNorm(dtype=dt, param_dtype=pt)(x)
        if self.expert:
            return x + MoEFFN(self.cfg)(h)
        h = nn.Dense(self.cfg.ffn * self.cfg.hidden, dtype=dt, param_dtype=pt)(h)
        return x + nn.Dense(self.cfg.hidden, dtype=dt, param_dtype=pt)(nn.gelu(h))


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
