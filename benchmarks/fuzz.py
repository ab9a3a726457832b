"""Fuzz: generated train steps under autopar against the single-device `jax.jit` step
(issue 43, item 6).

    python -m benchmarks.fuzz [--cases 300] [--seed 0] [--methods shard,pipeshard-1,...]
                              [--timeout-s 300] [--families mlp,moe,...] [--small]
                              [--comm drawn|local|cheap] [--jobs 1] [--output-dir DIR]

Case i is `generated.generate(seed + i)` (tests/generated.py: MLPs, attention blocks, conv +
BatchNorm stacks, MoE layers, tied embeddings, `nn.scan`; the family is FAMILIES[seed % 6],
sizes, activation, loss and optimizer are drawn from the seed; `--families` cycles through
the given families instead, `--small` caps the layer counts as the CI test does).  The
methods plan with the cost model `--comm` (default: drawn per case, `generated.comm`: this
machine's, or one where communication is almost free, so that the search splits nearly
every value).  Each case runs
`generated.STEPS` optimizer steps under every method of `--methods` (default: ShardParallel
on the whole batch, PipeshardParallel with 1, 2 and 4 stages and 2 micro-batches; also
available: shard-2mb, ShardParallel with 2 micro-batches) on 8 emulated CPU devices, and
`generated.check` compares losses and every state leaf with the jitted step (micro-batched
methods: the jitted step averaging over the same micro-batches) at `generated.TOL`.

Outcomes per case and method: equal; differ (beyond tolerance: the largest error over its
tolerance, absolute and relative errors, the leaf); error (an exception other than the
documented "cannot plan" ones: its type and message head); skip (a documented refusal, e.g.
4 stages on a model whose `mark_pipeline_boundary` cuts leave 3 layers); hang (the case
ran past `--timeout-s`: its worker is killed and the rest of the case is not run); invalid
(the reference run itself is not finite).  Every `FallbackWarning` is recorded and tallied
by stage and primitive, and so is every re-layout XLA's partitioner does by replicating the
value whole (its "Involuntary full rematerialization" warning, read from the worker's
stderr, `cost_model.compile_log`: the value, the two layouts, and whether it moves what
the plan priced, `as_priced`).  Cases run in worker processes (`--jobs` at a time, each
fresh every RECYCLE cases) so that a hang or a crash is counted, not fatal.

Prints the tally and writes benchmarks/results/fuzz.md and fuzz.json (stamped with the
commit and the command).  Exit status 1 when any case differs, errors, hangs or is invalid.
"""

from __future__ import annotations

import argparse
import collections
import math
import multiprocessing as mp
import os
import pathlib
import re
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import wait

from benchmarks.stamp import stamp, stamp_markdown

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DEFAULT_METHODS = ("shard", "pipeshard-1", "pipeshard-2", "pipeshard-4")
ALL_METHODS = ("shard", "shard-2mb", "pipeshard-1", "pipeshard-2", "pipeshard-4",
               "pipeshard-1-tight", "pipeshard-2-tight", "pipeshard-4-tight")
FAMILIES = ("mlp", "attention", "conv_bn", "moe", "tied_embed", "scan")  # generated.FAMILIES
OUTCOMES = ("equal", "drift", "differ", "error", "hang", "skip", "invalid", "not run")
BAD = ("differ", "error", "hang", "invalid")
RECYCLE = 20   # cases per worker process (bounds what XLA's caches hold)
#: What XLA's SPMD partitioner logs when it reshards a value by replicating it whole and
#: slicing it.
FULL_REMAT = "Involuntary full rematerialization"


# ------------------------------------------------------------------------------ worker


