"""Model zoo (Flax) with the Alpa paper's configurations (Zheng et al., OSDI'22, Table 4 and
§8.1).

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
returns a plain train step (the config's `optimizer`, AdamW by default — `optimizers`;
gradients via autopar.value_and_grad) and abstract
arguments (`jax.ShapeDtypeStruct`s), so planning needs no memory for the weights.
`flops_per_step(name, batch)` is the model FLOP count used for TFLOP/s (see each formula).
`GPT_TINY` is the demo's and the tests' GPT (not a named benchmark size).
"""

from .gpt import GPT, GPT_CONFIGS, GPT_TINY, GPTConfig, gpt_flops_per_step
from .moe import MOE_CONFIGS, MoE, MoEConfig, MoEFFN, moe_flops_per_step
from .optimizers import OPTIMIZERS, optimizer
from .registry import (
    CONFIGS,
    ModelConfig,
    config,
    default_batch,
    example_batch,
    flops_per_step,
    init_state,
    names,
    param_count,
    train_step_and_args,
)
from .steps import TrainStep, gpt_train_step, make_train_step, wrn_train_step
from .wrn import WRN_CONFIGS, WideResNet, WRNConfig, wrn_flops_per_step

__all__ = [
    "CONFIGS",
    "GPT",
    "GPTConfig",
    "GPT_CONFIGS",
    "GPT_TINY",
    "MOE_CONFIGS",
    "MoE",
    "MoEConfig",
    "MoEFFN",
    "OPTIMIZERS",
    "ModelConfig",
    "TrainStep",
    "WRNConfig",
    "WRN_CONFIGS",
    "WideResNet",
    "config",
    "default_batch",
    "example_batch",
    "flops_per_step",
    "gpt_flops_per_step",
    "gpt_train_step",
    "init_state",
    "make_train_step",
    "moe_flops_per_step",
    "names",
    "optimizer",
    "param_count",
    "train_step_and_args",
    "wrn_flops_per_step",
    "wrn_train_step",
]
