"""Emission: a Plan + Graph → one SPMD `jax.jit` program (ShardParallel).

The jaxpr is re-evaluated with `jax.lax.with_sharding_constraint` on every value the plan
fixes (`autopar.constraints`); inputs and outputs get the plan's shardings; the partitioner
(Shardy) inserts the collectives.  A wrong plan can make the program slow, never wrong:
sharding annotations do not change values.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from autopar.graph import Graph

from .constraints import Constraints, to_pspec
from .executable import MeshExecutable
from .microbatch import ReducedOnce
from .plan import Plan


def emit(graph: Graph, plan: Plan, mesh: Mesh,
         donate_argnums: Sequence[int] = ()) -> MeshExecutable:
    """The executable that runs `graph` under `plan`: one jitted function of the flattened
    inputs.  A micro-batched step reduces each gradient once per step
    (`microbatch.ReducedOnce`)."""
    hooks = Constraints.build(graph, mesh, plan.value_specs, plan.operand_specs,
                              input_specs=zip(graph.invars, plan.in_specs))
    once = ReducedOnce.find(graph, plan, mesh)

    def program(*flat_args):
        if once is not None:
            return tuple(once.evaluate(flat_args, hooks))
        return tuple(graph.evaluate(flat_args, hooks.on_value, hooks.on_operand))

    in_shardings = tuple(NamedSharding(mesh, to_pspec(s)) for s in plan.in_specs)
    out_shardings = tuple(NamedSharding(mesh, to_pspec(s)) for s in plan.out_specs)
    return MeshExecutable(jax.jit(program, in_shardings=in_shardings,
                                  out_shardings=out_shardings,
                                  donate_argnums=tuple(donate_argnums)),
                          in_shardings, out_shardings)
