"""The benchmark harness's command line (also reached as `autopar bench ...` from a checkout):

    python -m benchmarks [suite] gpt|moe|wrn --cluster PRESET|cluster.json
                         [--max-devices N] [--output-dir DIR]
    python -m benchmarks [suite] toy [--output-dir DIR]
    python -m benchmarks all [--only NAME[,NAME]] [--list] [--dry-run]

gpt/moe/wrn price the Alpa paper's weak-scaling cases for autopar and the hand-written
strategies on a cluster preset; toy runs every strategy for real on 8 emulated CPU devices
and checks the results against the single-device step (exit status 1 if any differs).
all regenerates every file of benchmarks/results/ this machine can make (each part in a
fresh process, with the module's documented defaults: the six suites with their audits and
explanations (`benchmarks.explain`), toy,
every other benchmark module, the saved plans, the fuzz over generated models), skips the
GPU-only ones with a note, and prints the wall time of each part and in all; --list names
the parts, --dry-run prints the plan without running it.  The whole run takes hours on 2
cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import pathlib
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results"
IOPDDL_DIR = ROOT.parent / "shared" / "iopddl"   # solver_iopddl's and solver_tb2_settings' --dir
SUITE_CLUSTERS = ("8x8xV100-16GB", "4x8xH100-80GB")


@dataclasses.dataclass(frozen=True)
class Part:
    """One piece of `all`: the commands (`python -m ARGS...`, in order, from the repository
    root) that write `writes` (names in benchmarks/results/), or why it is skipped here."""

    name: str
    commands: tuple[tuple[str, ...], ...]
    writes: tuple[str, ...]
    skip: Callable[[], str | None] = lambda: None


def _iopddl_missing(*names: str) -> str | None:
    missing = [n for n in names if not (IOPDDL_DIR / f"asplos-2025-iopddl-{n}.json.gz").is_file()]
    if missing:
        return (f"needs the IOPDDL instances {', '.join(missing)} in {IOPDDL_DIR} (not in "
                "this checkout)")
    return None


def _tb2_settings_skip() -> str | None:
    if importlib.util.find_spec("pytoulbar2") is None:
        return "needs toulbar2 (pip install -e '.[toulbar2]')"
    return _iopddl_missing("S")


def parts() -> list[Part]:
    """Every part of `all`, cheapest first."""
    out = [Part("toy", (("benchmarks", "toy"),), ("toy-cpu-local.md", "toy-cpu-local.json"))]
    for module in ("runtime_overhead", "pipeline_search", "checkpoint_io",
                   "cost_model_accuracy", "gpu_accuracy", "search_time",
                   "intra_op_reference", "intra_op_generated", "bound_premise",
                   "layering_gap"):
        files = (f"{module}.md", f"{module}.json")
        if module == "cost_model_accuracy":
            files += (f"{module}.png",)
        out.append(Part(module, ((f"benchmarks.{module}",),), files))
    for model, cluster, micro in (("gpt-1.3b", "2x8xA100-80GB", "64"),
                                  ("gpt-39b", "8x8xV100-16GB", "1024")):
        name = f"plan-{model}-{cluster}"
        out.append(Part(name, (("autopar", "plan", model, "--cluster", cluster,
                                "--micro-batches", micro, "-q", "-o",
                                f"{RESULTS}/{name}.json"),), (f"{name}.json",)))
    for suite in ("gpt", "moe", "wrn"):
        for cluster in SUITE_CLUSTERS:
            name = f"{suite}-{cluster}"
            out.append(Part(name, (("benchmarks", suite, "--cluster", cluster),
                                   ("benchmarks.audit", f"{RESULTS}/{name}.json"),
                                   ("benchmarks.explain", f"{RESULTS}/{name}.json")),
                            (f"{name}.md", f"{name}.json", f"{name}.png")))
    # About 110 min on 2 cores (GPT-39B without remat: most of it).
    out.append(Part("remat_search", (("benchmarks.remat_search",),),
                    ("remat_search.md", "remat_search.json")))
    out.append(Part("solver_iopddl", (("benchmarks.solver_iopddl",),),
                    ("solver_iopddl.md", "solver_iopddl.json"),
                    lambda: _iopddl_missing("G", "A", "M", "S")))
    # Issue 47's robustness check: A, M and S twice, each solve beside 2 busy processes.
    out.append(Part("solver_iopddl_busy", (("benchmarks.solver_iopddl", "--instances", "A,M,S",
                                            "--repeat", "2", "--busy", "2",
                                            "--bound-time-scale", "0",
                                            "--out", "solver_iopddl_busy"),),
                    ("solver_iopddl_busy.md", "solver_iopddl_busy.json"),
                    lambda: _iopddl_missing("A", "M", "S")))
    out.append(Part("solver_tb2_settings", (("benchmarks.solver_tb2_settings",),),
                    ("solver_tb2_settings.md", "solver_tb2_settings.json"), _tb2_settings_skip))
    # Hours on 2 cores (300 generated cases, each under 4 methods): after the rest.
    out.append(Part("fuzz", (("benchmarks.fuzz",),), ("fuzz.md", "fuzz.json")))
    # About 40 min on 2 cores: 45 more seeds (30-74) than fuzz.md's 30, until a 300-case run.
    out.append(Part("fuzz-seeds-30-74", (("benchmarks.fuzz", "--cases", "45", "--seed", "30",
                                          "--name", "fuzz-seeds-30-74"),),
                    ("fuzz-seeds-30-74.md", "fuzz-seeds-30-74.json")))
    # About 55 min on 2 cores: the next 75 seeds (75-149).
    out.append(Part("fuzz-seeds-75-149", (("benchmarks.fuzz", "--cases", "75", "--seed", "75",
                                           "--name", "fuzz-seeds-75-149"),),
                    ("fuzz-seeds-75-149.md", "fuzz-seeds-75-149.json")))
    # About 45 min on 2 cores: seeds 150-224.
    out.append(Part("fuzz-seeds-150-224", (("benchmarks.fuzz", "--cases", "75", "--seed",
                                            "150", "--name", "fuzz-seeds-150-224"),),
                    ("fuzz-seeds-150-224.md", "fuzz-seeds-150-224.json")))
    # About 45 min on 2 cores (12 generated cases, each under 3 memory-bound pipelines).
    out.append(Part("fuzz_tight", (("benchmarks.fuzz", "--cases", "12", "--methods",
                                    "pipeshard-1-tight,pipeshard-2-tight,pipeshard-4-tight",
                                    "--timeout-s", "900", "--name", "fuzz_tight"),),
                    ("fuzz_tight.md", "fuzz_tight.json")))
    # About 15 min on 2 cores (36 multi-process launches).
    out.append(Part("multiprocess_fuzz", (("benchmarks.multiprocess_fuzz",),),
                    ("multiprocess_fuzz.md", "multiprocess_fuzz.json")))
    out.append(Part("gpu_check", (("benchmarks.gpu_check",),), ("gpu-<device kind>.md/.json",),
                    lambda: "GPU-only: run `python -m benchmarks.gpu_check` on a machine "
                            "with one GPU"))
    return out


def _command_line(args: Sequence[str]) -> str:
    return shlex.join(["python", "-m", *args])


def run_command(args: Sequence[str]) -> int:
    """Runs `python -m ARGS` from the repository root; its exit status."""
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, check=False).returncode


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def run_all(only: Sequence[str] | None = None, dry_run: bool = False,
            list_only: bool = False) -> int:
    every = parts()
    names = [p.name for p in every]
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            print(f"benchmarks all: unknown part(s) {', '.join(unknown)}; parts: "
                  f"{', '.join(names)}", file=sys.stderr)
            return 2
        every = [p for p in every if p.name in only]
    if list_only:
        for p in every:
            print(f"{p.name}: {', '.join(p.writes)}")
        return 0
    total, failed = time.perf_counter(), []
    for p in every:
        reason = p.skip()
        if reason:
            print(f"== {p.name}: skipped ({reason})", flush=True)
            continue
        if dry_run:
            print(f"== {p.name}: writes {', '.join(p.writes)} in {RESULTS}/")
            for command in p.commands:
                print(f"   {_command_line(command)}")
            continue
        print(f"== {p.name}", flush=True)
        t0, status = time.perf_counter(), "done"
        for command in p.commands:
            print(f"   {_command_line(command)}", flush=True)
            rc = run_command(command)
            if rc != 0:
                status = f"failed ({_command_line(command)}: exit status {rc})"
                failed.append(f"{p.name} {status}")
                break
        print(f"== {p.name}: {status} in {_fmt_s(time.perf_counter() - t0)}", flush=True)
    if dry_run:
        return 0
    print(f"== all: {len(every)} parts in {_fmt_s(time.perf_counter() - total)}"
          + (f"; failed: {'; '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=("gpt", "moe", "wrn", "toy", "all"))
    p.add_argument("--cluster", default=None,
                   help="a preset (the suites were written for '8x8xV100-16GB' and "
                        "'4x8xH100-80GB') or a cluster JSON")
    p.add_argument("--max-devices", type=int, default=None, metavar="N",
                   help="only the cases with at most N devices")
    p.add_argument("--output-dir", default=None, metavar="DIR",
                   help="where to write results (default benchmarks/results)")
    p.add_argument("--only", default=None, metavar="NAME[,NAME]",
                   help="all: only these parts (see --list)")
    p.add_argument("--list", action="store_true", help="all: name the parts and their files")
    p.add_argument("--dry-run", action="store_true",
                   help="all: print what would run, run nothing")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["suite"]:
        argv = argv[1:]
    parser = _parser()
    args = parser.parse_args(argv)
    if args.suite == "all":
        if args.cluster or args.max_devices or args.output_dir:
            parser.error("all takes --only, --list and --dry-run only: it writes every file "
                         "of benchmarks/results/ with each module's defaults")
        only = [n for n in (args.only or "").split(",") if n] or None
        return run_all(only, dry_run=args.dry_run, list_only=args.list)
    if args.only or args.list or args.dry_run:
        parser.error("--only, --list and --dry-run go with all")
    out = {"out_dir": pathlib.Path(args.output_dir)} if args.output_dir else {}
    if args.suite == "toy":
        from autopar import demo

        demo.use_cpu_devices()  # first: before anything can start a JAX backend
        from benchmarks import toy

        rows = toy.run(**out)
        bad = [f"{r['model']}/{r['strategy']}" for r in rows if not r["equal"]]
        if bad:
            print(f"benchmarks: results differ from the single-device step: {', '.join(bad)}",
                  file=sys.stderr)
            return 1
        return 0
    if args.cluster is None:
        print(f"benchmarks: suite {args.suite} needs --cluster (e.g. 8x8xV100-16GB)",
              file=sys.stderr)
        return 2
    from autopar.cost_model import ClusterSpec
    from benchmarks import suite

    try:
        cluster = (ClusterSpec.load(args.cluster) if os.path.exists(args.cluster)
                   else ClusterSpec.preset(args.cluster))
    except ValueError as err:
        print(f"benchmarks: {err}", file=sys.stderr)
        return 2
    suite.run(args.suite, cluster, max_devices=args.max_devices, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
