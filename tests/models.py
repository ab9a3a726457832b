"""Small test models and train steps ("model zoo") for autopar tests.

Every case is a plain-JAX training step: ``step(state, batch) -> (new_state, metrics)`` that
computes gradients with ``autopar.value_and_grad`` and updates with optax. Steps are pure and not
jitted; tests jit them (or hand them to autopar) and compare. Models are small, and batch /
hidden dimensions are multiples of 8 so they split over up to 8 devices.  The GPT and the MoE
layer are the installed zoo's (`autopar.models`) at tiny sizes; the rest exist only here.

State is a dict pytree of arrays: ``params`` and ``opt_state`` always, plus ``batch_stats``
(convbn) or a raw uint32 PRNG key ``rng`` (remat_dropout). Batches are dicts of arrays built
deterministically from the step index by ``Case.batch_for_step``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import autopar
from autopar.models import GPT_TINY, MoEConfig, MoEFFN, gpt_train_step


class _Grad:
    """The value_and_grad the steps call, looked up at call time: autopar's (the same as
    jax's outside `parallelize`, and it marks forward+backward for micro-batching and
    pipelines).  Tests swap in a reference implementation (e.g. micro-batched)."""

    value_and_grad = staticmethod(autopar.value_and_grad)


GRAD = _Grad()

CASE_NAMES = ("mlp", "gpt", "convbn", "moe", "scan", "remat_dropout", "nnx_mlp")
OPTIMIZERS = ("sgd", "adamw")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    init: Callable[[], tuple]  # () -> (state, batch)
    step: Callable  # step(state, batch) -> (new_state, {"loss": ...}); pure, not jitted
    batch_for_step: Callable[[int], dict]  # deterministic batch for step i
    key: tuple = ()  # the builder and its arguments (equal keys: equal cases); () = unknown


_INITS: dict[tuple, tuple] = {}


def _memo_init(builder: Callable[..., Case]) -> Callable[..., Case]:
    """The case's `init` computed once per process for each set of builder arguments (GPT
    and conv+BatchNorm compile their init for 2-4 s: most tests call it 2-3 times), kept as
    host arrays; every call returns fresh device arrays (a step may donate them)."""

    @functools.wraps(builder)
    def build(*args, **kwargs) -> Case:
        case = builder(*args, **kwargs)
        key = (builder.__name__, args, tuple(sorted(kwargs.items())))

        def init() -> tuple:
            if key not in _INITS:
                out = case.init()
                if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(out)):
                    return out   # called under a trace (jax.eval_shape): nothing to keep
                _INITS[key] = jax.device_get(out)
            return jax.tree.map(
                lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, _INITS[key])

        return dataclasses.replace(case, init=init, key=key)

    return build


def make_optimizer(name: str) -> optax.GradientTransformation:
    if name == "sgd":
        return optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2, momentum=0.9))
    if name == "adamw":
        # Raised eps: Adam turns reduction-order noise in near-zero gradients into +-lr steps.
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, eps=1e-4))
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


# ----------------------------------------------------------------------------- helpers


def _rng(seed: int, i: int) -> np.random.Generator:
    return np.random.default_rng([seed, i])


def _teacher_labels(x: np.ndarray, num_classes: int, seed: int) -> np.ndarray:
    """Labels from a fixed random linear teacher, so the task is learnable."""
    flat = x.reshape(x.shape[0], -1) if x.ndim > 1 else x[:, None]
    w = np.random.default_rng([seed, 10**6]).standard_normal((flat.shape[-1], num_classes))
    return np.argmax(flat @ w, axis=-1).astype(np.int32)


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _sgd_like_step(loss_fn, tx):
    """Step for models whose loss is loss_fn(params, batch) -> scalar."""

    def step(state, batch):
        loss, grads = GRAD.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, {"loss": loss}

    return step


def _classification_batches(seed, batch, in_shape, num_classes):
    def batch_for_step(i: int) -> dict:
        x = _rng(seed, i).standard_normal((batch, *in_shape)).astype(np.float32)
        y = _teacher_labels(x, num_classes, seed)
        return {"x": jnp.asarray(x), "y": jnp.asarray(y)}

    return batch_for_step


def _simple_case(name, model, batch_for_step, optimizer, init_seed=0):
    """Case for a linen model without mutable collections: logits = model.apply(p, x)."""
    tx = make_optimizer(optimizer)

    def loss_fn(params, batch):
        return _xent(model.apply({"params": params}, batch["x"]), batch["y"])

    def init():
        batch = batch_for_step(0)
        params = jax.jit(model.init)(jax.random.PRNGKey(init_seed), batch["x"])["params"]
        return {"params": params, "opt_state": tx.init(params)}, batch

    return Case(name, init, _sgd_like_step(loss_fn, tx), batch_for_step)


# ----------------------------------------------------------------------------- mlp


class MLP(nn.Module):
    hidden: int = 32
    layers: int = 2
    num_classes: int = 8

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.num_classes)(x)


@_memo_init
def mlp_case(batch=16, hidden=32, layers=2, optimizer="sgd", num_classes=8, in_features=None):
    """Dense-relu stack; input width defaults to ``hidden``."""
    in_features = hidden if in_features is None else in_features
    model = MLP(hidden=hidden, layers=layers, num_classes=num_classes)
    batches = _classification_batches(1, batch, (in_features,), num_classes)
    return _simple_case("mlp", model, batches, optimizer)


# ----------------------------------------------------------------------------- gpt


def _grad_at_call_time(*args, **kwargs):
    return GRAD.value_and_grad(*args, **kwargs)


@_memo_init
def gpt_case(optimizer="sgd", batch=16, seq=16, hidden=32, heads=4, vocab=64, tied=True):
    """The zoo's GPT (`autopar.models.GPT_TINY`: 2 layers, float32, no remat) at these sizes;
    its next-token train step with this optimizer."""
    cfg = dataclasses.replace(GPT_TINY, hidden=hidden, heads=heads, vocab=vocab, seq=seq,
                              tied=tied)
    step, model, tx = gpt_train_step(cfg, _grad_at_call_time, make_optimizer(optimizer))

    def batch_for_step(i: int) -> dict:
        # A learnable sequence: arithmetic progressions mod vocab with random start/stride.
        r = _rng(2, i)
        start = r.integers(0, vocab, (batch, 1))
        stride = r.integers(1, 4, (batch, 1))
        seq_all = (start + stride * np.arange(seq + 1)[None]) % vocab
        return {
            "tokens": jnp.asarray(seq_all[:, :-1], jnp.int32),
            "labels": jnp.asarray(seq_all[:, 1:], jnp.int32),
        }

    def init():
        batch = batch_for_step(0)
        params = jax.jit(model.init)(jax.random.PRNGKey(0), batch["tokens"])["params"]
        return {"params": params, "opt_state": tx.init(params)}, batch

    return Case("gpt", init, step, batch_for_step)


# ----------------------------------------------------------------------------- convbn


class ConvBN(nn.Module):
    channels: tuple = (8, 16)
    num_classes: int = 8

    @nn.compact
    def __call__(self, x):
        for c in self.channels:
            x = nn.Conv(c, (3, 3), padding="SAME")(x)
            x = nn.BatchNorm(use_running_average=False, momentum=0.9)(x)
            x = nn.relu(x)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


@_memo_init
def convbn_case(optimizer="sgd", batch=16, size=8, num_classes=8):
    model = ConvBN(num_classes=num_classes)
    batch_for_step = _classification_batches(3, batch, (size, size, 3), num_classes)
    tx = make_optimizer(optimizer)

    def loss_fn(params, batch_stats, batch):
        logits, mutated = model.apply(
            {"params": params, "batch_stats": batch_stats}, batch["x"], mutable=["batch_stats"]
        )
        return _xent(logits, batch["y"]), mutated["batch_stats"]

    def step(state, batch):
        (loss, batch_stats), grads = GRAD.value_and_grad(loss_fn, has_aux=True)(
            state["params"], state["batch_stats"], batch
        )
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new_state = {"params": params, "opt_state": opt_state, "batch_stats": batch_stats}
        return new_state, {"loss": loss}

    def init():
        batch = batch_for_step(0)
        variables = jax.jit(model.init)(jax.random.PRNGKey(0), batch["x"])
        params = variables["params"]
        state = {
            "params": params,
            "opt_state": tx.init(params),
            "batch_stats": variables["batch_stats"],
        }
        return state, batch

    return Case("convbn", init, step, batch_for_step)


# ----------------------------------------------------------------------------- moe


class MoEClassifier(nn.Module):
    """Classification around the zoo's GShard MoE FFN: in_proj → x + MoEFFN(LayerNorm(x))
    → mean over the sequence → out_proj.  One routing group per sequence (`cfg.group` =
    seq), so micro-batches route exactly as the whole batch does."""

    cfg: MoEConfig
    num_classes: int = 8

    @nn.compact
    def __call__(self, x):  # [B, S, D_in]
        x = nn.Dense(self.cfg.hidden, name="in_proj")(x)
        x = x + MoEFFN(self.cfg)(nn.LayerNorm()(x))
        return nn.Dense(self.num_classes, name="out_proj")(x.mean(axis=1))


@_memo_init
def moe_case(optimizer="sgd", batch=16, seq=8, in_features=16, num_classes=8):
    """4 experts of FFN width 2 x hidden 32, top-2 with GShard's capacity (2·seq/4 slots)."""
    cfg = MoEConfig(hidden=32, layers=1, experts=4, seq=seq, group=seq, ffn=2, dtype="float32")
    batches = _classification_batches(4, batch, (seq, in_features), num_classes)
    return _simple_case("moe", MoEClassifier(cfg, num_classes=num_classes), batches, optimizer)


