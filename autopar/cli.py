"""The `autopar` command: plan, show, profile, bench, demo, launch.

    autopar plan MODEL --cluster PRESET|cluster.json [--method auto|shard|pipeshard|dp|zero2|
                 zero3|3d] [--micro-batches N|auto] [--batch B] [--memory-budget 40GiB]
                 [--stages N] [--dp N --tp N --pp N] [--time-limit S] [-o plan.json] [--quiet]
    autopar show plan.json [--png out.png] [--top K]
    autopar profile -o cluster.json [--quick] [--quiet]
    autopar demo [--steps 20] [--processes N] [--time-limit S] [--quiet]
    autopar launch -n N [--devices-per-process D] [--timeout S] (script.py | -m MODULE) ARGS...

User errors (unknown model or preset, invalid or mismatched plan file, bad sizes, a memory
budget no plan fits, invalid options) print one line `autopar: error: ...` on stderr and
exit with status 2; other exceptions are bugs and keep their traceback (`--debug` shows
the traceback of user errors too).

JAX is configured before any backend use: `autopar demo` asks for 8 emulated CPU devices,
so nothing here may touch devices before the subcommand runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

METHODS = ("auto", "shard", "pipeshard", "dp", "zero2", "zero3", "3d")


class UsageError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit status 2."""


# ---- small parsers ---------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def _micro_batches(text: str) -> int | str:
    """`--micro-batches`: a positive int or "auto"."""
    if text == "auto":
        return text
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'auto', got {text!r}"
                                         ) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


# ---- models ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Model:
    name: str
    step: Any
    args: tuple
    model_flops: float | None  # per training step, from a formula; None: cost model's count


