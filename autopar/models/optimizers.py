"""The zoo train steps' optimizers by name (a config's `optimizer` field, `--set
optimizer=NAME` on the command line), each as the Alpa paper's benchmark trains that family
(alpa-projects/alpa, `benchmark/alpa/benchmark_one_case_*.py`):

* "adamw": AdamW, lr 1e-4 — GPT (Alpa: `optax.adamw`); the zoo's default for every family;
* "adafactor": Adafactor with optax's defaults (factored second moments for dims of at
  least 128, decay 0.8, update clipping 1.0, no momentum, updates scaled by the parameter's
  RMS), lr 1e-2 — Alpa's MoE benchmark (its `optax_adafactor` has these defaults, plus a
  weight-decay mask that is inert without a weight-decay rate).  Its state is two vectors
  per matrix, so it takes ~0 bytes per parameter byte instead of AdamW's 2;
* "sgd-nesterov": SGD with Nesterov momentum 0.9, lr 0.1 — Alpa's Wide-ResNet benchmark
  (whose lr is a warm-up/cosine schedule peaking at 0.1; a constant rate holds the same
  state and does the same work).  One momentum buffer: 1 byte per parameter byte.
"""

from __future__ import annotations

from collections.abc import Callable

import optax

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adamw": lambda: optax.adamw(1e-4),
    "adafactor": lambda: optax.adafactor(1e-2),
    "sgd-nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
}


def optimizer(name: str) -> optax.GradientTransformation:
    """The optax transformation named `name` (see the module docstring); ValueError listing
    the known names otherwise."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]()
