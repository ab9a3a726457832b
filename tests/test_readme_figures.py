"""Every figure README.md quotes is in the results file it cites (issue 41).

The convention, checked here:

* README is read in units: a paragraph (lines up to a blank line), a list item, a table row
  or a heading; fenced code blocks are skipped, and so is text in `backticks` (names,
  commands, presets) when looking for figures.
* A unit cites a results file by naming it: `benchmarks/results/NAME.md` (or `.json`), or
  the bare `NAME.md` / `NAME.json` of a file in benchmarks/results/.
  `benchmarks/results/<suite>-<cluster>.md` cites every file of SUITE_FILES.
* A figure is a number with a decimal point (`0.98`, `1.0002`), a number with thousands
  separators (`217,039`), a number with a unit (`25 s`, `10.18 GiB`, `47%`, `1.57x`), a
  range of those (`0.69-0.84`, `357-369 TFLOP/s`: both ends), or a count `N of M` / `N/M`.
  Not figures: numbers inside names (GPT-2.6B, 8x8xV100, OSDI'22), version numbers
  (0.11.2), plain integers.
* Every figure of a unit that cites results files must be in one of them (its .md or .json):
  the same number at any precision that rounds to the printed digits (`2.44` matches
  2.4412), or after a unit conversion (GiB/MiB/... from bytes, s/ms/µs from one another,
  % from a fraction, TFLOP/s from FLOP/s); a count `N of M` as `N/M` or `N of M`.
* A unit that cites no results file may not quote figures, except those in ALLOWED: settings
  and published figures of others, each with its reason.

SUITE_FILES (the gpt/moe/wrn suites and the toy suite) are checked by their own test,
`test_suite_figures`, so that a stale suite figure is reported apart from the rest.  A
failure names the README line, the figure and the files it was looked for in.

The files themselves come from `python -m benchmarks all` (benchmarks/__main__.py), each
stamped by benchmarks/stamp.py; the last tests here check that every results file is one of
its parts' and that it runs, skips and times its parts as it says.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import pathlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"

SUITE_FILES = tuple(f"{suite}-{cluster}" for suite in ("gpt", "moe", "wrn")
                    for cluster in ("8x8xV100-16GB", "4x8xH100-80GB")) + ("toy-cpu-local",)

# Figures allowed in a unit that cites no results file: settings (what the code is told,
# not what it measured) and figures published by others, quoted as theirs.
ALLOWED = {
    "2,393 s": "Alpa's GPT-39B compilation time, profiling included (Alpa paper), published",
    "2.425 s": "Alpa's measured GPT-2.6B step (alpa benchmark README), published",
    "8.745 G": "Alpa's measured GPT-2.6B peak memory (alpa benchmark README), published",
    "39 TFLOP/s": "Megatron-LM's single-V100 baseline (Shoeybi et al. 2019), published",
    "47%": "the V100 preset's calibrated matmul fraction (cost_model/devices.py), a setting",
    "1.05x": "a budget the memory test sets (tests/test_memory_budget.py), a setting",
    "10%": "the tolerance the accuracy report counts within, a setting",
    "16 GiB": "a V100's memory, a datasheet figure",
    "1 MiB": "the largest output a multi-process pipeline returns on every process "
             "(autopar/runtime.py EVERYWHERE_MAX_BYTES), a setting",
    "120 s": "the bound on one cross-process copy (autopar/transfer.py TRANSFER_TIMEOUT_S), "
             "a setting",
    "60 s": "JAX's heartbeat / the launcher's initialization timeout, settings",
    "10 s": "the launcher's heartbeat timeout, a setting",
    "300 s": "JAX's initialization timeout, a setting",
    "20 s": "the penalty loop's round length on S, a setting",
    "13 s": "the penalty loop's round length it was compared with, a setting",
    "15%": "the tolerance the accuracy report counts within, a setting",
    "2 s": "the plan exchange's heartbeat interval (kv_store.PLAN_HEARTBEAT_S), a setting",
    "600 s": "dist.gather's wait bound (global_data.GATHER_TIMEOUT_S), a setting",
}

_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_UNIT = r"TFLOP/s|GiB|MiB|KiB|TiB|GB|MB|ms|µs|us|s|G|%|x|×"
_FIGURE = re.compile(
    rf"(?P<a>{_NUM})(?:\s?[–-]\s?(?P<b>{_NUM}))?(?:\s?(?P<unit>{_UNIT})(?![\w/]))?")
_COUNT = re.compile(rf"\b(\d+) of (\d+)\b(?!\s?(?:{_UNIT})(?![\w/]))|\b(\d+)/(\d+)\b")
_ANY_NUM = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?")
_CITE = re.compile(r"(?:benchmarks/results/)?([\w.<>-]+?)\.(?:md|json)\b")

_BYTES = {"GiB": (2**30,), "MiB": (2**20,), "KiB": (2**10,), "TiB": (2**40,),
          "GB": (1e9,), "MB": (1e6,), "G": (1e9, 2**30)}
_SECONDS = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6}


@dataclass(frozen=True)
class Figure:
    text: str           # as README prints it, e.g. "0.69-0.84" or "16 of 16"
    values: tuple       # (value, decimals) per number; for counts: ()
    unit: str | None
    count: tuple | None = None   # (n, m) for "N of M"


@dataclass(frozen=True)
class Unit:
    line: int
    text: str

    def short(self) -> str:
        text = " ".join(self.text.split())
        return f"README.md:{self.line}: {text[:160]}{'...' if len(text) > 160 else ''}"


def units(text: str) -> Iterator[Unit]:
    """Paragraphs, list items, table rows and headings, outside fenced code blocks."""
    block: list[str] = []
    start = 0
    fenced = False

    def flush():
        if block:
            yield Unit(start, "\n".join(block))
            block.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            yield from flush()
            fenced = not fenced
            continue
        if fenced:
            continue
        stripped = line.strip()
        if not stripped:
            yield from flush()
        elif (stripped.startswith(("#", "|")) or re.match(r"([-*]|\d+\.) ", stripped)
              and not line.startswith("  ")):
            yield from flush()
            start = number
            block.append(line)
            if stripped.startswith(("#", "|")):
                yield from flush()
        else:
            if not block:
                start = number
            block.append(line)
    yield from flush()


def cited(unit: Unit, results: pathlib.Path = RESULTS) -> list[str]:
    """The results files (stems) a unit cites."""
    names = []
    for match in _CITE.finditer(unit.text):
        stem = match.group(1)
        if stem == "<suite>-<cluster>":
            names += SUITE_FILES
        elif match.group(0).startswith("benchmarks/results/") or any(
                (results / f"{stem}{ext}").exists() for ext in (".md", ".json")):
            names.append(stem)
    return list(dict.fromkeys(names))


def _decimals(number: str) -> int:
    return len(number.split(".")[1]) if "." in number else 0


def _value(number: str) -> float:
    return float(number.replace(",", ""))


def figures(unit: Unit) -> list[Figure]:
    text = re.sub(r"`[^`]*`", " ", unit.text)          # code: names, commands
    text = re.sub(r"\]\([^)]*\)", "]", text)            # link targets
    found = []
    for m in _COUNT.finditer(text):
        n, total = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        found.append(Figure(m.group(0), (), None, (int(n), int(total))))
    counted = [m.span() for m in _COUNT.finditer(text)]
    for m in _FIGURE.finditer(text):
        a, b, unit_ = m.group("a"), m.group("b"), m.group("unit")
        before = text[max(0, m.start() - 2):m.start()]
        after = text[m.end():m.end() + 1]
        if any(s <= m.start() < e for s, e in counted):
            continue
        if re.search(r"[\w'.]\Z|[A-Za-z]-\Z", before):      # GPT-2.6B, OSDI'22, a.b.c
            continue
        if after[:1].isalnum() or after in (".",) and re.match(r"\.\d", text[m.end():]):
            continue                                      # 350M, 8x8xV100, 0.11.2
        if unit_ and unit_ not in ("x", "×", "%") and not m.group(0)[:-len(unit_)].endswith(" "):
            continue                                      # 80GB, 16GB: a product's name
        if b is not None and re.match(r"\d", text[m.end():m.end() + 1] or " "):
            continue
        numbers = [x for x in (a, b) if x is not None]
        if not (unit_ or any("." in x or "," in x for x in numbers)):
            continue
        if unit_ in ("x", "×") and not any("." in x for x in numbers):
            # "2 x 2" and "8x" are shapes or counts; a ratio is printed with decimals.
            continue
        found.append(Figure(m.group(0).strip(), tuple((_value(x), _decimals(x)) for x in numbers),
                            unit_))
    return found


class Source:
    """The numbers (and the text) of one results file's .md and .json."""

    def __init__(self, results: pathlib.Path, stem: str):
        self.stem = stem
        self.text = ""
        numbers: list[float] = []
        for ext in (".md", ".json"):
            path = results / f"{stem}{ext}"
            if not path.exists():
                continue
            body = path.read_text()
            self.text += body + "\n"
            if ext == ".json":
                self._walk(json.loads(body), numbers)
            else:
                numbers += [_value(x) for x in _ANY_NUM.findall(body)]
        self.exists = bool(self.text)
        self.numbers = sorted(abs(x) for x in numbers if math.isfinite(x))

    def _walk(self, node, out: list[float]) -> None:
        if isinstance(node, bool):
            return
        if isinstance(node, (int, float)):
            out.append(float(node))
        elif isinstance(node, str):
            out += [_value(x) for x in _ANY_NUM.findall(node)]
        elif isinstance(node, dict):
            for key, value in node.items():
                self._walk(key, out)
                self._walk(value, out)
        elif isinstance(node, list):
            for value in node:
                self._walk(value, out)

    def _near(self, target: float, tol: float) -> bool:
        i = bisect.bisect_left(self.numbers, target - tol)
        return i < len(self.numbers) and self.numbers[i] <= target + tol

    def has_count(self, n: int, m: int) -> bool:
        return f"{n}/{m}" in self.text or f"{n} of {m}" in self.text

    def has_value(self, value: float, decimals: int, unit: str | None) -> bool:
        """A stored w whose value in `unit` rounds to `value` at `decimals` digits."""
        scales = [1.0]
        if unit in _BYTES:
            scales += list(_BYTES[unit])
        elif unit in _SECONDS:
            scales += [_SECONDS[unit] / s for s in _SECONDS.values()]
        elif unit == "%":
            scales += [0.01]
        elif unit == "TFLOP/s":
            scales += [1e12]
        tol = 0.5 * 10.0 ** -decimals + 1e-9 * abs(value)
        return any(self._near(abs(value) * s, tol * s) for s in scales)


