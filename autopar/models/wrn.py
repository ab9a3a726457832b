"""Wide-ResNet with the Alpa paper's configurations (Zheng et al., OSDI'22, Table 4 and
§8.1): image 224, 50 layers = bottleneck stages (3, 4, 6, 3), fp32, 1024 classes;
name → (channels, width factor).  The width factor widens each block's 3x3 convolution's
output, which gives the names' parameter counts (250M … 6.8B).  And the model FLOPs of a
step."""

from __future__ import annotations

import dataclasses

import flax.linen as nn


@dataclasses.dataclass(frozen=True)
class WRNConfig:
    """A Wide-ResNet's shape: `channels` of the stem (stage i's bottleneck is
    channels·2^i wide), `width` factor of the 3x3 convolutions, `stages` blocks per stage,
    square `image` side in pixels, `classes`; `dtype`; `remat` and `optimizer` as in `GPTConfig`."""

    channels: int
    width: int
    stages: tuple[int, ...] = (3, 4, 6, 3)
    image: int = 224
    classes: int = 1024
    dtype: str = "float32"
    remat: bool = True
    optimizer: str = "adamw"


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
    Komodakis, 2016; the Alpa benchmark's variant), NHWC.

    images float32 [batch, image, image, 3] → logits [batch, classes]; BatchNorm statistics
    in the `batch_stats` collection."""

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
