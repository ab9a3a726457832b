"""The zoo models' train steps: pure `step(state, batch) -> (new_state, {"loss": ...})`
with gradients via `autopar.value_and_grad` (a reference may swap it) and an optax
optimizer (the config's `optimizer`, AdamW at lr 1e-4 by default, unless one is given)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import autopar
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.moe import MoE, MoEConfig
from autopar.models.optimizers import optimizer
from autopar.models.wrn import WideResNet, WRNConfig

TrainStep = tuple[Callable, nn.Module, optax.GradientTransformation]


class MasterCopyState(NamedTuple):
    """`master_copy`'s state: the float32 master parameters and the inner optimizer's
    state over them."""

    master: optax.Params
    inner: optax.OptState


def master_copy(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """Mixed-precision training of low-precision parameters: `tx` runs on a float32 master
    copy kept in the optimizer state, and the update takes the parameters to the master
    rounded to their dtype (Alpa's `TrainState(use_master_copy=True)`; Micikevicius et al.,
    ICLR'18).  The updates are float32 differences, so `optax.apply_updates` lands on the
    rounded master exactly."""
    f32 = lambda tree: jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), tree)

    def init(params):
        master = f32(params)
        return MasterCopyState(master, tx.init(master))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("master_copy's update needs the parameters")
        updates, inner = tx.update(f32(grads), state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        steps = jax.tree_util.tree_map(
            lambda m, p: m.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32),
            master, params)
        return steps, MasterCopyState(master, inner)

    return optax.GradientTransformation(init, update)


def gpt_train_step(cfg: GPTConfig | MoEConfig, value_and_grad: Callable | None = None,
                   tx: optax.GradientTransformation | None = None) -> TrainStep:
    """(train_step, model, tx) of a token model (GPT or MoE): next-token cross-entropy.
    State {"params", "opt_state"}; batch {"tokens", "labels"} int32 [batch, seq].
    `value_and_grad` defaults to `autopar.value_and_grad` (a reference may swap it), `tx`
    to the config's `optimizer` (`autopar.models.optimizers`); parameters below float32
    (`GPTConfig.param_dtype`) train through `master_copy(tx)`."""
    grad_fn = value_and_grad or autopar.value_and_grad
    model = GPT(cfg) if isinstance(cfg, GPTConfig) else MoE(cfg)
    tx = tx if tx is not None else optimizer(cfg.optimizer)
    if jnp.dtype(cfg.param_dtype).itemsize < 4:
        tx = master_copy(tx)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    def train_step(state, batch):
        loss, grads = grad_fn(loss_fn)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, {"loss": loss}

    return train_step, model, tx


def wrn_train_step(cfg: WRNConfig, value_and_grad: Callable | None = None,
                   tx: optax.GradientTransformation | None = None) -> TrainStep:
    """(train_step, model, tx) of a Wide-ResNet: classification cross-entropy, BatchNorm
    statistics carried in the state {"params", "opt_state", "batch_stats"}; batch
    {"images" float32 [batch, image, image, 3], "labels" int32 [batch]}.  Defaults as in
    `gpt_train_step`."""
    grad_fn = value_and_grad or autopar.value_and_grad
    model = WideResNet(cfg)
    tx = tx if tx is not None else optimizer(cfg.optimizer)

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


def make_train_step(cfg: GPTConfig | MoEConfig | WRNConfig,
                    value_and_grad: Callable | None = None,
                    tx: optax.GradientTransformation | None = None) -> TrainStep:
    """`gpt_train_step` or `wrn_train_step`, by the config's family."""
    if isinstance(cfg, WRNConfig):
        return wrn_train_step(cfg, value_and_grad, tx)
    return gpt_train_step(cfg, value_and_grad, tx)