def _config_override(text: str) -> tuple[str, Any]:
    """FIELD=VALUE for `--set`: VALUE as JSON (1, 2.5, true, "x"), else the bare string."""
    field, eq, raw = text.partition("=")
    if not eq or not field:
        raise UsageError(f"--set: expected FIELD=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return field.strip(), value


def load_model(spec: str, batch: int | None, overrides: Sequence[str] = ()) -> Model:
    """A zoo name (`gpt-1.3b`), its config fields replaced by `overrides` (FIELD=VALUE),
    or `package.module:function` returning (step, args)."""
    if ":" in spec and overrides:
        raise UsageError(f"--set changes a built-in model's config; {spec!r} is a function")
    if ":" in spec:
        mod_name, _, fn_name = spec.partition(":")
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # like `python -m`: the user's modules
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError as err:
            if err.name and mod_name.startswith(err.name):
                raise UsageError(f"model {spec!r}: cannot import module {err.name!r} (is it on "
                                 f"PYTHONPATH?)") from None
            raise
        fn = getattr(module, fn_name, None)
        if fn is None or not callable(fn):
            raise UsageError(f"model {spec!r}: module {mod_name!r} has no function {fn_name!r}")
        result = fn(batch=batch) if batch is not None else fn()
        if not (isinstance(result, tuple) and len(result) == 2 and callable(result[0])):
            raise UsageError(f"model {spec!r}: {fn_name}() must return (train_step, "
                             f"example_args), got {type(result).__name__}")
        step, args = result
        return Model(spec, step, tuple(args), None)
    from autopar import models

    if spec not in models.CONFIGS:
        raise UsageError(f"unknown model {spec!r}: give a built-in model "
                         f"({', '.join(models.names())}) or package.module:function returning "
                         f"(train_step, example_args)")
    if batch is None:
        batch = models.default_batch(spec)
    fields = dict(_config_override(text) for text in overrides)
    try:
        step, args = models.train_step_and_args(spec, batch, overrides=fields)
    except (ValueError, TypeError) as err:
        raise UsageError(f"--set: {err}") from None
    changed = "".join(f", {k}={v}" for k, v in fields.items())
    return Model(f"{spec} (batch {batch}{changed})", step, tuple(args),
                 models.flops_per_step(spec, batch, fields))


# ---- plan ------------------------------------------------------------------------------------

def load_cluster(text: str):
    from autopar.cost_model import ClusterSpec

    if text.endswith(".json") or os.path.exists(text):
        if not os.path.exists(text):
            raise UsageError(f"cluster file {text!r} does not exist")
        return ClusterSpec.load(text)
    return ClusterSpec.preset(text)


def make_method(args, cluster):
    """The method for the command-line options (ValueErrors name the option)."""
    import autopar

    name = args.method
    micro = args.micro_batches
    if name == "auto":
        # Pipelining pays off with several micro-batches, or across hosts (slow links).
        name = ("pipeshard" if micro == "auto" or micro > 1 or cluster.num_hosts > 1
                else "shard")
    if micro == "auto" and name != "pipeshard":
        raise UsageError(f"--micro-batches auto is for --method pipeshard (the method is "
                         f"{name})")
    if args.stages is not None and name != "pipeshard":
        raise UsageError(f"--stages is for --method pipeshard (the method is {name})")
    if name != "3d" and any(v is not None for v in (args.dp, args.tp, args.pp)):
        raise UsageError(f"--dp/--tp/--pp are for --method 3d (the method is {name})")
    from autopar.cost_model.units import parse_size

    budget = parse_size(args.memory_budget) if args.memory_budget is not None else None
    common = dict(memory_budget_bytes=budget)
    if args.time_limit is not None:
        common["time_limit_s"] = args.time_limit
    if name == "shard":
        return autopar.ShardParallel(num_micro_batches=micro, **common)
    if name == "pipeshard":
        return autopar.PipeshardParallel(num_micro_batches=micro,
                                         num_stages=args.stages or "auto", **common)
    if name in ("dp", "zero2", "zero3"):
        cls = {"dp": autopar.DataParallel, "zero2": autopar.Zero2Parallel,
               "zero3": autopar.Zero3Parallel}[name]
        return cls(num_micro_batches=micro, **common)
    n = cluster.num_devices
    dims = {"dp": args.dp, "tp": args.tp, "pp": args.pp}
    missing = [k for k, v in dims.items() if v is None]
    if len(missing) > 1:
        raise UsageError(f"--method 3d needs --dp, --tp and --pp (two of them, the third "
                         f"is then {n} devices / their product); missing {missing}")
    if missing:
        known = math.prod(v for v in dims.values() if v is not None)
        if n % known:
            raise UsageError(f"--method 3d: {n} devices are not divisible by "
                             f"{' x '.join(f'{k}={v}' for k, v in dims.items() if v)}")
        dims[missing[0]] = n // known
    if math.prod(dims.values()) != n:
        raise UsageError(f"--method 3d: dp x tp x pp = {math.prod(dims.values())} but cluster "
                         f"{cluster.name} has {n} devices")
    return autopar.Manual3DParallel(num_micro_batches=micro, **dims, **common)


def cmd_plan(args) -> int:
    import autopar
    from autopar import report
    from autopar.progress import Progress

    t0 = time.perf_counter()
    cluster = load_cluster(args.cluster)
    try:
        method = make_method(args, cluster)
    except ValueError as err:
        raise UsageError(str(err)) from None
    model = load_model(args.model, args.batch, args.set)
    bar = Progress(enabled=not args.quiet)
    if not args.quiet:
        print(f"planning {model.name} for {cluster.name} ({cluster.num_devices} devices) with "
              f"{type(method).__name__}", flush=True)
    # autopar.plan, keeping the traced program to name the plan's tensors in the file.
    step = autopar.ParallelizedFunction(
        model.step, method=method, batch_argnums=args.batch_argnums, static_argnums=(),
        donate_argnums=(), plan=None, devices=None, cluster=cluster, offline=True,
        progress=bar.phase)
    with bar:
        t_search = time.perf_counter()
        plan = step.get_plan(*model.args)
        wall = time.perf_counter() - t_search
    traced = step.trace(*model.args)
    cached = plan.solver.get("plan_cache", {})
    if cached.get("hit"):
        print(f"plan cache hit: {cached['path']} (no search; AUTOPAR_CACHE_DIR='' disables "
              f"the cache)", flush=True)
    phases = dict(plan.solver.get("phases_s", {}))
    search_s = float(plan.solver.get("search_s", sum(phases.values())))
    extra = {"model": model.name, "trace_s": max(0.0, wall - search_s), "wall_s": wall,
             "device_memory_bytes": cluster.memory_bytes,
             "devices_per_host": cluster.devices_per_host, "num_hosts": cluster.num_hosts,
             **report.describe_values(traced)}
    if model.model_flops is not None:
        extra["model_flops"] = model.model_flops
    plan = dataclasses.replace(plan, solver={**plan.solver, "cli": extra})
    print(report.summary(plan))
    if args.output:
        plan.save(args.output)
        print(f"plan saved to {args.output} ({time.perf_counter() - t0:.1f} s in all)")
    return 0


def cmd_show(args) -> int:
    from autopar import report
    from autopar.plan import Plan

    if not os.path.exists(args.plan):
        raise UsageError(f"plan file {args.plan!r} does not exist")
    plan = Plan.load(args.plan)
    print(report.summary(plan))
    print()
    print("\n".join(report.largest_tensors(plan, args.top)))
    if args.png:
        if plan.stages:
            plan.schedule_chart(args.png)
            print(f"pipeline schedule chart saved to {args.png}")
        elif report.bytes_chart(plan, args.png, args.top):
            print(f"single-mesh plan: no pipeline schedule to draw; bar chart of per-device "
                  f"bytes of the largest inputs saved to {args.png}")
        else:
            print("single-mesh plan: no pipeline schedule to draw, and no input sizes in the "
                  "file (not written by `autopar plan`); no PNG written")
    return 0


# ---- profile / demo --------------------------------------------------------------------------

def cmd_profile(args) -> int:
    from autopar.cost_model import profile
    from autopar.progress import Progress

    with Progress(enabled=not args.quiet) as bar:
        result = profile(quick=args.quick, progress=bar.update)
    spec = getattr(result, "cluster", result)
    spec.save(args.output)
    print(f"profiled {spec.num_devices} devices: cluster spec saved to {args.output}")
    return 0


def _checkout(start: pathlib.Path) -> pathlib.Path | None:
    """The autopar source checkout holding `start` (a folder with benchmarks/ and autopar/)."""
    for folder in (start, *start.parents):
        if (folder / "benchmarks" / "__main__.py").exists() and (folder / "autopar").is_dir():
            return folder
    return None


def cmd_bench(args) -> int:
    """Runs the benchmark harness of a source checkout (`python -m benchmarks ...`) in a
    child process: the harness is not part of the installed package."""
    root = _checkout(pathlib.Path.cwd())
    if root is None:
        raise UsageError("autopar bench runs the benchmark harness of a source checkout "
                         "(benchmarks/ is not installed with the package): run it inside a "
                         "clone of the autopar repository")
    argv = [sys.executable, "-m", "benchmarks", *args.args]
    if "--output-dir" in argv[:-1]:  # the child runs in the checkout: keep the user's folder
        k = argv.index("--output-dir") + 1
        argv[k] = str(pathlib.Path(argv[k]).resolve())
    return subprocess.run(argv, cwd=root).returncode


def cmd_demo(args) -> int:
    from autopar import demo, distributed

    if distributed.launched():  # one process of `autopar demo --processes N`
        return demo.run_process(args.steps, time_limit_s=args.time_limit)
    if args.processes > 1:
        return demo.run_processes(args.steps, args.processes, quiet=args.quiet,
                                  time_limit_s=args.time_limit)
    demo.use_cpu_devices()  # first: before anything can start a JAX backend
    return demo.run(args.steps, quiet=args.quiet, time_limit_s=args.time_limit)


def cmd_launch(args) -> int:
    from autopar import launch

    if args.module is None and not args.program:
        raise UsageError("autopar launch needs a script (or -m MODULE) to run")
    if args.module is None and not os.path.exists(args.program[0]):
        raise UsageError(f"script {args.program[0]!r} does not exist")
    command = (launch.python_command(None, args.program, module=args.module)
               if args.module is not None else
               launch.python_command(args.program[0], args.program[1:]))
    timeouts = {name: value for name, value in (
        ("heartbeat_timeout_s", args.heartbeat_timeout),
        ("initialization_timeout_s", args.init_timeout)) if value is not None}
    result = launch.launch(command, args.num_processes,
                           devices_per_process=args.devices_per_process,
                           timeout_s=args.timeout or None, echo=sys.stdout, **timeouts)
    if result.returncode != 0:
        print(result.summary(), file=sys.stderr)
    return result.returncode


# ---- entry point -----------------------------------------------------------------------------

def _add_plan(sub) -> None:
    """`autopar plan`: search a plan offline."""
    p = sub.add_parser(
        "plan", help="search a parallel plan offline (no devices of the cluster needed)",
        description="Search a parallel plan for MODEL on a cluster you may not have: abstract "
        "shapes and the cluster's cost model only. --method auto picks pipeshard "
        "(PipeshardParallel) when --micro-batches > 1 or the cluster has more than one host, "
        "else shard (ShardParallel).")
    p.add_argument("model", metavar="MODEL",
                   help="a built-in model (gpt-125m ... gpt-39b, moe-380m ... moe-70b, "
                        "wrn-250m ... wrn-6.8b, and gpt-toy, moe-toy, wrn-toy) or "
                        "package.module:function returning (train_step, example_args); "
                        "args may be jax.ShapeDtypeStructs")
    p.add_argument("--cluster", required=True,
                   help="a preset ('8xA100-80GB', '2x8xA100-80GB', '8x8xV100-16GB', "
                        "'cpu-local', ...) or a cluster JSON from `autopar profile`")
    p.add_argument("--method", default="auto", choices=METHODS)
    p.add_argument("--micro-batches", type=_micro_batches, default=1, metavar="N|auto",
                   help="micro-batches per step; auto: pipeshard tries divisors of the batch "
                        "and keeps the fastest plan (default 1)")
    p.add_argument("--batch", type=_positive_int, default=None, metavar="B",
                   help="global batch size (built-in models: default 1024, gpt-toy 64; "
                        "passed as batch= to a package.module:function)")
    p.add_argument("--set", action="append", default=[],
                   metavar="FIELD=VALUE",
                   help="built-in models: replace a config field, e.g. param_dtype=float16 "
                        "(float32 master copy in the optimizer state, as Alpa's GPT "
                        "benchmark) or tied=false; repeatable")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="peak bytes per device, e.g. 40GiB, 512MiB, 1e9 (default: the "
                        "device's memory)")
    p.add_argument("--stages", type=_positive_int, default=None, metavar="N",
                   help="pipeshard: fix the number of stages (default: searched)")
    p.add_argument("--dp", type=_positive_int, default=None, help="3d: data-parallel degree")
    p.add_argument("--tp", type=_positive_int, default=None, help="3d: tensor-parallel degree")
    p.add_argument("--pp", type=_positive_int, default=None, help="3d: pipeline stages")
    p.add_argument("--time-limit", type=_positive_float, default=None, metavar="S",
                   help="solver wall-clock limit per ILP, seconds")
    p.add_argument("--batch-argnums", type=lambda s: tuple(int(x) for x in s.split(",")),
                   default=(1,), metavar="I[,J]",
                   help="positions of the batch arguments (default 1)")
    p.add_argument("-o", "--output", metavar="plan.json", help="write the plan here")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_plan)


