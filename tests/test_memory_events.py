"""The memory model's buffers for moved and reduce-scattered values (passes/memory.py).

What XLA's CPU build of such programs keeps live (read from the scheduled HLO of the
cost-model GPT under ZeRO-3, issue 44): a move that the partitioner would do by replicating
is gathered, sliced to its target at once and the gathered copy freed, so only the target's
copy stays live until its last read; a reduce-scatter lowered to an all-reduce and a slice
keeps the unscattered buffer only until the fusions that slice it, right after it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from autopar.graph import Graph
from autopar.passes import memory as mem


def _chain():
    """Four matmuls; the first one's output `a` is read by the next and by the last."""
    def f(x):
        a = jnp.sin(x) @ x
        b = jnp.tanh(a @ x)
        c = jnp.cos(b @ x)
        return (c @ a).sum()
    graph = Graph.from_jaxpr(jax.make_jaxpr(f)(jnp.ones((64, 64))))
    return graph, mem.analyze(graph)


def _events(graph, info, **kw):
    return mem.temp_buffers(graph, info, lambda v: float(graph.values[v].nbytes), **kw)


def _a(graph):
    """The first matmul's output (read by the second matmul and by the last)."""
    dots = [e for e in graph.eqns if e.name == "dot_general"]
    return dots[0].outputs[0], dots[1].index, dots[-1].index


def test_a_gathered_copy_lives_one_step_and_the_target_copy_until_the_last_read():
    graph, info = _chain()
    a, first, last = _a(graph)
    t0, t1 = int(info.runs_at[first]), int(info.runs_at[last])
    assert t1 > t0 + 1
    reads = [mem.Reshard(a, "target", 100.0, t, eqn=e, gathered=400.0)
             for e, t in ((first, t0), (last, t1))]
    events = [ev for ev in _events(graph, info, reshards=reads) if f"v{a}" in ev[3]
              and ("reshard" in ev[3] or "gathered" in ev[3])]
    assert sorted(events) == sorted([(t0, t1 + 1, 100.0, f"reshard v{a}"),
                                     (t0, t0 + 1, 300.0, f"gathered v{a}")])
    # Without a gathered layout, only the target's copy.
    plain = [mem.Reshard(a, "target", 100.0, t, eqn=e) for e, t in ((first, t0), (last, t1))]
    assert [ev for ev in _events(graph, info, reshards=plain) if "gathered" in ev[3]] == []


def test_a_cpu_reduce_scatter_keeps_the_unscattered_buffer_one_step():
    graph, info = _chain()
    a, _, _ = _a(graph)
    nbytes = float(graph.values[a].nbytes)

    def value_bytes(v):
        return nbytes / 4 if v == a else float(graph.values[v].nbytes)

    events = mem.temp_buffers(graph, info, value_bytes, partial={a: nbytes},
                              scatter_as_all_reduce=True)
    mine = {lab.split()[0]: (s, e, b) for s, e, b, lab in events if f"v{a}" in lab}
    s, e, kept = mine[f"v{a}"]
    assert mine["all-reduced"] == (s, s + 1, nbytes - nbytes / 4)
    assert kept == nbytes / 4 and e > s + 1