def _worker(conn) -> None:
    """Runs cases sent over `conn`; sends ("case", info), ("result", row) per method and
    ("done", seconds).  Sets up 8 CPU devices before JAX starts."""
    os.environ["AUTOPAR_CACHE_DIR"] = ""   # plan afresh, write nothing into $HOME
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import generated

    from autopar.cost_model import compile_log

    while True:
        task = conn.recv()
        if task is None:
            return
        t0 = time.perf_counter()
        try:
            case = generated.generate(task["seed"], task["family"], small=task["small"])
        except Exception as err:  # a generator bug: every method of the case is invalid
            name = f"{task['family'] or '?'}-{task['seed']}"
            conn.send(("case", {"case": name, "seed": task["seed"],
                                "family": task["family"] or "?", "config": None}))
            for method in task["methods"]:
                conn.send(("result", {
                    "case": name, "family": task["family"] or "?", "seed": task["seed"],
                    "method": method, "outcome": "invalid", "fallbacks": [],
                    "fallback_keys": [], "seconds": 0.0,
                    "error": f"generate: {type(err).__name__}: {str(err)[:300]}"}))
            conn.send(("done", time.perf_counter() - t0))
            continue
        conn.send(("case", {"case": case.name, "seed": case.seed, "family": case.family,
                            "config": dict(case.config)}))
        for name in task["methods"]:
            with compile_log.captured_fd2() as logged:
                try:
                    row = generated.check(case, name, time_limit_s=task["time_limit_s"],
                                          comm_name=task["comm"])
                except Exception as err:  # the reference itself failed: the generator's
                    row = {"case": case.name, "family": case.family, "seed": case.seed,
                           "method": name, "outcome": "invalid", "fallbacks": [],
                           "fallback_keys": [], "seconds": 0.0,
                           "error": f"reference: {type(err).__name__}: {str(err)[:300]}"}
            row["full_remats"] = full_remats(logged[0] if logged else "")
            conn.send(("result", row))
        generated.clear_references()
        jax.clear_caches()
        conn.send(("done", time.perf_counter() - t0))


def full_remats(log: str) -> list[str]:
    """Each of XLA's full-rematerialization warnings in `log` (`compile_log.parse`), as
    "operation shape: from → to"."""
    from autopar.cost_model import compile_log

    return [f"{r.operation} {r.shape}: {r.source} → {r.target}"
            for r in compile_log.parse(log).rematerializations]


def _split_dims(sharding: str) -> set[int] | None:
    """The dims an XLA sharding string ("{devices=[4,2,1]<=[2,4]T(1,0)}", "{replicated}")
    splits; None when it does not parse."""
    if "replicated" in sharding and "devices=" not in sharding:
        return set()
    m = re.search(r"devices=\[([\d,]+)\]", sharding)
    if m is None:
        return None
    tiles = [int(n) for n in m.group(1).split(",")]
    if "last_tile_dim_replicate" in sharding:
        tiles = tiles[:-1]
    return {d for d, n in enumerate(tiles) if n > 1}


def as_priced(warning: str) -> bool:
    """Whether a `full_remats` entry moves no more than the plan priced: no dim is split in
    both layouts, so every split leaves its dim, the planner's all-gathers (`reshard_steps`,
    down to `gather_first`) reach the replicated value too, and XLA's replicate-and-slice
    moves the same bytes.  False when some dim is split in both (XLA gathers what the plan
    would have kept split) or the layouts do not parse."""
    m = re.search(r": (\{.*?\}) → (\{.*?\})$", warning)
    if m is None:
        return False
    src, dst = _split_dims(m.group(1)), _split_dims(m.group(2))
    return src is not None and dst is not None and not src & dst


class _Slot:
    """One worker process and the case it runs."""

    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.task: dict | None = None
        self.served = 0
        self.started = 0.0
        self.info: dict | None = None
        self.rows: list[dict] = []

    def send(self, task: dict) -> None:
        self.task, self.info, self.rows = task, None, []
        self.started = time.monotonic()
        self.conn.send(task)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


