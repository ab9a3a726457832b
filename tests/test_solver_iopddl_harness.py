"""benchmarks.solver_iopddl's harness: the busy processes always stop, the results name
stays inside benchmarks/results, and the page says which lower bound it holds."""

from __future__ import annotations

import argparse
import json
import subprocess

import pytest

from benchmarks import solver_iopddl


def test_busy_stops_the_started_spinners_when_a_later_start_fails(monkeypatch):
    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    def flaky(*args, **kw):
        if started:
            raise OSError("no more processes")
        started.append(real(*args, **kw))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", flaky)
    with pytest.raises(OSError, match="no more processes"):
        with solver_iopddl.busy(2):
            pass
    assert len(started) == 1
    assert started[0].poll() is not None  # terminated, not orphaned


@pytest.mark.parametrize("out", ["../elsewhere", "a/b", "", ".hidden", "x y"])
def test_out_outside_the_results_folder_is_refused(out, capsys):
    with pytest.raises(SystemExit):
        solver_iopddl.main(["--out", out, "--dir", "/nonexistent"])
    assert "--out must be a file name" in capsys.readouterr().err


def _row(**kw) -> dict:
    row = {"instance": "A", "time_limit_s": 60.0, "best_known": 100.0,
           "best_known_source": "contest", "known_lower_bound": 90.0,
           "known_lower_bound_source": "paper", "cost": 101.0, "feasible": True,
           "ratio_to_best": 1.01, "lower_bound": None, "bound_vs_known": None,
           "seconds": 59.0, "bound_seconds": 0.0, "status": "time limit",
           "backend": "toulbar2"}
    row.update(kw)
    return row


@pytest.mark.parametrize("scale,lagrangian", [(0.0, False), (1.0, True)])
def test_the_page_names_the_bound_it_computed(scale, lagrangian):
    args = argparse.Namespace(busy=2, backend="toulbar2", time_scale=1.0,
                              bound_time_scale=scale)
    text = solver_iopddl.markdown([_row()], args, {"commit": "abc", "command": "cmd"})
    assert ("else the Lagrangian bound" in text) == lagrangian
    assert ("no Lagrangian bound was computed" in text) == (not lagrangian)


def test_render_rewrites_the_page_from_its_results_file(monkeypatch, tmp_path):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    meta = {"commit": "abc1234", "date": "2026-12-02T00:00:00Z", "machine": "test",
            "command": "python -m benchmarks.solver_iopddl --instances A --busy 2 "
                       "--bound-time-scale 0 --out busy_page"}
    (results / "busy_page.json").write_text(json.dumps({"meta": meta, "rows": [_row()]}))
    monkeypatch.setattr(solver_iopddl, "REPO", tmp_path)
    solver_iopddl.main(["--render", "--out", "busy_page"])
    text = (results / "busy_page.md").read_text()
    assert "2 busy processes beside it" in text           # the recorded command's options
    assert "no Lagrangian bound was computed" in text
    assert "abc1234" in text and "| 101 |" in text        # its stamp and its rows


def test_render_refuses_a_results_file_without_a_stamp(monkeypatch, tmp_path, capsys):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "old.json").write_text(json.dumps([_row()]))
    monkeypatch.setattr(solver_iopddl, "REPO", tmp_path)
    with pytest.raises(SystemExit):
        solver_iopddl.main(["--render", "--out", "old"])
    assert "holds no stamp" in capsys.readouterr().err
    assert not (results / "old.md").exists()