# ----------------------------------------------------------------------------- scan


class ScanLayer(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, carry, _):
        return jnp.tanh(nn.Dense(self.hidden)(carry)), None


class ScanModel(nn.Module):
    hidden: int = 32
    length: int = 4
    num_classes: int = 8

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.hidden, name="in_proj")(x)
        stack = nn.scan(
            ScanLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.length,
        )(self.hidden, name="layers")
        x, _ = stack(x, None)
        return nn.Dense(self.num_classes, name="out_proj")(x)


@_memo_init
def scan_case(optimizer="sgd", batch=16, hidden=32, num_classes=8):
    batches = _classification_batches(5, batch, (hidden,), num_classes)
    return _simple_case("scan", ScanModel(hidden=hidden), batches, optimizer)


# ----------------------------------------------------------------------------- remat_dropout


class DropoutBlock(nn.Module):
    hidden: int
    rate: float = 0.1

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.hidden)(x))
        h = nn.Dropout(rate=self.rate, deterministic=False)(h)
        return x + h


class RematDropoutModel(nn.Module):
    hidden: int = 32
    layers: int = 3
    num_classes: int = 8

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.hidden, name="in_proj")(x)
        block = nn.remat(DropoutBlock)
        for i in range(self.layers):
            x = block(self.hidden, name=f"block_{i}")(x)
        return nn.Dense(self.num_classes, name="out_proj")(nn.LayerNorm()(x))