def _unfinished(slot: _Slot, outcome: str, error: str) -> list[dict]:
    """Rows for the methods of the slot's case that sent no result: the first gets
    `outcome`, the rest "not run"."""
    task, done = slot.task, {r["method"] for r in slot.rows}
    info = slot.info or {"case": f"seed {task['seed']}", "seed": task["seed"],
                         "family": task["family"] or "?"}
    rows: list[dict] = []
    for name in task["methods"]:
        if name in done:
            continue
        rows.append({"case": info["case"], "family": info["family"], "seed": info["seed"],
                     "method": name, "outcome": "not run" if rows else outcome,
                     "error": f"after a {outcome} in {rows[0]['method']}" if rows else error,
                     "fallbacks": [], "fallback_keys": [], "seconds": 0.0})
    return rows


def run(tasks: list[dict], timeout_s: float, jobs: int) -> tuple[list[dict], list[dict]]:
    """Runs `tasks` in `jobs` worker processes; (case infos, result rows)."""
    ctx = mp.get_context("spawn")
    pending = collections.deque(tasks)
    slots: list[_Slot] = []
    infos: list[dict] = []
    rows: list[dict] = []
    total = len(tasks)

    def report(slot: _Slot, status: str) -> None:
        n = len(infos)
        outs = collections.Counter(r["outcome"] for r in slot.rows)
        name = slot.info["case"] if slot.info else f"seed {slot.task['seed']}"
        print(f"[{n}/{total}] {name}: {status} "
              f"({', '.join(f'{k} {v}' for k, v in sorted(outs.items()))}) "
              f"{time.monotonic() - slot.started:.0f} s", file=sys.stderr, flush=True)
        for r in slot.rows:
            if r["outcome"] in BAD:
                print(f"    {r['method']}: {r['outcome']}: "
                      f"{r.get('error') or _diff_text(r)}", file=sys.stderr, flush=True)

    def finish(slot: _Slot, status: str) -> None:
        info = slot.info or {"case": f"seed {slot.task['seed']}", "seed": slot.task["seed"],
                             "family": slot.task["family"] or "?", "config": None}
        infos.append({**info, "status": status})
        rows.extend(slot.rows)
        report(slot, status)
        slot.task = None

    try:
        while pending or any(s.task for s in slots):
            while pending and len([s for s in slots if s.task]) < jobs:
                slot = next((s for s in slots if s.task is None), None)
                if slot is None or slot.served >= RECYCLE or not slot.proc.is_alive():
                    if slot is not None:
                        slot.stop()
                        slots.remove(slot)
                    slot = _Slot(ctx)
                    slots.append(slot)
                slot.send(pending.popleft())
                slot.served += 1
            busy = [s for s in slots if s.task]
            now = time.monotonic()
            deadline = min(s.started + timeout_s for s in busy)
            ready = wait([s.conn for s in busy], timeout=max(0.0, deadline - now))
            for slot in busy:
                if slot.conn in ready:
                    try:
                        kind, payload = slot.conn.recv()
                    except (EOFError, OSError):
                        code = slot.proc.exitcode
                        slot.rows += _unfinished(slot, "error",
                                                 f"WorkerDied: the worker exited (status "
                                                 f"{code}) while running this method")
                        slot.kill()
                        slots.remove(slot)
                        finish(slot, "crashed")
                        continue
                    if kind == "case":   # the clock starts when the case does (not
                        slot.info = payload  # the worker's start-up)
                        slot.started = time.monotonic()
                    elif kind == "result":
                        slot.rows.append(payload)
                    else:
                        finish(slot, "done")
                elif time.monotonic() >= slot.started + timeout_s:
                    slot.rows += _unfinished(slot, "hang",
                                             f"Hang: no result within {timeout_s:g} s "
                                             f"for the case")
                    slot.kill()
                    slots.remove(slot)
                    finish(slot, "hung")
    finally:
        for slot in slots:
            if slot.task:
                slot.kill()
            else:
                slot.stop()
    return infos, rows


# ------------------------------------------------------------------------------ report


