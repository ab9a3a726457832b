"""Shared test helpers: the jax.jit oracle, collective counting in compiled HLO."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

import autopar
from autopar.cost_model import Link

# One implementation of the step loop and of the micro-batched reference (strided
# micro-batches m, m+N, ... averaged, written without autopar), shared with the toy suite.
from benchmarks.toy import micro_batched_value_and_grad as micro_batch_value_and_grad
from benchmarks.toy import run_steps

# A cost model where communication is almost free: the search then splits nearly every
# value, which exercises the strategies and the emitter far harder than a realistic
# model would on tiny test models (where replicating everything is the right answer).
CHEAP_COMM = Link(alpha_s=1e-7, beta_s_per_byte=1e-14)


def cheap_comm_cluster() -> autopar.ClusterSpec:
    base = autopar.ClusterSpec.from_devices(jax.devices())
    return dataclasses.replace(base, intra_host=CHEAP_COMM, inter_host=CHEAP_COMM)


_REFERENCES: dict[tuple, tuple] = {}


def _reference(case, kind: tuple, run) -> tuple:
    """`run()`'s (state, losses) on the host, once per process for cases with a key (tests
    of one model on several meshes or methods share the jax.jit reference run)."""
    if not case.key:
        return run()
    key = (case.key, *kind)
    if key not in _REFERENCES:
        _REFERENCES[key] = jax.device_get(run())
    return _REFERENCES[key]


def assert_same_run(case, parallel_step, *, steps: int = 3, rtol: float, atol: float):
    """Runs `steps` optimizer steps under jax.jit and under `parallel_step` from the same
    state and batches; losses and every state leaf must agree."""
    state, _ = case.init()
    batches = [case.batch_for_step(i) for i in range(steps)]
    ref_state, ref_losses = _reference(
        case, ("jit", steps), lambda: run_steps(jax.jit(case.step), case.init()[0], batches))
    par_state, par_losses = run_steps(parallel_step, state, batches)
    np.testing.assert_allclose(par_losses, ref_losses, rtol=rtol, atol=atol)
    ref_leaves, ref_tree = jax.tree_util.tree_flatten(ref_state)
    par_leaves, par_tree = jax.tree_util.tree_flatten(par_state)
    assert ref_tree == par_tree
    for path_leaf, r, p in zip(jax.tree_util.tree_flatten_with_path(ref_state)[0], ref_leaves,
                               par_leaves):
        np.testing.assert_allclose(np.asarray(p), np.asarray(r), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path_leaf[0]))


def collectives(compiled, plan) -> list[tuple[str, int]]:
    """(kind, bytes) of every collective XLA put in the compiled program (hlo_audit)."""
    from autopar.cost_model import hlo_audit

    found = hlo_audit.audit(compiled, plan.mesh_shape, plan.mesh_axes, plan.device_ids)
    return [(c.kind, c.nbytes) for c in found.collectives]


def per_device_bytes(compiled) -> int:
    """argument + output − alias + temp (JAX-NOTES: peak_memory omits temp buffers)."""
    from autopar.cost_model import hlo_audit

    return hlo_audit.MemoryUsage.of(compiled).total_bytes


def assert_same_micro_batched_run(case, parallel_step, num: int, **tol):
    """Like assert_same_run, against the jitted step that averages over the same splits."""
    import models

    state, _ = case.init()
    batches = [case.batch_for_step(i) for i in range(3)]

    def reference():
        saved = models.GRAD.value_and_grad
        models.GRAD.value_and_grad = micro_batch_value_and_grad(num)
        try:
            return run_steps(jax.jit(case.step), case.init()[0], batches)
        finally:
            models.GRAD.value_and_grad = saved

    ref_state, ref_losses = _reference(case, ("micro", num), reference)
    par_state, par_losses = run_steps(parallel_step, state, batches)
    np.testing.assert_allclose(par_losses, ref_losses, **tol)
    for r, p in zip(jax.tree.leaves(ref_state), jax.tree.leaves(par_state)):
        np.testing.assert_allclose(np.asarray(p), np.asarray(r), **tol)