@_memo_init
def remat_dropout_case(optimizer="sgd", batch=16, hidden=32, num_classes=8):
    model = RematDropoutModel(hidden=hidden, num_classes=num_classes)
    batch_for_step = _classification_batches(6, batch, (hidden,), num_classes)
    tx = make_optimizer(optimizer)

    def loss_fn(params, batch, key):
        logits = model.apply({"params": params}, batch["x"], rngs={"dropout": key})
        return _xent(logits, batch["y"])

    def step(state, batch):
        rng, dropout_key = jax.random.split(state["rng"])
        loss, grads = GRAD.value_and_grad(loss_fn)(state["params"], batch, dropout_key)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "rng": rng}, {"loss": loss}

    def init():
        batch = batch_for_step(0)
        params_key, dropout_key, state_key = jax.random.split(jax.random.PRNGKey(0), 3)
        variables = jax.jit(model.init)({"params": params_key, "dropout": dropout_key}, batch["x"])
        params = variables["params"]
        # Raw uint32[2] key (not a typed key array) so the state is plain numeric arrays.
        return {"params": params, "opt_state": tx.init(params), "rng": state_key}, batch

    return Case("remat_dropout", init, step, batch_for_step)


# ----------------------------------------------------------------------------- nnx_mlp


class NNXMLP(nnx.Module):
    def __init__(self, in_features, hidden, num_classes, layers, rngs: nnx.Rngs):
        dims = [in_features] + [hidden] * layers
        self.hidden = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(dims[:-1], dims[1:], strict=True)]
        )
        self.norm = nnx.LayerNorm(hidden, rngs=rngs)
        self.head = nnx.Linear(hidden, num_classes, rngs=rngs)

    def __call__(self, x):
        for layer in self.hidden:
            x = nnx.relu(layer(x))
        return self.head(self.norm(x))


