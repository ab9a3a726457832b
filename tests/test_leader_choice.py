"""Which operand an elementwise follower follows (`strategies.largest_operand`).

Flax's LayerNorm multiplies rsqrt(var) [B, S, 1] by its scale [1, 1, D]; the output
[B, S, D] must be able to keep the batch split, so the rows lead whatever B·S is against D.  When
the scale led (micro-batches of 8 rows of 4 tokens against D = 40), the whole LayerNorm and
its backward joined the scale parameter's ILP node, and the plan gathered every micro-batch.
"""

from __future__ import annotations

import dataclasses

import generated
import jax
import numpy as np

import autopar
from autopar.cost_model import hlo_audit
from autopar.passes import strategies as st


def _info(in_shapes, out_shape):
    return st.EqnInfo(eqn=None, in_shapes=tuple(in_shapes), out_shapes=(out_shape,),
                      in_nbytes=tuple(4.0 * np.prod(s) for s in in_shapes),
                      out_nbytes=(4.0 * np.prod(out_shape),),
                      in_fixed=(False,) * len(in_shapes),
                      in_from_broadcast=(False,) * len(in_shapes))


def test_the_operand_with_the_output_dims_whole_leads():
    assert st.largest_operand(_info([(8, 4, 1), (1, 1, 40)], (8, 4, 40))) == 0
    assert st.largest_operand(_info([(1, 1, 40), (8, 4, 1)], (8, 4, 40))) == 1
    # Equal standing: the larger operand, then the first.
    assert st.largest_operand(_info([(8, 40), (8, 40)], (8, 40))) == 0
    assert st.largest_operand(_info([(1, 40), (8, 40)], (8, 40))) == 1
    fixed = dataclasses.replace(_info([(8, 4, 1), (1, 1, 40)], (8, 4, 40)),
                                in_fixed=(True, False))
    assert st.largest_operand(fixed) == 1


def test_micro_batched_layer_norm_keeps_the_batch_split():
    """Generated attention model 7 (D = 40, 4 tokens, batch 16) with 2 micro-batches on 4
    CPU devices under this machine's cost model: one gradient all-reduce, no gathers (the
    plan gathered both micro-batches' inputs and cotangents when the scale led)."""
    case = generated.generate(7, family="attention")
    assert case.config["dim"] == 40 and case.config["seq"] == 4 and case.batch_size == 16
    devices = jax.devices()[:4]
    cluster = autopar.ClusterSpec.from_devices(devices)
    step = autopar.parallelize(case.step, devices=devices, cluster=cluster, donate_argnums=(),
                               method=autopar.ShardParallel(mesh_shape=(4,),
                                                            num_micro_batches=2))
    state, batch = case.init(), case.batch(0)
    plan = step.get_plan(state, batch)
    compiled = step.lower(state, batch).compile()
    kinds = [c.kind for c in hlo_audit.audit(compiled, plan.mesh_shape, plan.mesh_axes,
                                             plan.device_ids).collectives]
    assert "all-gather" not in kinds, kinds