def found(figure: Figure, sources: list[Source]) -> bool:
    """Every number of the figure is in one of the sources (a range may span two files)."""
    if figure.count is not None:
        return any(src.has_count(*figure.count) for src in sources)
    return all(any(src.has_value(value, decimals, figure.unit) for src in sources)
               for value, decimals in figure.values)


@functools.cache
def _source(results: pathlib.Path, stem: str) -> Source:
    return Source(results, stem)


def problems(text: str, suite: bool, results: pathlib.Path = RESULTS) -> list[str]:
    """What README quotes and its results files do not say: for the units citing a suite
    file (suite=True) or the others (suite=False)."""
    out = []
    for unit in units(text):
        stems = cited(unit, results)
        if bool(set(stems) & set(SUITE_FILES)) != suite:
            continue
        figs = figures(unit)
        if not stems:
            for fig in figs:
                if fig.text not in ALLOWED:
                    out.append(f"{unit.short()}\n    figure {fig.text!r} cites no results "
                               "file (cite one, or add it to ALLOWED with the reason)")
            continue
        sources = [_source(results, s) for s in stems]
        for src in sources:
            if not src.exists:
                out.append(f"{unit.short()}\n    cites {src.stem}, which is not in "
                           "benchmarks/results/")
        sources = [src for src in sources if src.exists]
        for fig in figs:
            if fig.text in ALLOWED or found(fig, sources):
                continue
            out.append(f"{unit.short()}\n    figure {fig.text!r} is not in "
                       f"{', '.join(f'{s}.md/.json' for s in stems)}")
    return out


