"""The plans Alpa's own search found for the Alpa paper's weak-scaling cases, as published in
its benchmark (alpa-projects/alpa, `benchmark/alpa/suite_auto_gpt.py`, `suite_auto_moe.py`
and `suite_wresnet.py`: the `perf_test_*` suites, "search solutions found for
p3.16xlarge", i.e. 8 x V100-16GB per host).  Each is Alpa's layer-to-stage assignment over
its own layering (`num_auto_layers` layers), each stage's physical sub-mesh and logical mesh,
whether the batch is forced onto logical mesh dim 0 (`force_batch_dim_to_mesh_dim`), and
the micro-batch count.  `benchmarks.suite` prices them with the step model every other row
gets (`benchmarks.layouts.Pricer`), the intra-op layout of each stage solved by autopar's
ILP on Alpa's logical mesh, as Alpa's ILP solved it on the same mesh.

Alpa's layers are not autopar's: a stage spanning Alpa layers a..b of L_a takes autopar's
layers round(a·L/L_a) .. round((b+1)·L/L_a) − 1 of L (`map_stages`).  Alpa's WRN-13B case
(64 GPUs) has no counterpart in the suites (they stop at WRN-6.8B on 32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class AlpaPlan:
    """One published plan: `model` (the zoo's name), `micro` micro-batches, `layers` =
    Alpa's num_auto_layers, per stage its Alpa layer ids `stage_layers`, `submeshes`
    (hosts, devices per host), `logical` mesh shapes and `force_dp` (batch on mesh dim 0)."""

    model: str
    micro: int
    layers: int
    stage_layers: tuple[tuple[int, ...], ...]
    submeshes: tuple[tuple[int, int], ...]
    logical: tuple[tuple[int, int], ...]
    force_dp: tuple[bool, ...]

    @property
    def devices(self) -> int:
        return sum(a * b for a, b in self.submeshes)


def _plan(model, micro, layers, stage_layers, submeshes, logical, force_dp) -> AlpaPlan:
    return AlpaPlan(model, micro, layers, tuple(tuple(s) for s in stage_layers),
                    tuple(submeshes), tuple(logical), tuple(force_dp))


def _even(layers: int, stages: int) -> list[list[int]]:
    per = layers // stages
    return [list(range(k * per, (k + 1) * per)) for k in range(stages)]


# devices -> plan, per suite (suite_auto_gpt.py perf_test_suite; suite_auto_moe.py
# perf_test_suite; suite_wresnet.py perf_test_auto_suite).
ALPA_PLANS: dict[str, dict[int, AlpaPlan]] = {
    "gpt": {
        1: _plan("gpt-350m", 512, 1, [[0]], [(1, 1)], [(1, 1)], [False]),
        2: _plan("gpt-760m", 128, 6, _even(6, 2), [(1, 1)] * 2, [(1, 1)] * 2, [True] * 2),
        4: _plan("gpt-1.3b", 128, 6, _even(6, 2), [(1, 2)] * 2, [(2, 1)] * 2, [True] * 2),
        8: _plan("gpt-2.6b", 128, 8, [[0, 1], [2, 3], [4, 5, 6, 7]],
                 [(1, 2), (1, 2), (1, 4)], [(2, 1), (2, 1), (4, 1)], [True, False, False]),
        16: _plan("gpt-6.7b", 64, 8, _even(8, 2), [(1, 8)] * 2, [(2, 4)] * 2, [True] * 2),
        32: _plan("gpt-15b", 128, 16, _even(16, 4), [(1, 8)] * 4, [(2, 4)] * 4, [True] * 4),
        64: _plan("gpt-39b", 1024, 16, _even(16, 16), [(1, 4)] * 16, [(1, 4)] * 16,
                  [True] * 16),
    },
    "moe": {
        1: _plan("moe-380m", 512, 1, [[0]], [(1, 1)], [(1, 1)], [False]),
        2: _plan("moe-690m", 32, 8, _even(8, 1), [(1, 2)], [(2, 1)], [True]),
        4: _plan("moe-1.3b", 32, 8, _even(8, 2), [(1, 2)] * 2, [(2, 1)] * 2, [True] * 2),
        8: _plan("moe-2.4b", 32, 8, _even(8, 2), [(1, 4)] * 2, [(4, 1)] * 2, [True] * 2),
        16: _plan("moe-10b", 16, 8, _even(8, 2), [(1, 8)] * 2, [(8, 1)] * 2, [False] * 2),
        32: _plan("moe-27b", 128, 8, _even(8, 8), [(1, 4)] * 8, [(4, 1)] * 8, [False] * 8),
        64: _plan("moe-70b", 64, 8, _even(8, 8), [(1, 8)] * 8, [(8, 1)] * 8, [False] * 8),
    },
    "wrn": {
        1: _plan("wrn-250m", 24, 16, [list(range(16))], [(1, 1)], [(1, 1)], [False]),
        2: _plan("wrn-500m", 24, 16, [list(range(16))], [(1, 2)], [(1, 2)], [False]),
        4: _plan("wrn-1b", 24, 16, [list(range(16))], [(1, 4)], [(1, 4)], [False]),
        8: _plan("wrn-2b", 24, 16, _even(16, 2), [(1, 4)] * 2, [(4, 1), (1, 4)],
                 [False, True]),
        16: _plan("wrn-4b", 32, 16, [[0, 1, 2, 3, 4], [5, 6, 7, 8], list(range(9, 16))],
                  [(1, 4), (1, 4), (1, 8)], [(4, 1), (4, 1), (8, 1)], [True, True, False]),
        32: _plan("wrn-6.8b", 32, 16, [[0, 1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12],
                                       [13, 14, 15]],
                  [(1, 8)] * 4, [(8, 1)] * 4, [True, False, False, False]),
    },
}


def alpa_plan(suite: str, devices: int, model: str) -> AlpaPlan | None:
    """Alpa's published plan for the case, or None (no such case, or another model)."""
    plan = ALPA_PLANS.get(suite, {}).get(devices)
    return plan if plan is not None and plan.model == model else None


def map_stages(plan: AlpaPlan, num_layers: int) -> list[tuple[int, int]]:
    """(first, last) of autopar's `num_layers` layers for each of the plan's stages (see
    the module docstring); ValueError if a stage would get no layer."""
    out = []
    for ids in plan.stage_layers:
        first = round(min(ids) * num_layers / plan.layers)
        stop = round((max(ids) + 1) * num_layers / plan.layers)
        if stop <= first:
            raise ValueError(f"Alpa's plan for {plan.model}: stage of Alpa layers {list(ids)} "
                             f"gets none of autopar's {num_layers} layers")
        out.append((first, stop - 1))
    covered = [k for a, b in out for k in range(a, b + 1)]
    if covered != list(range(num_layers)):
        raise ValueError(f"Alpa's plan for {plan.model}: its stages map to layers {out}, not "
                         f"a cover of 0..{num_layers - 1}")
    return out


def describe(plan: AlpaPlan, stages: Sequence[tuple[int, int]]) -> str:
    """One line: each stage's autopar layers, logical mesh (·dp where the batch is forced
    on dim 0), and the micro-batch count."""
    parts = [f"{a}-{b}:{list(m)}{'·dp' if f else ''}"
             for (a, b), m, f in zip(stages, plan.logical, plan.force_dp)]
    return "; ".join(parts) + f" B={plan.micro}"
