"""benchmarks.layering_gap: its summary, its page, and one small model measured."""

from __future__ import annotations

import pytest

from benchmarks import layering_gap as lg


def _row(name: str, r1: float | None, r2: float | None, before: float = 1.0, **extra) -> dict:
    """A row whose search's plan is `r1` / `r2` times one layer per stage, and its plan of
    layer solutions `before` times that."""
    row = {"model": name, "family": "mlp", "shard_s": 0.01, "shard_search_s": 0.1}
    for stages, ratio in ((1, r1), (2, r2)):
        row[f"auto{stages}_s"] = None if ratio is None else 0.002 * ratio
        row[f"layers{stages}_s"] = None if ratio is None else 0.002 * before
        row[f"joint{stages}_s"] = None if ratio is None else 0.002
        row[f"auto{stages}_search_s"] = row[f"joint{stages}_search_s"] = 0.5
        row[f"ratio{stages}"] = ratio
        row[f"before{stages}"] = None if ratio is None else before
    row.update(extra)
    return row


def test_summary_worst_median_best_and_losing():
    rows = [_row("a", 1.0, 1.5, before=1.5), _row("b", 1.3, None, joint2_skip="too few"),
            _row("c", 0.8, 1.04)]
    by = {(s["stages"], s["plan"]): s for s in lg.summary(rows)}
    assert by[1, "search"] == {"stages": 1, "plan": "search", "models": 3, "worst": 1.3,
                               "median": 1.0, "best": 0.8, "losing": 1}
    assert by[1, "layers"]["worst"] == 1.5 and by[1, "layers"]["losing"] == 1
    # a model without a 2-stage pair is left out of that row, not counted as 1.0
    assert by[2, "search"]["models"] == 2 and by[2, "search"]["worst"] == 1.5


def test_markdown_lists_every_model_and_why_one_was_not_planned():
    rows = [_row("a", 1.2, 1.0, before=1.4), _row("b", 1.0, None, joint2_skip="too few")]
    text = lg.markdown(rows, {"commit": "abc", "date": "d", "machine": "m", "command": "c"}, 4)
    assert "| 1 | search | 2 | 1.20 | 1.10 | 1.00 | 1 |" in text
    assert "| 1 | layers | 2 | 1.40 | 1.20 | 1.00 | 1 |" in text
    assert "| a | 10.00 | 2.80 | 2.40 | 2.00 | 1.40/1.20 |" in text
    assert "b joint2: too few" in text


@pytest.mark.timeout(300)
def test_measure_a_small_mlp():
    from benchmarks.runtime_overhead import _mlp_case

    row = lg.measure("mlp 2x64", "mlp", *_mlp_case(32, 64, 2))
    for stages in (1, 2):
        auto, joint = row[f"auto{stages}_s"], row[f"joint{stages}_s"]
        assert auto > 0 and joint > 0
        assert row[f"ratio{stages}"] == pytest.approx(auto / joint, abs=1e-3)
        # joint solves only ever lower the plan of layer solutions
        assert row[f"layers{stages}_s"] >= auto
    assert row["shard_s"] > 0