def _diff_text(r: dict) -> str:
    if r.get("err_over_tol") is None:
        return ""
    text = (f"err/tol {_g(r['err_over_tol'])} at {r.get('worst')}, max abs "
            f"{_g(r.get('max_abs_err'))}, max rel {_g(r.get('max_rel_err'))}")
    if r.get("step_err_over_tol") is not None:   # generated.stepwise
        text += (f"; step by step, against the jitted step on the same state: err/tol "
                 f"{_g(r['step_err_over_tol'])} at {r.get('step_worst')}")
    return text


def _g(x) -> str:
    return "—" if x is None else f"{x:.3g}" if isinstance(x, (int, float)) else str(x)


def tally(rows: list[dict], methods: Sequence[str]) -> dict:
    """Counts by method and outcome, by family and outcome, the error kinds, the
    fallbacks by key (method runs reporting each), and the error margins."""
    by_method = {m: collections.Counter() for m in methods}
    by_family: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    by_comm: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    errors: collections.Counter = collections.Counter()
    fallback_runs: collections.Counter = collections.Counter()
    fallback_where: dict[str, set] = collections.defaultdict(set)
    remat_runs: collections.Counter = collections.Counter()
    remat_count: collections.Counter = collections.Counter()
    remat_priced: collections.Counter = collections.Counter()
    for r in rows:
        by_method.setdefault(r["method"], collections.Counter())[r["outcome"]] += 1
        by_family[r["family"]][r["outcome"]] += 1
        by_comm[r.get("comm") or "?"][r["outcome"]] += 1
        if r["outcome"] in ("error", "hang", "invalid", "skip"):
            errors[(r["outcome"], (r.get("error") or "")[:120])] += 1
        for key in r.get("fallback_keys", []):
            fallback_runs[key] += 1
            fallback_where[key].add(r["method"])
        if r.get("full_remats"):
            remat_runs[r["method"]] += 1
            remat_count[r["method"]] += len(r["full_remats"])
            remat_priced[r["method"]] += sum(map(as_priced, r["full_remats"]))
    equal = [r for r in rows if r["outcome"] == "equal"]
    moves = [r["move_over_tol"] for r in rows
             if r["outcome"] in ("equal", "drift", "differ")
             and r.get("move_over_tol") is not None]
    return {
        "by_method": {m: dict(c) for m, c in by_method.items()},
        "by_family": {f: dict(c) for f, c in sorted(by_family.items())},
        "by_comm": {f: dict(c) for f, c in sorted(by_comm.items())},
        "errors": [{"outcome": o, "error": e, "runs": n}
                   for (o, e), n in errors.most_common()],
        "fallbacks": [{"fallback": k, "runs": n, "methods": sorted(fallback_where[k])}
                      for k, n in fallback_runs.most_common()],
        "max_err_over_tol_equal": max((r["err_over_tol"] for r in equal), default=None),
        "max_err_over_move_tol_equal": max((r["err_over_move_tol"] for r in equal
                                            if r.get("err_over_move_tol") is not None),
                                           default=None),
        "min_move_over_tol": min(moves, default=None),
        "median_move_over_tol": sorted(moves)[len(moves) // 2] if moves else None,
        "tight": tight_tally(rows),
        "full_remats": {m: {"runs": remat_runs[m], "warnings": remat_count[m],
                            "as_priced": remat_priced[m]}
                        for m in by_method if remat_runs[m]},
    }


def tight_tally(rows: list[dict]) -> dict[str, dict]:
    """Per "-tight" method (a pipeline under TIGHT_FRACTION of its free plan's largest stage,
    `generated.tight_budget`): runs planned under the budget, those that rematerialized a
    layer, layers rematerialized of layers planned, runs whose compiled stages exceed the
    budget, and the largest compiled peak over the budget and over the planner's figure."""
    out: dict[str, dict] = {}
    for r in rows:
        if r.get("budget") is None:
            continue
        t = out.setdefault(r["method"], {"planned": 0, "remat_runs": 0, "remat_layers": 0,
                                         "layers": 0, "over_budget": 0,
                                         "max_compiled_over_budget": 0.0,
                                         "max_compiled_over_planned": 0.0})
        t["planned"] += 1
        t["remat_runs"] += r["remat_layers"] > 0
        t["remat_layers"] += r["remat_layers"]
        t["layers"] += r["layers"]
        t["over_budget"] += r["compiled_over_budget"] > 1.0
        t["max_compiled_over_budget"] = max(t["max_compiled_over_budget"],
                                            r["compiled_over_budget"])
        t["max_compiled_over_planned"] = max(t["max_compiled_over_planned"],
                                             r["compiled_over_planned"])
    return out


def markdown(meta: dict, args: dict, infos: list[dict], rows: list[dict], t: dict,
             wall_s: float) -> str:
    methods = args["methods"]
    total = collections.Counter(r["outcome"] for r in rows)
    lines = ["# Fuzz: generated train steps against `jax.jit`", "", stamp_markdown(meta), "",
             f"**{len(infos)} cases x {len(methods)} methods: "
             + ", ".join(f"{o} {total[o]}" for o in OUTCOMES if total[o]) + f"** in "
             f"{wall_s / 60:.1f} min (seeds {args['seed']}..{args['seed'] + args['cases'] - 1}"
             f"{', families ' + ','.join(args['families']) if args['families'] else ''}"
             f"{', small' if args['small'] else ''}; timeout {args['timeout_s']:g} s a case).",
             "",
             "Each case (tests/generated.py: family, sizes, activation, loss, optimizer drawn "
             "from its seed) runs 3 optimizer steps under each method on 8 emulated CPU "
             "devices and under the single-device `jax.jit` step (micro-batched methods: "
             "the jitted step averaging loss and gradients over the same 2 strided "
             "micro-batches). Equal: losses and every state leaf within |got - ref| <= atol "
             "+ rtol·|ref| (SGD-momentum rtol 2e-4 / atol 2e-5; Adam, AdamW rtol 1e-3 / "
             "atol 1e-4). Drift: not equal, but every step is, against the jitted step "
             "applied to the state the method was given (`generated.stepwise`): the "
             "reference amplifies rounding-level differences of its input, which no "
             "method's arithmetic order avoids. Skip: a refusal the method documents (too "
             "few layers for the "
             "stages; under a tight budget, no plan that fits it); error: any other "
             "exception; hang: past the timeout (worker killed). "
             "Cost model: the methods plan with this machine's (local) or with almost free "
             "communication (cheap: the search splits nearly every value), drawn per case "
             "unless `--comm` says.",
             "", "| method | " + " | ".join(OUTCOMES) + " |",
             "|---|" + "---|" * len(OUTCOMES)]
    for m in methods:
        c = t["by_method"].get(m, {})
        lines.append(f"| {m} | " + " | ".join(str(c.get(o, 0)) for o in OUTCOMES) + " |")
    lines += ["", "| family | cases | " + " | ".join(OUTCOMES) + " |",
              "|---|---|" + "---|" * len(OUTCOMES)]
    cases_per_family = collections.Counter(i["family"] for i in infos)
    for f, c in t["by_family"].items():
        lines.append(f"| {f} | {cases_per_family[f]} | "
                     + " | ".join(str(c.get(o, 0)) for o in OUTCOMES) + " |")
    lines += ["", "| cost model | " + " | ".join(OUTCOMES) + " |",
              "|---|" + "---|" * len(OUTCOMES)]
    for f, c in t["by_comm"].items():
        lines.append(f"| {f} | " + " | ".join(str(c.get(o, 0)) for o in OUTCOMES) + " |")
    lines += ["", f"Largest error over tolerance among equal runs: "
              f"{_g(t['max_err_over_tol_equal'])}; over the toy suite's stricter, "
              f"movement-scaled tolerance (`benchmarks.toy.leaf_tolerance`, a diagnostic): "
              f"{_g(t['max_err_over_move_tol_equal'])}. Sensitivity: the reference moves "
              f"the least-moved parameter leaf of a run by {_g(t['min_move_over_tol'])} "
              f"tolerances at least (median over runs {_g(t['median_move_over_tol'])}; leaves "
              f"with gradient 0 up to rounding left out): a method that dropped that leaf's "
              f"update would differ by about as much.", ""]
    if t["tight"]:
        lines += ["## Under a tight memory budget (rematerialization searched)", "",
                  "The \"-tight\" methods plan the pipeline under 0.85x the largest stage of "
                  "its plan without a budget (`generated.TIGHT_FRACTION`; one stage under "
                  "GPipe, both micro-batches in flight): the time-optimal layouts do not "
                  "fit, and the search rematerializes layers or lays them out leaner. "
                  "Compiled: each stage's peak from XLA's memory analysis of the programs the "
                  "step runs. Runs that found no plan under the budget are skips.", "",
                  "| method | planned | rematerialized a layer | layers remat / planned | "
                  "compiled over budget (runs) | max compiled / budget | "
                  "max compiled / planned |", "|---|---|---|---|---|---|---|"]
        for m, c in t["tight"].items():
            lines.append(f"| {m} | {c['planned']} | {c['remat_runs']} | {c['remat_layers']}"
                         f" / {c['layers']} | {c['over_budget']} | "
                         f"{c['max_compiled_over_budget']:.3f} | "
                         f"{c['max_compiled_over_planned']:.3f} |")
        lines.append("")
    bad = [r for r in rows if r["outcome"] == "drift" or r["outcome"] in BAD]
    lines += ["## Not equal", ""]
    if not bad:
        lines.append("None.")
    else:
        lines += ["| case | method | outcome | details |", "|---|---|---|---|"]
        for r in bad:
            detail = r.get("error") or _diff_text(r)
            lines.append(f"| {r['case']} | {r['method']} | {r['outcome']} | "
                         f"{detail.replace('|', '/')} |")
    lines += ["", "## Errors and skips by kind", ""]
    if not t["errors"]:
        lines.append("None.")
    else:
        lines += ["| outcome | runs | error |", "|---|---|---|"]
        for e in t["errors"]:
            lines.append(f"| {e['outcome']} | {e['runs']} | {e['error'].replace('|', '/')} |")
    lines += ["", "## Fallbacks (FallbackWarning), by stage and primitive", "",
              "Runs (case x method) that reported each; a fallback is legal (the program "
              "stays correct) but is not the plan that was priced.", ""]
    if not t["fallbacks"]:
        lines.append("None.")
    else:
        lines += ["| fallback | runs | methods |", "|---|---|---|"]
        for f in t["fallbacks"]:
            lines.append(f"| {f['fallback']} | {f['runs']} | {', '.join(f['methods'])} |")
    lines += ["", "## XLA full rematerializations, by method", "",
              f"Runs whose compiled programs made XLA's SPMD partitioner log \"{FULL_REMAT}\":"
              " it re-laid a value out by all-gathering it whole and slicing it (correct). "
              "The planner prices a move of several mesh axes between dims as all-gathers "
              "down to the axes that stay (`sharding_spec.reshard_steps`): as priced, a "
              "warning where no dim is split in both layouts moves the bytes the plan "
              "priced (`as_priced`); one where a dim is split in both may gather more. "
              "Either way the emitter did not route this move through `gather_first`.", ""]
    remats = [r for r in rows if r.get("full_remats")]
    if not remats:
        lines.append("None.")
    else:
        lines += ["| method | runs | warnings | as priced |", "|---|---|---|---|"]
        for m, c in t["full_remats"].items():
            lines.append(f"| {m} | {c['runs']} | {c['warnings']} | {c['as_priced']} |")
        lines += ["", "| case | method | HLO value: from → to |", "|---|---|---|"]
        for r in remats:
            lines.append(f"| {r['case']} | {r['method']} | "
                         + "; ".join(x.replace("|", "/") + ("" if as_priced(x) else
                                                              " (not as priced)")
                                     for x in r["full_remats"]) + " |")
    lines += ["", f"Cases and configs: {args.get('name', 'fuzz')}.json (`cases`); every "
              f"run: `rows`.", ""]
    return "\n".join(lines)


def _finite(x):
    """JSON without NaN/Infinity: non-finite floats as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fuzz",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=300, help="number of cases (default 300)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first case (default 0)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, from {','.join(ALL_METHODS)} "
                        f"(default {','.join(DEFAULT_METHODS)})")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="per case, all its methods and its reference together (default "
                        "300; a case takes 10-90 s on 2 cores)")
    p.add_argument("--families", default="",
                   help=f"cycle through these families instead of drawing one per seed "
                        f"({','.join(FAMILIES)})")
    p.add_argument("--small", action="store_true", help="cap the layer counts (CI's cases)")
    p.add_argument("--comm", choices=("drawn", "local", "cheap"), default="drawn",
                   help="the cost model the methods plan with: this machine's (local), "
                        "almost free communication (cheap: splits nearly everything), or "
                        "drawn per case from its seed (default)")
    p.add_argument("--jobs", type=int, default=1, help="cases at a time (default 1)")
    p.add_argument("--time-limit-s", type=float, default=5.0,
                   help="the methods' ILP time limit (default 5)")
    p.add_argument("--output-dir", default=None, metavar="DIR",
                   help="where to write the results (default benchmarks/results)")
    p.add_argument("--name", default="fuzz",
                   help="results file name, NAME.md and NAME.json (default fuzz)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    families = [f for f in args.families.split(",") if f]
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown or not methods:
        parser.error(f"--methods: unknown {unknown}; choose from {','.join(ALL_METHODS)}")
    if [f for f in families if f not in FAMILIES]:
        parser.error(f"--families: choose from {','.join(FAMILIES)}")
    if args.cases < 1 or args.jobs < 1 or args.timeout_s <= 0:
        parser.error("--cases and --jobs must be positive, --timeout-s > 0")
    out_dir = pathlib.Path(args.output_dir) if args.output_dir else RESULTS
    tasks = [{"seed": args.seed + i, "family": families[i % len(families)] if families else None,
              "small": args.small, "methods": methods, "time_limit_s": args.time_limit_s,
              "comm": None if args.comm == "drawn" else args.comm}
             for i in range(args.cases)]
    t0 = time.perf_counter()
    infos, rows = run(tasks, args.timeout_s, args.jobs)
    wall_s = time.perf_counter() - t0
    settings = {"cases": args.cases, "seed": args.seed, "methods": methods,
                "families": families, "small": args.small, "comm": args.comm,
                "timeout_s": args.timeout_s, "name": args.name,
                "jobs": args.jobs, "time_limit_s": args.time_limit_s}
    t = tally(rows, methods)
    meta = stamp()
    text = markdown(meta, settings, infos, rows, t, wall_s)
    print(text)
    from autopar.cost_model.jsonio import write_json_atomic

    out_dir.mkdir(parents=True, exist_ok=True)
    keep = ("traceback",)
    write_json_atomic(out_dir / f"{args.name}.json", _finite({
        "meta": meta, "settings": settings, "wall_s": wall_s, "tally": t, "cases": infos,
        "rows": [{k: v for k, v in r.items() if k not in keep} for r in rows],
        "tracebacks": [{"case": r["case"], "method": r["method"], "traceback": r["traceback"]}
                       for r in rows if r.get("traceback")]}))
    tmp = out_dir / f"{args.name}.md.tmp"
    tmp.write_text(text)
    tmp.replace(out_dir / f"{args.name}.md")
    return 1 if any(r["outcome"] in BAD for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