def test_readme_figures_are_in_their_results_files():
    found = problems(README.read_text(), suite=False)
    assert not found, "\n".join(found)


def test_suite_figures():
    found = problems(README.read_text(), suite=True)
    assert not found, "\n".join(found)


def test_every_allowed_figure_is_quoted():
    # ALLOWED stays small: an entry README no longer quotes goes.
    quoted = {f.text for unit in units(README.read_text()) for f in figures(unit)}
    assert set(ALLOWED) <= quoted, f"not in README any more: {sorted(set(ALLOWED) - quoted)}"


def test_the_checker_catches_a_wrong_figure(tmp_path):
    (tmp_path / "demo.md").write_text("# demo\n\n| a | 2.4412 | 10930143150 | 16/16 |\n")
    (tmp_path / "demo.json").write_text(json.dumps({"meta": {}, "rows": [{"ratio": 0.9792}]}))
    good = ("Figures (`benchmarks/results/demo.md`): 2.44 s and 10.18 GiB, "
            "Spearman 0.98, 16 of 16.\n")
    assert problems(good, False, tmp_path) == []
    bad = "Figures (`benchmarks/results/demo.md`): 2.40 s and 9.4 GiB, 15 of 16.\n"
    found = problems(bad, False, tmp_path)
    assert [f.split("figure ")[1].split(" is")[0] for f in found] == [
        "'15 of 16'", "'2.40 s'", "'9.4 GiB'"]
    assert found[0].startswith("README.md:1: Figures")
    assert len(problems("Measured: 3.5 s per step.\n", False, tmp_path)) == 1
    assert problems("GPT-2.6B on 8x8xV100 with jax 0.11.2, OSDI'22.\n", False, tmp_path) == []
    assert problems("`benchmarks/results/none.md`: 1.5 s\n", False, tmp_path)


