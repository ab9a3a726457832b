"""Inter-op stage DP against brute force on random cost tables; device assignment (no devices)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from autopar.passes import inter_op
from autopar.passes.inter_op import StageChoice


def _compositions(num_layers: int):
    """Every split of 0..L-1 into contiguous inclusive ranges."""
    for bits in itertools.product((0, 1), repeat=num_layers - 1):
        cuts = [i + 1 for i, b in enumerate(bits) if b]
        bounds = [0, *cuts, num_layers]
        yield [(a, b - 1) for a, b in zip(bounds, bounds[1:])]


def _brute_force(num_layers, sizes, table, num_devices, B, num_stages=None) -> float:
    best = math.inf
    for ranges in _compositions(num_layers):
        if num_stages is not None and len(ranges) != num_stages:
            continue
        for subs in itertools.product(range(len(sizes)), repeat=len(ranges)):
            if sum(sizes[s] for s in subs) != num_devices:
                continue
            costs = [table.get((i, j, s)) for (i, j), s in zip(ranges, subs)]
            if any(c is None for c in costs):
                continue
            best = min(best, sum(costs) + (B - 1) * max(costs))
    return best


def _random_table(rng, num_layers, num_subs, p_none):
    table = {}
    for i in range(num_layers):
        for j in range(i, num_layers):
            for s in range(num_subs):
                if rng.random() >= p_none:
                    table[(i, j, s)] = float(rng.uniform(0.1, 3.0))
    return table


class _Counting:
    """A stage_cost that checks each triple is asked at most once."""

    def __init__(self, table):
        self.table, self.seen = table, set()

    def __call__(self, i, j, s):
        assert (i, j, s) not in self.seen, f"stage_cost({i}, {j}, {s}) asked twice"
        self.seen.add((i, j, s))
        return self.table.get((i, j, s))


def _check_result(res, num_layers, shapes, table, num_devices, B, num_stages=None):
    stages = res.stages
    assert stages[0].layers[0] == 0 and stages[-1].layers[1] == num_layers - 1
    assert all(a.layers[1] + 1 == b.layers[0] for a, b in zip(stages, stages[1:]))
    assert sum(h * m for st in stages for h, m in [st.submesh]) == num_devices
    if num_stages is not None:
        assert len(stages) == num_stages
    for st in stages:
        assert st.cost_s == table[(*st.layers, shapes.index(st.submesh))]
    assert res.t_max_s == max(st.cost_s for st in stages)
    assert res.total_s == pytest.approx(sum(st.cost_s for st in stages) + (B - 1) * res.t_max_s)


CLUSTERS = [(1, 4), (2, 2), (1, 8)]


@pytest.mark.parametrize("hosts,per_host", CLUSTERS)
@pytest.mark.parametrize("p_none", [0.0, 0.35])
def test_dp_equals_brute_force(hosts, per_host, p_none):
    rng = np.random.default_rng(hash((hosts, per_host, p_none)) % 2**32)
    shapes = inter_op.submesh_shapes(hosts, per_host)
    sizes = [h * m for h, m in shapes]
    num_devices = hosts * per_host
    checked = 0
    for num_layers in range(1, 7):
        for B in (1, 4, 8):
            table = _random_table(rng, num_layers, len(shapes), p_none)
            stage_options = [None, int(rng.integers(1, min(num_layers, num_devices) + 1))]
            for num_stages in stage_options:
                want = _brute_force(num_layers, sizes, table, num_devices, B, num_stages)
                cost = _Counting(table)
                if math.isinf(want):
                    with pytest.raises(ValueError, match="no stage layout fits"):
                        inter_op.run(num_layers, shapes, cost, num_devices=num_devices,
                                     num_micro_batches=B, num_stages=num_stages)
                    continue
                res = inter_op.run(num_layers, shapes, cost, num_devices=num_devices,
                                   num_micro_batches=B, num_stages=num_stages)
                assert res.total_s == pytest.approx(want, rel=1e-12)
                _check_result(res, num_layers, shapes, table, num_devices, B, num_stages)
                assert res.stats["stage_cost_calls"] == len(cost.seen)
                checked += 1
    assert checked >= 20


def test_uniform_split_is_never_better():
    rng = np.random.default_rng(7)
    shapes = inter_op.submesh_shapes(2, 4)             # (1,1) (1,2) (1,4) (2,4)
    sizes = [h * m for h, m in shapes]
    num_layers = 8
    for _ in range(10):
        layer_s = rng.uniform(0.5, 2.0, size=num_layers)
        overhead = rng.uniform(0.0, 0.3)

        def cost(i, j, s, layer_s=layer_s, overhead=overhead):
            # compute scales sub-linearly with devices; some ranges do not fit one device
            work = layer_s[i:j + 1].sum()
            if sizes[s] == 1 and j - i >= 4:
                return None
            return work / sizes[s] ** 0.8 + overhead * math.log2(sizes[s] + 1)

        for B in (1, 4, 16):
            res = inter_op.run(num_layers, shapes, cost, num_devices=8, num_micro_batches=B)
            for num_stages in (1, 2, 4, 8):
                size = 8 // num_stages
                s = sizes.index(size)
                per = num_layers // num_stages
                costs = [cost(k * per, (k + 1) * per - 1, s) for k in range(num_stages)]
                if any(c is None for c in costs):
                    continue
                uniform = sum(costs) + (B - 1) * max(costs)
                assert res.total_s <= uniform + 1e-12
                fixed = inter_op.run(num_layers, shapes, cost, num_devices=8,
                                     num_micro_batches=B, num_stages=num_stages)
                assert res.total_s <= fixed.total_s + 1e-12 <= uniform + 2e-12


def test_skips_ranges_that_cannot_be_used():
    shapes = inter_op.submesh_shapes(1, 4)
    asked = []

    def cost(i, j, s):
        asked.append((i, j, s))
        return 1.0

    inter_op.run(3, shapes, cost, num_devices=4, num_micro_batches=2)
    # the whole model must take all 4 devices; a partial range cannot take all 4
    assert (0, 2, 0) not in asked and (0, 2, 2) in asked and (0, 1, 2) not in asked
    asked.clear()
    inter_op.run(3, shapes, cost, num_devices=4, num_micro_batches=2, num_stages=3)
    assert all(j == i for i, j, _ in asked) and all(shapes[s] != (1, 4) for *_, s in asked)


def test_submesh_shapes():
    assert inter_op.submesh_shapes(1, 8) == [(1, 1), (1, 2), (1, 4), (1, 8)]
    assert inter_op.submesh_shapes(2, 2) == [(1, 1), (1, 2), (2, 2)]
    assert inter_op.submesh_shapes(3, 6) == [(1, 1), (1, 2), (1, 4), (1, 6), (2, 6), (3, 6)]
    assert inter_op.submesh_shapes(3, 1) == [(1, 1), (2, 1), (3, 1)]
    with pytest.raises(ValueError, match="devices_per_host, got 0"):
        inter_op.submesh_shapes(1, 0)


def test_errors():
    """What cannot be laid out raises `NoStageLayoutError` (callers that try several
    candidates skip those); bad arguments raise plain `ValueError`s, never read as "does
    not fit"."""
    shapes = inter_op.submesh_shapes(1, 4)
    ok = lambda i, j, s: 1.0
    for bad in (dict(num_micro_batches=0), dict(num_micro_batches=1, num_stages=0)):
        with pytest.raises(ValueError) as err:
            inter_op.run(4, shapes, ok, num_devices=4, **bad)
        assert not isinstance(err.value, inter_op.NoStageLayoutError)
    with pytest.raises(inter_op.NoStageLayoutError, match="num_stages=5 exceeds num_layers=4"):
        inter_op.run(4, shapes, ok, num_devices=4, num_micro_batches=1, num_stages=5)
    with pytest.raises(inter_op.NoStageLayoutError,
                       match=r"num_stages=3 needs at least 3 devices .* only "
                                         r"num_devices=2"):
        inter_op.run(4, shapes, ok, num_devices=2, num_micro_batches=1, num_stages=3)
    with pytest.raises(ValueError, match="num_micro_batches, got 0"):
        inter_op.run(4, shapes, ok, num_devices=4, num_micro_batches=0)
    with pytest.raises(ValueError, match="returned nan"):
        inter_op.run(2, shapes, lambda i, j, s: float("nan"), num_devices=4,
                     num_micro_batches=1)
    # layer 2 fits nowhere, whatever it is grouped with
    with pytest.raises(inter_op.NoStageLayoutError, match="layer 2 does not fit on any sub-mesh"):
        inter_op.run(4, shapes, lambda i, j, s: None if i <= 2 <= j else 1.0,
                     num_devices=4, num_micro_batches=2)
    # every range fits, but (1, 4) sub-meshes cannot make 6 devices
    with pytest.raises(ValueError, match=r"sizes \[4\]\) .* sum to num_devices=6"):
        inter_op.run(2, [(1, 4)], ok, num_devices=6, num_micro_batches=2)
    # each layer fits one device only: 2 stages on 4 devices cannot be filled
    with pytest.raises(ValueError, match=r"sum to num_devices=4 \(feasible layouts use \[2\]"):
        inter_op.run(2, [(1, 1), (1, 2)], lambda i, j, s: None if s == 1 else 1.0,
                     num_devices=4, num_micro_batches=2)


