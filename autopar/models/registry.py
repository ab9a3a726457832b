"""The zoo's named models (`gpt-toy` … `gpt-39b`, `moe-toy` … `moe-70b`, `wrn-toy` …
`wrn-6.8b`): config, FLOPs, parameter count, default batch, train step with abstract
arguments (`jax.ShapeDtypeStruct`s, so planning needs no memory for the weights), and
concrete state and batches for the toy sizes (real runs on CPU)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from autopar.models.gpt import GPT_CONFIGS, GPTConfig, gpt_flops_per_step
from autopar.models.moe import MOE_CONFIGS, MoEConfig, moe_flops_per_step
from autopar.models.optimizers import OPTIMIZERS
from autopar.models.steps import make_train_step
from autopar.models.wrn import WRN_CONFIGS, WRNConfig, wrn_flops_per_step

ModelConfig = GPTConfig | MoEConfig | WRNConfig

CONFIGS: dict[str, ModelConfig] = {**GPT_CONFIGS, **MOE_CONFIGS, **WRN_CONFIGS}


Overrides = Mapping[str, Any] | None


def config(name: str, overrides: Overrides = None) -> ModelConfig:
    """The config of zoo model `name`, with the fields in `overrides` replaced (e.g.
    {"param_dtype": "float16", "tied": False}); ValueError listing the known names or
    fields otherwise."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(CONFIGS)}")
    cfg = CONFIGS[name]
    if not overrides:
        return cfg
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for key, value in overrides.items():
        if key not in fields:
            raise ValueError(f"model {name!r} has no config field {key!r}; its fields: "
                             f"{', '.join(fields)}")
        have = getattr(cfg, key)
        if type(value) is not type(have) and not (isinstance(have, float)
                                                  and isinstance(value, int)):
            raise ValueError(f"model {name!r}: field {key!r} takes a "
                             f"{type(have).__name__} (default {have!r}), got {value!r}")
    out = dataclasses.replace(cfg, **overrides)
    for key in ("dtype", "param_dtype"):
        if not hasattr(out, key):
            continue
        try:
            jnp.dtype(getattr(out, key))
        except TypeError:
            raise ValueError(f"model {name!r}: {key}={getattr(out, key)!r} is not a dtype "
                             f"name (float32, float16, bfloat16)") from None
    if out.optimizer not in OPTIMIZERS:
        raise ValueError(f"model {name!r}: optimizer={out.optimizer!r} is not one of "
                         f"{', '.join(OPTIMIZERS)}")
    return out


def _order(name: str) -> tuple[str, float]:
    m = re.search(r"([0-9.]+)([mb])$", name)
    size = float(m.group(1)) * (1e3 if m.group(2) == "b" else 1) if m else 0.0
    return (name.split("-")[0], size)


def names() -> list[str]:
    """The zoo's model names by family (gpt, moe, wrn), then size (toy first)."""
    return sorted(CONFIGS, key=_order)


def default_batch(name: str) -> int:
    """Alpa's global batch (sequences or images) for `name`: 1536 for Wide-ResNet, 1024
    otherwise (Zheng et al., OSDI'22, §8.1); 64 for the toy sizes."""
    cfg = config(name)
    if name.endswith("-toy"):
        return 64
    return 1536 if isinstance(cfg, WRNConfig) else 1024


def flops_per_step(name: str, batch: int, overrides: Overrides = None) -> float:
    """Model FLOPs of one training step of zoo model `name` at global batch `batch`."""
    cfg = config(name, overrides)
    rule = {GPTConfig: gpt_flops_per_step, MoEConfig: moe_flops_per_step,
            WRNConfig: wrn_flops_per_step}[type(cfg)]
    return rule(cfg, batch)


def param_count(name: str, overrides: Overrides = None) -> int:
    """Number of parameters (from abstract initialization)."""
    state = _abstract_state(name, overrides)
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(state["params"]))


def _example_input(cfg: ModelConfig, batch: int) -> dict[str, jax.ShapeDtypeStruct]:
    if isinstance(cfg, WRNConfig):
        return {"images": jax.ShapeDtypeStruct((batch, cfg.image, cfg.image, 3), jnp.float32),
                "labels": jax.ShapeDtypeStruct((batch,), jnp.int32)}
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq), jnp.int32)
    return {"tokens": tokens, "labels": tokens}


def _init(name: str, seed: int, overrides: Overrides = None) -> dict:
    cfg = config(name, overrides)
    _, model, tx = make_train_step(cfg)
    key = "images" if isinstance(cfg, WRNConfig) else "tokens"
    x = _example_input(cfg, 1)[key]
    variables = model.init(jax.random.key(seed), jnp.zeros(x.shape, x.dtype))
    state = {"params": variables["params"], "opt_state": tx.init(variables["params"])}
    if "batch_stats" in variables:
        state["batch_stats"] = variables["batch_stats"]
    return state


def _abstract_state(name: str, overrides: Overrides = None) -> dict:
    return jax.eval_shape(lambda: _init(name, 0, overrides))


def train_step_and_args(name: str, batch: int, value_and_grad: Callable | None = None,
                        overrides: Overrides = None) -> tuple[Callable, tuple[dict, dict]]:
    """(train_step, (abstract_state, abstract_batch)) for a zoo model at global batch size;
    `value_and_grad` replaces `autopar.value_and_grad` in the step (e.g. a reference);
    `overrides` replaces config fields (`config`)."""
    cfg = config(name, overrides)
    step = make_train_step(cfg, value_and_grad)[0]
    return step, (_abstract_state(name, overrides), _example_input(cfg, batch))


def init_state(name: str, seed: int = 0, overrides: Overrides = None) -> dict:
    """Concrete initial state (for toy sizes: real runs on CPU)."""
    return _init(name, seed, overrides)


def example_batch(name: str, batch: int, seed: int = 1, overrides: Overrides = None) -> dict:
    """A concrete random batch (for toy sizes)."""
    cfg = config(name, overrides)
    k1, k2 = jax.random.split(jax.random.key(seed))
    if isinstance(cfg, WRNConfig):
        return {"images": jax.random.normal(k1, (batch, cfg.image, cfg.image, 3)),
                "labels": jax.random.randint(k2, (batch,), 0, cfg.classes)}
    tokens = jax.random.randint(k1, (batch, cfg.seq), 0, cfg.vocab)
    return {"tokens": tokens, "labels": jnp.roll(tokens, -1, axis=1)}