def _add_show(sub) -> None:
    """`autopar show`: print or draw a saved plan."""
    p = sub.add_parser("show", help="print a saved plan; --png draws its schedule",
                       description="Print a plan file's summary and the sharding of its "
                       "largest inputs (per stage for pipelines); --png draws the pipeline "
                       "schedule (single-mesh plans: per-device bytes of the largest inputs).")
    p.add_argument("plan", metavar="plan.json")
    p.add_argument("--png", metavar="out.png")
    p.add_argument("--top", type=_positive_int, default=8, metavar="K",
                   help="how many of the largest inputs to list (default 8)")
    p.set_defaults(run=cmd_show)


def _add_profile(sub) -> None:
    """`autopar profile`: measure this machine into a cluster JSON."""
    p = sub.add_parser("profile", help="measure this machine's devices into a cluster JSON",
                       description="Measure collectives and matmul throughput on this "
                       "machine's JAX devices and save a cluster spec usable as --cluster.")
    p.add_argument("-o", "--output", required=True, metavar="cluster.json")
    p.add_argument("--quick", action="store_true", help="few sizes and repeats")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_profile)


def _add_bench(sub) -> None:
    """`autopar bench`: the benchmark suites."""
    p = sub.add_parser(
        "bench", help="benchmark suites: autopar against hand-written strategies",
        description="Weak-scaling suites of the Alpa paper (gpt, moe, wrn) priced on a "
        "cluster preset for data parallel, ZeRO-2/3, Megatron TP+DP, the best manual 3-D "
        "plan, Alpa's published plan and autopar, on the workloads Alpa's benchmark trains; "
        "writes benchmarks/results/<suite>-<cluster>.md/.json/.png. "
        "'toy' runs every strategy for real on 8 emulated CPU devices and checks the results "
        "against the single-device step; 'all' regenerates every results file a CPU "
        "machine can make.")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="SUITE [OPTIONS]",
                   help="passed to `python -m benchmarks` in the checkout: gpt|moe|wrn "
                        "--cluster PRESET [--max-devices N] [--output-dir DIR], toy, or all "
                        "[--only NAME,...] [--list] [--dry-run]")
    p.set_defaults(run=cmd_bench)


