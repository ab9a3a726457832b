"""A Flax NNX character-level GPT train step, parallelized by autopar and checked against jit.

What it shows: a model written with `flax.nnx` (token `nnx.Embed`, a learned position
parameter, pre-LayerNorm blocks of causal `nnx.MultiHeadAttention` and a GELU MLP, tied
output logits) trained through NNX's functional API, so that autopar sees an ordinary pure
step of arrays:

* `nnx.split(model, nnx.Param)` once, outside the step, gives the static `GraphDef` and the
  parameters; `nnx.to_pure_dict` turns them into a plain nested dict of arrays (the train
  state is then `{"params": dict, "opt_state": optax state}`, nothing NNX-specific);
* inside the step, `nnx.merge(graphdef, params)` rebuilds the module from that dict, the
  next-token cross-entropy is differentiated with `autopar.value_and_grad` (which marks the
  forward+backward part so autopar can micro-batch and pipeline it), and optax's AdamW
  updates the parameters.

The step runs under `autopar.parallelize` (ShardParallel, or PipeshardParallel with 2
stages and 2 micro-batches) on N devices, and again with the plain single-device `jax.jit`;
the losses and the final parameters must agree.  The corpus is the Python standard
library's own source (top-level `*.py` files), one token per ASCII byte (vocab 128).

Run (emulated CPU devices; about 20 s on a laptop, most of it compiling):

    python examples/flax_nnx.py --devices 8 --steps 5
    python examples/flax_nnx.py --devices 8 --steps 5 --method pipeshard
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import jax
import numpy as np
import optax
from flax import nnx

import autopar

# Tolerances of the parallel-vs-jit comparison (float32, CPU).  The two programs differ only
# in reduction order (sharded matmuls and all-reduces; the pipeline also sums two micro-batch
# gradients): rounding noise of ~1e-7 relative per op.  Measured on 8 emulated CPU devices,
# shard and pipeshard alike, over 5, 20 and 50 AdamW steps: the losses agree to 4e-7
# relative, the parameters to 2.3e-6 absolute (no growth from 5 to 50 steps).  The parameter
# gap is the larger one because Adam divides each update by sqrt(v): where a weight's
# gradient is tiny, the rounding noise is not small relative to it, and the normalized
# update (up to the learning rate, 3e-3, per step) carries that relative noise.  Hence
# rtol 1e-5 for the losses (25x the measured gap, far below one step's loss change) and
# atol 1e-5 + rtol 1e-4 for the parameters (4x the measured gap, 1/300 of one step's update).
# Accelerators that run float32 matmuls in reduced precision (TF32) need looser bounds.
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-4
PARAM_ATOL = 1e-5

METHODS = ("shard", "pipeshard")


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and training sizes.

    Attributes:
      vocab: token count (ASCII bytes: 128).
      seq: tokens per training window (the model also sees positions 0..seq-1 only).
      hidden: residual width.
      layers: transformer blocks.
      heads: attention heads (hidden must divide by it).
      mlp_ratio: MLP width / hidden.
      tied: logits from the token embedding (`Embed.attend`) instead of a separate head.
      attn_bias: biases in the attention projections.  Off by default: the key bias is
        redundant (it adds the same q.b to every score of a query's row, which the softmax
        cancels), so its gradient is zero up to rounding noise, which Adam normalizes into
        full-size random steps: the parallel and jit runs would then differ there by about
        the learning rate, although neither loss depends on it.
      learning_rate: AdamW step size.
      weight_decay: AdamW decoupled weight decay, applied to matrices only.
    """

    vocab: int = 128
    seq: int = 32
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    tied: bool = True
    attn_bias: bool = False
    learning_rate: float = 3e-3
    weight_decay: float = 0.01