def test_assign_devices():
    def st(*shapes):
        return [StageChoice((k, k), sh, 1.0) for k, sh in enumerate(shapes)]

    assert inter_op.assign_devices(st((1, 2), (1, 4), (1, 2)), 1, 8) == [
        [0, 1], [2, 3, 4, 5], [6, 7]]
    # in pipeline order (1, 4) would straddle hosts 0 and 1: packed by size instead
    assert inter_op.assign_devices(st((1, 2), (1, 4), (1, 2)), 2, 4) == [
        [4, 5], [0, 1, 2, 3], [6, 7]]
    assert inter_op.assign_devices(st((1, 2), (2, 4), (1, 2)), 3, 4) == [
        [8, 9], [0, 1, 2, 3, 4, 5, 6, 7], [10, 11]]
    assert inter_op.assign_devices([(1, 4), (2, 4)], 3, 4) == [
        [0, 1, 2, 3], list(range(4, 12))]
    assert inter_op.assign_devices([(1, 1)], 2, 4) == [[0]]     # unused devices are fine
    with pytest.raises(ValueError, match=r"do not pack into 2 hosts x 6 devices"):
        inter_op.assign_devices(st((1, 4), (1, 4), (1, 4)), 2, 6)
    with pytest.raises(ValueError, match=r"\(2, 3\) does not fit a 2x4 cluster"):
        inter_op.assign_devices([(2, 3)], 2, 4)
    with pytest.raises(ValueError, match="need 12 devices; the cluster has 2x4 = 8"):
        inter_op.assign_devices([(2, 4), (1, 4)], 2, 4)


