"""Plans as people read them: the summary table `autopar plan` / `autopar show` print and
`Plan.summary()` returns, the largest tensors per stage, a per-device bytes chart, and the
names and sizes `autopar plan` stores with a plan so that `show` needs no program."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from autopar.cost_model import ClusterSpec
from autopar.cost_model.units import format_bytes
from autopar.graph import itemsize
from autopar.passes.sharding_spec import format_spec

if TYPE_CHECKING:
    from .plan import Plan, StagePlan
    from .traced import Traced

# Split inputs listed by name under a single-mesh plan's summary.
_SPLIT_LISTED = 12


def describe_values(traced: Traced) -> dict[str, Any]:
    """Names and sizes of the plan's inputs (single mesh) or stage inputs (pipeline), saved
    with the plan so `autopar show` can list the largest tensors without the program."""
    plan = traced.plan
    program = traced.program
    if not plan.stages:
        g = program.graph
        return {"inputs": [[list(g.values[v].shape), itemsize(g.values[v].dtype)]
                           for v in g.invars]}
    split = traced.split
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
                                 itemsize(v.dtype)]
    return {"stage_values": out}



def _device_memory(plan: Plan) -> float | None:
    cli = plan.solver.get("cli", {})
    if "device_memory_bytes" in cli:
        return float(cli["device_memory_bytes"])
    try:
        return ClusterSpec.preset(plan.cluster).memory_bytes
    except ValueError:
        return None


def step_flops(plan: Plan) -> tuple[float, str]:
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


def _joint_lines(plan: Plan) -> list[str]:
    """The stages whose layers were solved as one program (one `LayerPlan` over several
    layers), and the step the plan of layer solutions had; none when no stage was."""
    joint = [k for k, st in enumerate(plan.stages)
             if len(st.layer_plans) < st.layers[1] - st.layers[0] + 1]
    layered = plan.solver.get("layered_step_s")
    if not joint or layered is None:
        return []
    return [f"  stage{'s' if len(joint) > 1 else ''} {_range(joint)} solved as one program "
            f"each (the layers' own solutions: {layered * 1e3:.3f} ms per step)"]


def _remat_lines(stages: Sequence[StagePlan]) -> list[str]:
    """Per stage with rematerialized layers, which (`LayerPlan.remat`); none when no
    layer is."""
    lines = []
    for k, st in enumerate(stages):
        again = [n for n, lp in enumerate(st.layer_plans, start=st.layers[0]) if lp.remat]
        if again:
            lines.append(f"  stage {k} rematerializes {len(again)} of {len(st.layer_plans)} "
                         f"layers: {_range(again)}")
    return lines


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


def summary(plan: Plan) -> str:
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
    lines += _joint_lines(plan)
    lines += _remat_lines(plan.stages)
    flops, source = step_flops(plan)
    if plan.stages:   # pipelines: the busiest stage's micro-batches, and the rest
        lines.append(f"  predicted step time    {p.step_s * 1e3:.3f} ms (busiest stage "
                     f"{p.compute_s * 1e3:.3f} ms, bubble and transfers "
                     f"{p.comm_s * 1e3:.3f} ms)")
    else:
        lines.append(f"  predicted step time    {p.step_s * 1e3:.3f} ms (compute "
                     f"{p.compute_s * 1e3:.3f} ms, communication {p.comm_s * 1e3:.3f} ms)")
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
    if "backend" in plan.solver:
        lines.append(f"  sharding solver        {plan.solver['backend']}")
    lines += _search_notes(plan)
    if not plan.stages:
        split = [(n, s) for n, s in zip(plan.input_names, plan.in_specs) if any(s)]
        lines.append(f"  inputs split           {len(split)} of {len(plan.in_specs)}")
        for name, spec in split[:_SPLIT_LISTED]:
            lines.append(f"    {short_name(name):<40} {format_spec(spec)}")
        if len(split) > _SPLIT_LISTED:
            lines.append(f"    ... {len(split) - _SPLIT_LISTED} more")
    return "\n".join(lines)


def _search_notes(plan: Plan) -> list[str]:
    """Lines on how the plan was found: the plan cache, the micro-batch counts tried."""
    lines = []
    cache = plan.solver.get("plan_cache", {})
    if cache.get("hit"):
        lines.append(f"  plan cache             hit, no search ({cache.get('path', '')})")
    tries = plan.solver.get("micro_batch_tries", [])
    if tries:
        cells = []
        for t in tries:
            mark = "*" if t.get("num_micro_batches") == plan.num_micro_batches else ""
            what = (f"{t['step_s'] * 1e3:.3f} ms" if t.get("step_s") is not None
                    else "no plan fits")
            if t.get("trace_s") is not None:
                what += f" ({t['search_s']:.1f} s, trace {t['trace_s']:.1f} s)"
            cells.append(f"B={t['num_micro_batches']}{mark}: {what}")
        lines.append("  micro-batches tried    " + ", ".join(cells))
    found = plan.solver.get("fallbacks", [])
    if found:
        lines.append(f"  fallbacks              {len(found)} (autopar.FallbackWarning):")
        for fb in found[:_SPLIT_LISTED]:
            where = f" (at {fb['where']})" if fb.get("where") else ""
            lines.append(f"    {fb['stage']}: {fb['what']}{where}")
        if len(found) > _SPLIT_LISTED:
            lines.append(f"    ... {len(found) - _SPLIT_LISTED} more")
    return lines


def short_name(path: str) -> str:
    """arg0.params.Dense_0.kernel for the pytree path ['arg0']['params']['Dense_0']['kernel']."""
    return re.sub(r"\['([^']*)'\]", r".\1", path).lstrip(".")


def _spec_bytes(shape: Sequence[int], itemsize: int, spec, sizes: dict[str, int]) -> float:
    total = math.prod(shape) * itemsize
    split = math.prod(sizes.get(a, 1) for axes in spec for a in axes)
    return total / max(split, 1)


def largest_tensors(plan: Plan, top: int) -> list[str]:
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
    rows = [["input", "spec", "shape", "total", "per device"]]
    for total, name, spec, shape, item in entries:
        known = shape is not None
        rows.append([short_name(name), format_spec(spec), str(tuple(shape)) if known else "?",
                     format_bytes(total) if known else "?",
                     format_bytes(_spec_bytes(shape, item, spec, sizes)) if known else "?"])
    return _table(rows, right={3, 4})


def bytes_chart(plan: Plan, path: str, top: int) -> bool:
    """Bar chart (PNG at `path`) of the per-device bytes of the `top` largest inputs of a
    single-mesh plan written by `autopar plan`; False when the file has no input sizes."""
    shapes = plan.solver.get("cli", {}).get("inputs")
    if not shapes:
        return False
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ValueError("drawing a PNG needs matplotlib (pip install matplotlib)") from None
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