@_memo_init
def nnx_mlp_case(optimizer="sgd", batch=16, hidden=32, layers=2, num_classes=8):
    """flax.nnx model; params are carried as a pure nested dict of arrays.

    ``nnx.split`` gives (graphdef, State); the State is turned into a plain dict
    (``nnx.to_pure_dict``) for the train state and rebuilt with the State's treedef inside the
    loss before ``nnx.merge``.
    """
    batch_for_step = _classification_batches(7, batch, (hidden,), num_classes)
    tx = make_optimizer(optimizer)

    def build():
        model = NNXMLP(hidden, hidden, num_classes, layers, nnx.Rngs(0))
        graphdef, nnx_state = nnx.split(model)
        pure = nnx.to_pure_dict(nnx_state)
        state_def = jax.tree.structure(nnx_state)

        # The rebuild below relies on both flattening in the same leaf order; check the paths.
        def dict_paths(tree):
            leaves = jax.tree_util.tree_leaves_with_path(tree)
            return [
                tuple(k.key for k in p if isinstance(k, jax.tree_util.DictKey)) for p, _ in leaves
            ]

        nnx_paths, pure_paths = dict_paths(nnx_state), dict_paths(pure)
        assert nnx_paths == pure_paths, (nnx_paths, pure_paths)
        return graphdef, state_def, pure

    graphdef, state_def, _ = build()

    def loss_fn(params, batch):
        nnx_state = jax.tree.unflatten(state_def, jax.tree.leaves(params))
        model = nnx.merge(graphdef, nnx_state)
        return _xent(model(batch["x"]), batch["y"])

    def init():
        _, _, params = build()
        return {"params": params, "opt_state": tx.init(params)}, batch_for_step(0)

    return Case("nnx_mlp", init, _sgd_like_step(loss_fn, tx), batch_for_step)


# ----------------------------------------------------------------------------- registry


_BUILDERS: dict[str, Callable[..., Case]] = {
    "mlp": lambda optimizer: mlp_case(optimizer=optimizer),
    "gpt": gpt_case,
    "convbn": convbn_case,
    "moe": moe_case,
    "scan": scan_case,
    "remat_dropout": remat_dropout_case,
    "nnx_mlp": nnx_mlp_case,
}
assert tuple(_BUILDERS) == CASE_NAMES


def make_case(name: str, optimizer: str = "sgd") -> Case:
    if name not in _BUILDERS:
        raise ValueError(f"unknown case {name!r}; expected one of {CASE_NAMES}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
    return _BUILDERS[name](optimizer=optimizer)