@pytest.mark.parametrize("hosts,per_host", CLUSTERS + [(2, 8), (4, 4)])
def test_dp_layouts_pack(hosts, per_host):
    rng = np.random.default_rng(hosts * 100 + per_host)
    shapes = inter_op.submesh_shapes(hosts, per_host)
    for _ in range(5):
        cost = _Counting(_random_table(rng, 6, len(shapes), 0.2))
        try:
            res = inter_op.run(6, shapes, cost, num_devices=hosts * per_host,
                               num_micro_batches=4)
        except ValueError:
            continue
        ids = inter_op.assign_devices(res.stages, hosts, per_host)
        flat = sorted(d for stage in ids for d in stage)
        assert flat == list(range(hosts * per_host))


@pytest.mark.parametrize("num_stages", [None, 2, 3])
def test_asked_is_what_run_asks(num_stages):
    """`inter_op.asked` lists the stage costs `run` asks for, in its order (the pipeline
    search prices them ahead, sub-meshes side by side)."""
    shapes = inter_op.submesh_shapes(2, 4)
    seen = []

    def cost(i, j, s):
        seen.append((i, j, s))
        return 1.0 + (j - i) / shapes[s][0] / shapes[s][1]

    inter_op.run(5, shapes, cost, num_devices=8, num_micro_batches=4, num_stages=num_stages)
    assert inter_op.asked(5, shapes, num_devices=8, num_stages=num_stages) == seen