# `python -m benchmarks all` regenerates the files README quotes: every file of
# benchmarks/results/ is one of its parts', and it runs, skips and times them as it says.


def test_benchmarks_all_writes_every_results_file():
    from benchmarks import __main__ as bench

    writes = {name for part in bench.parts() for name in part.writes}
    missing = [p.name for p in RESULTS.iterdir()
               if not p.name.startswith("gpu-") and p.name not in writes]   # gpu_check's
    assert not missing, f"no part of `python -m benchmarks all` writes {missing}"


def test_benchmarks_all_runs_skips_and_times_its_parts(monkeypatch, capsys):
    from benchmarks import __main__ as bench

    monkeypatch.setattr(bench, "parts", lambda: [
        bench.Part("a", (("benchmarks.x",), ("benchmarks.y", "f.json")), ("a.md",)),
        bench.Part("b", (("benchmarks.z",),), ("b.md", "b.json")),
        bench.Part("gpu", (("benchmarks.gpu_check",),), ("gpu.md",), lambda: "GPU-only"),
    ])
    calls = []

    def run_command(args):
        calls.append(tuple(args))
        return 1 if args[0] == "benchmarks.z" else 0

    monkeypatch.setattr(bench, "run_command", run_command)
    assert bench.main(["all"]) == 1
    assert calls == [("benchmarks.x",), ("benchmarks.y", "f.json"), ("benchmarks.z",)]
    out = capsys.readouterr().out
    assert "== a: done in " in out
    assert "== b: failed (python -m benchmarks.z: exit status 1) in " in out
    assert "== gpu: skipped (GPU-only)" in out
    assert "== all: 3 parts in " in out and "failed: b failed" in out

    calls.clear()
    assert bench.main(["all", "--dry-run"]) == 0 and calls == []
    out = capsys.readouterr().out
    assert "== a: writes a.md in benchmarks/results/" in out
    assert "   python -m benchmarks.y f.json" in out and "== gpu: skipped" in out
    assert bench.main(["all", "--only", "a"]) == 0 and calls == [("benchmarks.x",),
                                                                ("benchmarks.y", "f.json")]
    assert bench.main(["all", "--list"]) == 0
    assert capsys.readouterr().out.endswith("a: a.md\nb: b.md, b.json\ngpu: gpu.md\n")
    assert bench.main(["all", "--only", "a,nope"]) == 2
    assert "unknown part(s) nope; parts: a, b, gpu" in capsys.readouterr().err
