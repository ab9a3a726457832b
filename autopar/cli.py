"""The `autopar` command: plan, show, profile, demo.

    autopar plan MODEL --cluster PRESET|cluster.json [--method auto|shard|pipeshard|dp|zero2|
                 zero3|3d] [--micro-batches N] [--batch B] [--memory-budget 40GiB]
                 [--stages N] [--dp N --tp N --pp N] [--time-limit S] [-o plan.json] [--quiet]
    autopar show plan.json [--png out.png] [--top K]
    autopar profile -o cluster.json [--quick] [--quiet]
    autopar demo [--steps 20] [--quiet]

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
import math
import os
import pathlib
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

METHODS = ("auto", "shard", "pipeshard", "dp", "zero2", "zero3", "3d")
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6,
          "mib": 2**20, "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12,
          "tib": 2**40}


class UsageError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit status 2."""


# ---- small parsers ---------------------------------------------------------------------------

def parse_size(text: str) -> float:
    """Bytes from "40GiB", "512MiB", "16GB", "1e9", "2G" (K/M/G/T alone are binary)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise UsageError(f"invalid size {text!r}: expected a number of bytes with an optional "
                         f"unit, e.g. 40GiB, 512MiB, 16GB or 1e9 (units: B, KiB, MiB, GiB, TiB, "
                         f"KB, MB, GB, TB)")
    value = float(m.group(1)) * _UNITS[unit]
    if not value > 0 or not math.isfinite(value):
        raise UsageError(f"invalid size {text!r}: must be positive")
    return value


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


# ---- models ----------------------------------------------------------------------------------

def _zoo():
    """benchmarks.zoo: importable from a source checkout (editable install) or the cwd."""
    try:
        return importlib.import_module("benchmarks.zoo")
    except ModuleNotFoundError:
        root = pathlib.Path(__file__).resolve().parent.parent
        if not (root / "benchmarks" / "zoo.py").exists():
            return None
        sys.path.insert(0, str(root))
        return importlib.import_module("benchmarks.zoo")


def zoo_names() -> list[str]:
    zoo = _zoo()
    return sorted(zoo.CONFIGS, key=_model_order) if zoo is not None else []


def _model_order(name: str) -> tuple:
    m = re.search(r"([0-9.]+)([mb])$", name)
    size = float(m.group(1)) * (1e3 if m.group(2) == "b" else 1) if m else 0.0
    return (name.split("-")[0], size)


@dataclasses.dataclass
class Model:
    name: str
    step: Any
    args: tuple
    model_flops: float | None  # per training step, from a formula; None: cost model's count


def load_model(spec: str, batch: int | None) -> Model:
    """A zoo name (`gpt-1.3b`) or `package.module:function` returning (step, args)."""
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
    zoo = _zoo()
    names = zoo_names()
    if zoo is None or spec not in zoo.CONFIGS:
        known = ", ".join(names) if names else "(none: benchmarks/ is not installed)"
        raise UsageError(f"unknown model {spec!r}: give a built-in model ({known}) or "
                         f"package.module:function returning (train_step, example_args)")
    if batch is None:
        # Alpa's global batches (1536 for Wide-ResNet, 1024 otherwise); a small one for toys.
        batch = 64 if spec.endswith("-toy") else 1536 if spec.startswith("wrn") else 1024
    step, args = zoo.train_step_and_args(spec, batch)
    return Model(f"{spec} (batch {batch})", step, tuple(args), zoo.flops_per_step(spec, batch))


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
        name = "pipeshard" if micro > 1 or cluster.num_hosts > 1 else "shard"
    if args.stages is not None and name != "pipeshard":
        raise UsageError(f"--stages is for --method pipeshard (the method is {name})")
    if name != "3d" and any(v is not None for v in (args.dp, args.tp, args.pp)):
        raise UsageError(f"--dp/--tp/--pp are for --method 3d (the method is {name})")
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
        if micro > 1:
            raise UsageError(f"--method {name} does not take --micro-batches (use shard, "
                             f"pipeshard or 3d)")
        cls = {"dp": autopar.DataParallel, "zero2": autopar.Zero2Parallel,
               "zero3": autopar.Zero3Parallel}[name]
        return cls(**common)
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


def _describe_values(entry, plan) -> dict[str, Any]:
    """Names and sizes of the plan's inputs (single mesh) or stage inputs (pipeline), saved
    with the plan so `autopar show` can list the largest tensors without the program."""
    import numpy as np

    program = entry.traced.program
    if not plan.stages:
        g = program.graph
        return {"inputs": [[list(g.values[v].shape), np.dtype(g.values[v].dtype).itemsize]
                           for v in g.invars]}
    split = entry.split
    fgraph = split.forward_graph()
    step_in = {id(v): k for k, v in enumerate(split.step.jaxpr.invars)}
    names = {}
    for k, vid in enumerate(fgraph.invars):
        pos = step_in.get(id(split.forward_inputs[k]))
        names[vid] = (program.input_names[pos] if pos is not None and
                      pos < len(program.input_names) else f"computed value v{vid}")
    out = {}
    for st in plan.stages:
        for vid, _ in st.input_specs:
            if 0 <= vid < len(fgraph.values) and str(vid) not in out:
                v = fgraph.values[vid]
                out[str(vid)] = [names.get(vid, f"activation v{vid}"), list(v.shape),
                                 np.dtype(v.dtype).itemsize]
    return {"stage_values": out}


def cmd_plan(args) -> int:
    import autopar
    from autopar.progress import Progress

    t0 = time.perf_counter()
    cluster = load_cluster(args.cluster)
    try:
        method = make_method(args, cluster)
    except ValueError as err:
        raise UsageError(str(err)) from None
    model = load_model(args.model, args.batch)
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
    entry = step._entry(model.args)[0]
    phases = dict(plan.solver.get("phases_s", {}))
    search_s = float(plan.solver.get("search_s", sum(phases.values())))
    extra = {"model": model.name, "trace_s": max(0.0, wall - search_s), "wall_s": wall,
             "device_memory_bytes": cluster.memory_bytes,
             "devices_per_host": cluster.devices_per_host, "num_hosts": cluster.num_hosts,
             **_describe_values(entry, plan)}
    if model.model_flops is not None:
        extra["model_flops"] = model.model_flops
    plan = dataclasses.replace(plan, solver={**plan.solver, "cli": extra})
    print(summary(plan))
    if args.output:
        plan.save(args.output)
        print(f"plan saved to {args.output} ({time.perf_counter() - t0:.1f} s in all)")
    return 0


# ---- summary ---------------------------------------------------------------------------------

def _device_memory(plan) -> float | None:
    cli = plan.solver.get("cli", {})
    if "device_memory_bytes" in cli:
        return float(cli["device_memory_bytes"])
    try:
        from autopar.cost_model import ClusterSpec

        return ClusterSpec.preset(plan.cluster).memory_bytes
    except ValueError:
        return None


def step_flops(plan) -> tuple[float, str]:
    """FLOPs of one training step and where the number comes from."""
    cli = plan.solver.get("cli", {})
    if "model_flops" in cli:
        return float(cli["model_flops"]), "model formula"
    flops = plan.predicted.flops
    if plan.stages:  # the pipeline planner counts one micro-batch's forward + backward
        flops *= plan.num_micro_batches
    return flops, "traced program"


def _range(ids: Sequence[int]) -> str:
    if not ids:
        return "-"
    if list(ids) == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ",".join(map(str, ids[:4])) + (",..." if len(ids) > 4 else "")


def _submesh(ids: Sequence[int], per_host: int | None) -> str:
    if not per_host:
        return f"({len(ids)} dev)"
    hosts = len({i // per_host for i in ids})
    return f"({hosts}, {len(ids) // max(hosts, 1)})"


def _table(rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  " + "  ".join(cells).rstrip())
        if k == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return lines


def summary(plan) -> str:
    """The plan as the table `autopar plan` and `autopar show` print."""
    cli = plan.solver.get("cli", {})
    p = plan.predicted
    dev_mem = _device_memory(plan)
    per_host = cli.get("devices_per_host")
    n = len(plan.device_ids)
    lines = [f"autopar plan: {cli.get('model', 'model')} on {plan.cluster} ({n} devices), "
             f"method {plan.method}, fingerprint {plan.fingerprint}"]
    if plan.stages:
        lines.append(f"  {len(plan.stages)} pipeline stages, {plan.num_micro_batches} "
                     f"micro-batches, schedule {plan.schedule}")
    rows = [["stage", "layers", "devices", "sub-mesh", "logical mesh", "time",
             "memory/device"]]
    mem_of = lambda b: format_bytes(b) + (f" ({100 * b / dev_mem:.0f}%)" if dev_mem else "")
    if plan.stages:
        for k, st in enumerate(plan.stages):
            rows.append([str(k), f"{st.layers[0]}-{st.layers[1]}", _range(st.device_ids),
                         _submesh(st.device_ids, per_host),
                         f"{st.mesh_shape} {','.join(st.mesh_axes)}",
                         f"{st.predicted_s * 1e3:.3f} ms/mb", mem_of(st.memory_bytes)])
    else:
        rows.append(["-", "all", _range(plan.device_ids), _submesh(plan.device_ids, per_host),
                     f"{plan.mesh_shape} {','.join(plan.mesh_axes)}",
                     f"{p.step_s * 1e3:.3f} ms", mem_of(p.memory_bytes)])
    lines += _table(rows, right={5})
    flops, source = step_flops(plan)
    lines.append(f"  predicted step time    {p.step_s * 1e3:.3f} ms (compute "
                 f"{p.compute_s * 1e3:.3f} ms, communication/bubble {p.comm_s * 1e3:.3f} ms)")
    if flops > 0 and p.step_s > 0:
        lines.append(f"  TFLOP/s per device     {flops / p.step_s / n / 1e12:.3g} "
                     f"({flops:.3g} FLOPs per step, {source})")
    mem = f"  memory per device      {format_bytes(p.memory_bytes)} (peak)"
    if dev_mem:
        mem += f" of {format_bytes(dev_mem)} ({100 * p.memory_bytes / dev_mem:.0f}%)"
    lines.append(mem)
    if plan.candidates and not plan.stages:
        lines.append("  logical meshes tried   " + ", ".join(
            f"{s}: {c * 1e3:.3f} ms" for s, c in plan.candidates))
    phases = {}
    if "trace_s" in cli:
        phases["trace"] = cli["trace_s"]
    phases.update(plan.solver.get("phases_s", {}))
    if phases:
        total = cli.get("wall_s", plan.solver.get("search_s", sum(phases.values())))
        lines.append(f"  search time            {float(total):.2f} s: " + ", ".join(
            f"{k} {float(v):.2f} s" for k, v in phases.items()))
    elif "search_s" in plan.solver:
        lines.append(f"  search time            {float(plan.solver['search_s']):.2f} s")
    return "\n".join(lines)


def short_name(path: str) -> str:
    """arg0.params.Dense_0.kernel for the pytree path ['arg0']['params']['Dense_0']['kernel']."""
    return re.sub(r"\['([^']*)'\]", r".\1", path).lstrip(".")


def _spec_bytes(shape: Sequence[int], itemsize: int, spec, sizes: dict[str, int]) -> float:
    total = math.prod(shape) * itemsize
    split = math.prod(sizes.get(a, 1) for axes in spec for a in axes)
    return total / max(split, 1)


def largest_tensors(plan, top: int) -> list[str]:
    """Per stage (or the single mesh), the `top` largest inputs: name → spec, sizes."""

    cli = plan.solver.get("cli", {})
    lines = []
    if not plan.stages:
        shapes = cli.get("inputs")
        sizes = dict(zip(plan.mesh_axes, plan.mesh_shape))
        lines.append(f"largest inputs (mesh {plan.mesh_shape} {','.join(plan.mesh_axes)}):")
        entries = []
        for k, (name, spec) in enumerate(zip(plan.input_names, plan.in_specs)):
            if shapes and k < len(shapes):
                shape, item = shapes[k]
                entries.append((math.prod(shape) * item, name, spec, shape, item))
            else:
                entries.append((0, name, spec, None, 0))
        if not shapes:
            lines.append("  (sizes unknown: the plan was not written by `autopar plan`)")
        entries.sort(key=lambda e: -e[0])
        return lines + _input_rows(entries[:top], sizes)
    values = cli.get("stage_values", {})
    for k, st in enumerate(plan.stages):
        sizes = dict(zip(st.mesh_axes, st.mesh_shape))
        lines.append(f"stage {k} (mesh {st.mesh_shape} {','.join(st.mesh_axes)}): largest of "
                     f"{len(st.input_specs)} inputs")
        entries = []
        for vid, spec in st.input_specs:
            name, shape, item = values.get(str(vid), (f"value v{vid}", None, 0))
            entries.append((math.prod(shape) * item if shape else 0, name, spec, shape, item))
        entries.sort(key=lambda e: -e[0])
        lines += _input_rows(entries[:top], sizes)
    return lines


def _input_rows(entries: list, sizes: dict[str, int]) -> list[str]:
    from autopar.plan import format_spec

    rows = [["input", "spec", "shape", "total", "per device"]]
    for total, name, spec, shape, item in entries:
        known = shape is not None
        rows.append([short_name(name), format_spec(spec), str(tuple(shape)) if known else "?",
                     format_bytes(total) if known else "?",
                     format_bytes(_spec_bytes(shape, item, spec, sizes)) if known else "?"])
    return _table(rows, right={3, 4})


def cmd_show(args) -> int:
    from autopar.plan import Plan

    if not os.path.exists(args.plan):
        raise UsageError(f"plan file {args.plan!r} does not exist")
    plan = Plan.load(args.plan)
    print(summary(plan))
    print()
    print("\n".join(largest_tensors(plan, args.top)))
    if args.png:
        if plan.stages:
            plan.schedule_chart(args.png)
            print(f"pipeline schedule chart saved to {args.png}")
        elif _bytes_chart(plan, args.png, args.top):
            print(f"single-mesh plan: no pipeline schedule to draw; bar chart of per-device "
                  f"bytes of the largest inputs saved to {args.png}")
        else:
            print("single-mesh plan: no pipeline schedule to draw, and no input sizes in the "
                  "file (not written by `autopar plan`); no PNG written")
    return 0


def _bytes_chart(plan, path: str, top: int) -> bool:
    from autopar.plan import format_spec

    shapes = plan.solver.get("cli", {}).get("inputs")
    if not shapes:
        return False
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise UsageError("--png needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = dict(zip(plan.mesh_axes, plan.mesh_shape))
    entries = sorted(((_spec_bytes(s, it, spec, sizes), name, spec) for (s, it), name, spec
                      in zip(shapes, plan.input_names, plan.in_specs)), key=lambda e: -e[0])
    entries = entries[:top][::-1]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(entries) + 1.5))
    ax.barh([f"{short_name(n)} {format_spec(s)}" for _, n, s in entries],
            [b / 2**20 for b, _, _ in entries])
    ax.set_xlabel("MiB per device")
    ax.set_title(f"{plan.method} on {plan.cluster}: mesh {plan.mesh_shape} — largest inputs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


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


def cmd_bench(args) -> int:
    if _zoo() is None:
        raise UsageError("autopar bench needs a source checkout: benchmarks/ is not installed")
    if args.suite == "toy":
        from autopar import demo

        demo.use_cpu_devices()  # first: before anything can start a JAX backend
        from benchmarks import toy

        rows = toy.run(out_dir=pathlib.Path(args.output_dir) if args.output_dir else toy.RESULTS)
        bad = [f"{r['model']}/{r['strategy']}" for r in rows if not r["equal"]]
        if bad:
            print(f"autopar: results differ from the single-device step: {', '.join(bad)}",
                  file=sys.stderr)
            return 1
        return 0
    from benchmarks import suite

    if args.cluster is None:
        raise UsageError(f"autopar bench {args.suite} needs --cluster (e.g. 8x8xV100-16GB)")
    kw = {"max_devices": args.max_devices}
    if args.output_dir:
        kw["out_dir"] = pathlib.Path(args.output_dir)
    suite.run(args.suite, load_cluster(args.cluster), **kw)
    return 0


def cmd_demo(args) -> int:
    from autopar import demo

    demo.use_cpu_devices()  # first: before anything can start a JAX backend
    return demo.run(args.steps, quiet=args.quiet, summary=summary)


# ---- entry point -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar", description="Alpa-style automatic parallelization for JAX: plan "
        "offline for a cluster, inspect plans, profile this machine, run the demo.")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of user errors too")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

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
    p.add_argument("--micro-batches", type=_positive_int, default=1, metavar="N")
    p.add_argument("--batch", type=_positive_int, default=None, metavar="B",
                   help="global batch size (built-in models: default 1024, gpt-toy 64; "
                        "passed as batch= to a package.module:function)")
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

    p = sub.add_parser("show", help="print a saved plan; --png draws its schedule",
                       description="Print a plan file's summary and the sharding of its "
                       "largest inputs (per stage for pipelines); --png draws the pipeline "
                       "schedule (single-mesh plans: per-device bytes of the largest inputs).")
    p.add_argument("plan", metavar="plan.json")
    p.add_argument("--png", metavar="out.png")
    p.add_argument("--top", type=_positive_int, default=8, metavar="K",
                   help="how many of the largest inputs to list (default 8)")
    p.set_defaults(run=cmd_show)

    p = sub.add_parser("profile", help="measure this machine's devices into a cluster JSON",
                       description="Measure collectives and matmul throughput on this "
                       "machine's JAX devices and save a cluster spec usable as --cluster.")
    p.add_argument("-o", "--output", required=True, metavar="cluster.json")
    p.add_argument("--quick", action="store_true", help="few sizes and repeats")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_profile)

    p = sub.add_parser(
        "bench", help="benchmark suites: autopar against hand-written strategies",
        description="Weak-scaling suites of the Alpa paper (gpt, moe, wrn) priced on a "
        "cluster preset for data parallel, ZeRO-2/3, Megatron TP+DP, the best manual 3-D "
        "plan and autopar; writes benchmarks/results/<suite>-<cluster>.md/.json/.png. "
        "'toy' runs every strategy for real on 8 emulated CPU devices and checks the results "
        "against the single-device step.")
    p.add_argument("suite", choices=("gpt", "moe", "wrn", "toy"))
    p.add_argument("--cluster", default=None,
                   help="a preset (the suites were written for '8x8xV100-16GB' and "
                        "'4x8xH100-80GB') or a cluster JSON")
    p.add_argument("--max-devices", type=_positive_int, default=None, metavar="N",
                   help="only the cases with at most N devices")
    p.add_argument("--output-dir", default=None, metavar="DIR",
                   help="where to write results (default benchmarks/results)")
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("demo", help="plan and train a tiny GPT on 8 emulated CPU devices",
                       description="On 8 emulated CPU devices: plan a tiny GPT automatically, "
                       "train it, and check the losses against the single-device jax.jit "
                       "step (exit status 0 only if they match).")
    p.add_argument("--steps", type=_positive_int, default=20)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_demo)
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