def _add_demo(sub) -> None:
    """`autopar demo`: plan and train a tiny GPT on emulated CPU devices."""
    p = sub.add_parser("demo", help="plan and train a tiny GPT on 8 emulated CPU devices",
                       description="On 8 emulated CPU devices: plan a tiny GPT automatically, "
                       "train it, and check the losses against the single-device jax.jit "
                       "step (exit status 0 only if they match).")
    p.add_argument("--steps", type=_positive_int, default=20)
    p.add_argument("--processes", type=_positive_int, default=1, metavar="N",
                   help="run on N local processes (8/N CPU devices each) joined by "
                        "jax.distributed, through `autopar launch`")
    p.add_argument("--time-limit", type=_positive_float, default=10.0, metavar="S",
                   help="solver wall-clock limit per logical mesh, seconds (default 10)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_demo)


def _add_launch(sub) -> None:
    """`autopar launch`: a script on N local processes."""
    p = sub.add_parser(
        "launch", help="run a script on N local processes joined by jax.distributed",
        description="Start N local processes of a Python script (or -m MODULE) that calls "
        "autopar.distributed.initialize(): each gets the coordinator address, its rank, its "
        "own transfer port and the timeouts in its environment; their output is printed "
        "prefixed [rank k]. When a process fails the others stop (within the heartbeat "
        "timeout, else they are killed) and the exit status is non-zero, naming the rank "
        "that failed first. On a cluster, start the script with your usual launcher (srun, "
        "a Kubernetes job) instead.")
    p.add_argument("-n", "--num-processes", type=_positive_int, required=True, metavar="N")
    p.add_argument("--devices-per-process", type=_positive_int, default=None, metavar="D",
                   help="emulated CPU devices per process (default: the real devices)")
    p.add_argument("--timeout", type=_non_negative_float, default=3600.0, metavar="S",
                   help="wall-clock limit in seconds; 0: none (default 3600)")
    p.add_argument("--heartbeat-timeout", type=_positive_int, default=None, metavar="S",
                   help="seconds after which a silent process is declared dead (default 10)")
    p.add_argument("--init-timeout", type=_positive_int, default=None, metavar="S",
                   help="seconds start-up waits for every process (default 60)")
    p.add_argument("-m", dest="module", default=None, metavar="MODULE",
                   help="run a module (python -m MODULE) instead of a script")
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="script.py ARGS",
                   help="the script and its arguments (with -m: the module's arguments)")
    p.set_defaults(run=cmd_launch)


# The subcommands in the order `autopar --help` lists them.
_SUBCOMMANDS = (_add_plan, _add_show, _add_profile, _add_bench, _add_demo, _add_launch)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar", description="Alpa-style automatic parallelization for JAX: plan "
        "offline for a cluster, inspect plans, profile this machine, run the demo.")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of user errors too")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    import autopar

    errors = [UsageError, autopar.PlanError, autopar.FingerprintError,
              autopar.MemoryBudgetError, FileNotFoundError]
    try:
        from autopar.microbatch import MicroBatchError
        from autopar.pipeline import PipelineError

        errors += [MicroBatchError, PipelineError]
    except ImportError:
        pass
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("\nautopar: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        # Option validation and infeasible searches raise ValueError with a full message;
        # bugs are other exception types and keep their traceback.
        if args.debug or not isinstance(err, _user_errors() + (ValueError,)):
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"autopar: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
