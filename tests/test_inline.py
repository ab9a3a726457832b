"""autopar.inline: `jax.jit(inline=True)` calls spliced into the step's jaxpr (jax >= 0.11
keeps them as call equations; jax 0.10, which CI runs, inlines them itself, so the calls
here are plain jits marked as requested)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import check_jaxpr, jaxpr_as_fun

from autopar import inline


def _marked(closed):
    """`closed` with every top-level jit call marked as asking to be inlined."""
    eqns = [e.replace(params={**e.params, "inline": True}) if e.primitive.name in ("jit", "pjit")
            else e for e in closed.jaxpr.eqns]
    return closed.replace(jaxpr=closed.jaxpr.replace(eqns=eqns))


def test_calls_are_spliced_with_fresh_variables_and_the_same_results():
    const = np.arange(3.0, dtype=np.float32)
    bias = jax.jit(lambda m, c: (m / (1 - 0.9 ** c) + const, m * 0))  # a constant inside
    passthrough = jax.jit(lambda a, b: (b, a, 2.0))

    def step(m1, m2, c):
        a, _ = bias(m1, c)
        b, z = bias(m2, c)            # the same call twice: its variables must be renamed
        x, y, two = passthrough(a, b)
        return x + y * two + z

    args = (jnp.ones(3), jnp.full(3, 2.0), jnp.float32(3.0))
    closed = _marked(jax.make_jaxpr(step)(*args))
    assert sum(inline.requested(e) for e in closed.jaxpr.eqns) == 3
    out = inline.run(closed)
    assert not any(e.primitive.name in ("jit", "pjit") for e in out.jaxpr.eqns)
    check_jaxpr(out.jaxpr)
    np.testing.assert_array_equal(jaxpr_as_fun(out)(*args)[0], step(*args))
    np.testing.assert_array_equal(jaxpr_as_fun(out)(*args)[0], jaxpr_as_fun(closed)(*args)[0])


def test_plain_calls_stay_and_a_jaxpr_without_requests_is_returned_as_is():
    closed = jax.make_jaxpr(lambda x: jax.jit(lambda y: y * 2)(x) + 1)(1.0)
    assert not any(inline.requested(e) for e in closed.jaxpr.eqns)
    assert inline.run(closed) is closed