# ------------------------------------------------------------------------------- the model


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(cfg.hidden, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=cfg.heads, in_features=cfg.hidden,
                                           use_bias=cfg.attn_bias, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.hidden, rngs=rngs)
        self.up = nnx.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [batch, length, hidden] float32 -> the same shape."""
        x = x + self.attn(self.ln1(x), is_causal=True)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class CharGPT(nnx.Module):
    """Token + learned position embeddings, `layers` blocks, final LayerNorm, logits
    (tied to the token embedding unless `cfg.tied` is False)."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(cfg.vocab, cfg.hidden, embedding_init=init, rngs=rngs)
        self.pos = nnx.Param(init(rngs.params(), (cfg.seq, cfg.hidden)))
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.ln_f = nnx.LayerNorm(cfg.hidden, rngs=rngs)
        self.head = (None if cfg.tied
                     else nnx.Linear(cfg.hidden, cfg.vocab, kernel_init=init, rngs=rngs))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens: int32 [batch, length <= seq] -> logits float32 [batch, length, vocab]."""
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.embed.attend(x) if self.head is None else self.head(x)


def make_train_step(cfg: Config, seed: int = 0) -> tuple[Callable, dict[str, Any]]:
    """(train_step, initial state) for `cfg`.

    `train_step(state, batch) -> (new_state, {"loss": scalar})` is a pure function of
    arrays: state = {"params": nested dict, "opt_state": optax AdamW state}, batch =
    {"inputs": int32 [batch, seq], "targets": int32 [batch, seq]}; loss is the mean
    next-token cross-entropy in nats.
    """
    model = CharGPT(cfg, nnx.Rngs(params=seed))
    graphdef, params_state = nnx.split(model, nnx.Param)  # every variable here is a Param
    params = nnx.to_pure_dict(params_state)  # plain nested dict of jax.Arrays
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    tx = optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay, mask=decay_mask)

    def train_step(state: dict[str, Any], batch: dict[str, jax.Array],
                   ) -> tuple[dict[str, Any], dict[str, jax.Array]]:
        def loss_fn(params: dict[str, Any]) -> jax.Array:
            model = nnx.merge(graphdef, params)
            logits = model(batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["targets"]).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_params = optax.apply_updates(state["params"], updates)
        return {"params": new_params, "opt_state": opt_state}, {"loss": loss}

    return train_step, {"params": params, "opt_state": tx.init(params)}


# -------------------------------------------------------------------------------- the data


def load_corpus(max_bytes: int = 4_000_000) -> np.ndarray:
    """The standard library's top-level `*.py` sources (sorted by name, concatenated) as
    ASCII byte tokens: uint8 [n] with values < 128, at most `max_bytes` long."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    data = "".join(parts).encode("ascii", "replace")[:max_bytes]
    return np.frombuffer(data, dtype=np.uint8)


def get_batch(tokens: np.ndarray, step: int, batch: int, seq: int,
              seed: int = 0) -> dict[str, np.ndarray]:
    """`batch` random windows of `seq + 1` bytes for training step `step` (the same windows
    for the same (seed, step)): inputs = the first `seq` bytes, targets = the next ones."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
    windows = tokens[starts[:, None] + np.arange(seq + 1)].astype(np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


# --------------------------------------------------------------------------- run and check


@dataclasses.dataclass
class Result:
    """One run: losses (nats, one per step), final parameters (host arrays) and wall time
    (seconds, compilation included)."""

    losses: list[float]
    params: dict[str, Any]
    seconds: float


def make_method(name: str) -> autopar.Method:
    """The autopar method called `name` ("shard" or "pipeshard")."""
    if name == "shard":
        return autopar.ShardParallel()
    if name == "pipeshard":
        return autopar.PipeshardParallel(num_micro_batches=2, num_stages=2)
    raise ValueError(f"unknown method {name!r}; expected one of {METHODS}")


def _train(step: Callable, state: dict[str, Any], batches: Sequence[dict]) -> Result:
    t0 = time.perf_counter()
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    params = jax.tree.map(np.asarray, state["params"])
    return Result(losses, params, time.perf_counter() - t0)


def run(method: str = "shard", *, steps: int = 5, batch: int = 16, devices: int = 8,
        cfg: Config | None = None, check: bool = True,
        out: TextIO | None = None) -> tuple[Result, Result | None]:
    """Trains `steps` steps with the autopar step on the first `devices` devices and, if
    `check`, the same steps with the single-device `jax.jit` step.

    Does not touch `jax.config`: the caller provides the devices.  Returns (parallel
    result, reference result or None); prints the plan to `out` (default stdout).
    """
    out = out if out is not None else sys.stdout
    cfg = cfg if cfg is not None else Config()
    available = jax.devices()
    if len(available) < devices:
        raise RuntimeError(f"asked for {devices} devices, JAX has {len(available)}")
    train_step, state = make_train_step(cfg)
    tokens = load_corpus()
    batches = [get_batch(tokens, k, batch, cfg.seq) for k in range(steps)]
    # The parallel step donates the state it replaces: keep a host copy for the reference.
    host_state = jax.tree.map(np.asarray, state)

    step = autopar.parallelize(train_step, method=make_method(method), batch_argnums=(1,),
                               devices=available[:devices])
    print(step.get_plan(state, batches[0]).summary(), file=out)
    parallel = _train(step, state, batches)

    reference = None
    if check:
        with jax.default_device(available[0]):
            reference = _train(jax.jit(train_step), jax.device_put(host_state), batches)
    return parallel, reference


def compare(parallel: Result, reference: Result) -> None:
    """Raises AssertionError unless the losses and final parameters agree within the
    module's tolerances (see LOSS_RTOL / PARAM_RTOL / PARAM_ATOL)."""
    np.testing.assert_allclose(parallel.losses, reference.losses, rtol=LOSS_RTOL,
                               err_msg="losses differ")
    flat_par = _flatten(parallel.params)
    flat_ref = _flatten(reference.params)
    assert flat_par.keys() == flat_ref.keys(), (flat_par.keys(), flat_ref.keys())
    for name, value in flat_ref.items():
        np.testing.assert_allclose(flat_par[name], value, rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                   err_msg=f"parameter {name} differs")


def _flatten(tree: Any) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _use_devices(n: int) -> None:
    """Asks for `n` emulated CPU devices before any JAX backend use.  The flag only shapes
    the CPU backend, so where an accelerator is the default platform it changes nothing."""
    platforms = jax.config.jax_platforms
    if platforms and "cpu" not in platforms.split(","):
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # a backend already runs (called from Python); run() checks the count


def main(argv: Sequence[str] | None = None) -> int:
    """Command line; returns the exit status (0: the autopar step matches jax.jit)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8,
                        help="devices to parallelize over (emulated when on CPU)")
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument("--batch", type=int, default=16, help="windows per step")
    parser.add_argument("--method", choices=METHODS, default="shard")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="compare with the single-device jax.jit step")
    args = parser.parse_args(argv)
    if args.devices < 1 or args.steps < 1 or args.batch < 1:
        parser.error("--devices, --steps and --batch must be positive")
    _use_devices(args.devices)

    parallel, reference = run(args.method, steps=args.steps, batch=args.batch,
                              devices=args.devices, check=args.check)
    print(f"\n{'step':>4}  {'autopar loss':>12}  {'jax.jit loss':>12}")
    for k, loss in enumerate(parallel.losses):
        ref = f"{reference.losses[k]:12.6f}" if reference is not None else f"{'-':>12}"
        print(f"{k:>4}  {loss:12.6f}  {ref}")
    print(f"autopar ({args.method}, {args.devices} devices): {parallel.seconds:.1f} s")
    if reference is None:
        return 0
    print(f"jax.jit (1 device): {reference.seconds:.1f} s")
    try:
        compare(parallel, reference)
    except AssertionError as err:
        print(f"MISMATCH: {err}")
        return 1
    print("NNX step matches jax.jit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
