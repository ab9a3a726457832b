"""Train a character-level GPT on the source text of Python's standard library with autopar.

The corpus is on every machine without a download: the top-level `*.py` files of the running
Python's standard library (`sysconfig.get_paths()["stdlib"]`), sorted by name; every tenth
file is held out for validation.  Characters are tokens: the ASCII byte of each character
(anything else reads as "?"), so the vocabulary is 128 and decoding is `bytes(ids)`.

    python examples/train_gpt.py                             # 8 emulated CPU devices, auto
    python examples/train_gpt.py --method pipeshard --micro-batches auto --steps 600
    python examples/train_gpt.py --resume --method shard --devices 4   # continue elsewhere
    autopar launch -n 2 --devices-per-process 4 examples/train_gpt.py --steps 100

What it does: plans the step (`--method shard`: `autopar.ShardParallel`; `pipeshard`:
`autopar.PipeshardParallel`; `auto`: plans both and keeps the one predicted faster), prints
the plan, trains with a progress bar (loss, tokens/s, measured against predicted step time),
evaluates the validation loss every `--eval-every` steps, saves an Orbax checkpoint every
`--ckpt-every` steps (`autopar.Checkpoints`; `--resume` continues from the latest one, into
any method or device count: checkpoints do not depend on the plan), writes every step to
`OUT/metrics.csv` (and TensorBoard when `tensorboardX` is installed), draws `OUT/loss.png`
(train and validation loss against the unigram baseline: the cross-entropy of predicting each
character by its frequency alone), and ends with a few lines of text sampled from the model.

Under `autopar launch` every process runs this script; process 0 searches the plan and prints,
every process passes its own rows of each batch, and the metrics are gathered for logging.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import pathlib
import sys
import sysconfig
import time
from collections.abc import Sequence

import numpy as np

VOCAB = 128          # ASCII
VALIDATION_EVERY = 10  # every 10th corpus file (sorted by name) is the validation set
MODELS = {           # name -> (hidden, layers, heads, seq)
    "tiny": (32, 2, 4, 32),
    "small": (128, 4, 4, 128),
    "medium": (256, 6, 8, 256),
}
CSV_FIELDS = ("step", "train_loss", "val_loss", "step_s", "tokens_per_s", "predicted_step_s",
              "method", "devices", "wall_s")


# ---- data -------------------------------------------------------------------------------------

def encode(text: str) -> np.ndarray:
    """Token ids (uint8 in [0, 128)) of `text`: its ASCII bytes, "?" for anything else."""
    return np.frombuffer(text.encode("ascii", "replace"), np.uint8)


def decode(ids: Sequence[int]) -> str:
    """The text of token ids (`encode`'s inverse on ASCII text)."""
    return bytes(int(i) for i in ids).decode("ascii")


def corpus_files(stdlib: str | None = None) -> list[pathlib.Path]:
    """The corpus: the standard library's top-level `*.py` files, sorted by name."""
    root = pathlib.Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no *.py files in {root} (the standard library's source; "
                                f"pass --stdlib DIR to read another directory of .py files)")
    return files


def load_corpus(stdlib: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) token streams (uint8): files joined by a blank line, every
    `VALIDATION_EVERY`-th file into validation."""
    train, val = [], []
    for k, path in enumerate(corpus_files(stdlib)):
        text = path.read_text(encoding="utf-8", errors="replace") + "\n\n"
        (val if k % VALIDATION_EVERY == VALIDATION_EVERY - 1 else train).append(encode(text))
    return np.concatenate(train), np.concatenate(val)


def unigram_loss(train: np.ndarray, val: np.ndarray) -> float:
    """Cross-entropy (nats per character) of `val` under `train`'s character frequencies
    (add-one smoothed): the loss of a model that ignores context."""
    counts = np.bincount(train, minlength=VOCAB) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val].mean())


def batch_at(tokens: np.ndarray, index: int, batch: int, seq: int, seed: int) -> dict:
    """Batch `index` of a stream: `batch` random windows of `seq + 1` characters, drawn from
    (seed, index) alone, so a resumed run sees the batches an uninterrupted one would.
    {"tokens", "labels"}: int32 [batch, seq], labels the next characters."""
    rng = np.random.default_rng([seed, index])
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
    windows = tokens[starts[:, None] + np.arange(seq + 1)[None, :]].astype(np.int32)
    return {"tokens": windows[:, :-1], "labels": windows[:, 1:]}


# ---- arguments --------------------------------------------------------------------------------

def micro_batches(text: str) -> int | str:
    if text == "auto":
        return text
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--micro-batches must be >= 1 or 'auto', got {text}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=("shard", "pipeshard", "auto"), default="auto",
                   help="autopar method; auto plans shard and pipeshard, keeps the faster")
    p.add_argument("--devices", type=int, default=8,
                   help="devices to use (emulated CPU devices when there is no accelerator; "
                        "ignored under `autopar launch`, which sets them per process)")
    p.add_argument("--steps", type=int, default=300, help="train until this step")
    p.add_argument("--batch", type=int, default=32, help="sequences per step (global)")
    p.add_argument("--micro-batches", type=micro_batches, default=2,
                   help="micro-batches per step, or 'auto' (pipeshard: the planner picks)")
    p.add_argument("--stages", default="auto", help="pipeline stages (pipeshard), or auto")
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=50, help="linear warmup steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=50, help="validation loss every K steps")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=100, help="checkpoint every K steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT's checkpoint")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("examples/runs/gpt"),
                   help="metrics.csv, loss.png, checkpoints/ and sample.txt go here")
    p.add_argument("--time-limit", type=float, default=10.0,
                   help="sharding solver limit per problem, seconds")
    p.add_argument("--sample-chars", type=int, default=400, help="characters to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--stdlib", default=None, help="directory of .py files (default: stdlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "devices", "eval_every", "eval_batches", "ckpt_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.stages != "auto":
        args.stages = int(args.stages)
    return args


# ---- the model and its step -------------------------------------------------------------------

def make_step(args: argparse.Namespace):
    """(cfg, train_step, init, loss_fn) of the GPT: the zoo's GPT (`autopar.models`) with
    AdamW (warmup then constant, gradients clipped at global norm 1)."""
    import jax
    import jax.numpy as jnp
    import optax

    from autopar.models import GPTConfig, gpt_train_step

    hidden, layers, heads, seq = MODELS[args.model]
    cfg = GPTConfig(hidden, layers, heads, vocab=VOCAB, seq=seq, dtype="float32", remat=False)
    lr = optax.join_schedules([optax.linear_schedule(0.0, args.lr, max(args.warmup, 1)),
                               optax.constant_schedule(args.lr)], [max(args.warmup, 1)])
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.01))
    train_step, model, tx = gpt_train_step(cfg, tx=tx)

    def init() -> dict:
        key = jax.random.key(args.seed)
        params = model.init(key, jnp.zeros((1, cfg.seq), jnp.int32))["params"]
        return {"params": params, "opt_state": tx.init(params)}

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return cfg, train_step, init, loss_fn, model


def make_method(name: str, args: argparse.Namespace):
    import autopar

    if name == "shard":
        mb = 1 if args.micro_batches == "auto" else args.micro_batches
        return autopar.ShardParallel(num_micro_batches=mb, time_limit_s=args.time_limit)
    return autopar.PipeshardParallel(num_micro_batches=args.micro_batches,
                                     num_stages=args.stages, time_limit_s=args.time_limit)


@dataclasses.dataclass
class Chosen:
    """The step the run trains with: its method name, parallelized step and plan."""

    method: str
    step: object
    plan: object


def choose(args, train_step, devices, state_abs, batch_abs, say) -> Chosen:
    """Plans the step under `args.method` (both methods for "auto", keeping the one with the
    smaller predicted step time)."""
    import autopar

    names = ("shard", "pipeshard") if args.method == "auto" else (args.method,)
    options = []
    for name in names:
        step = autopar.parallelize(train_step, method=make_method(name, args),
                                   batch_argnums=(1,), devices=devices)
        t0 = time.perf_counter()
        plan = step.get_plan(state_abs, batch_abs)
        say(f"planned {name} in {time.perf_counter() - t0:.1f} s: predicted "
            f"{plan.predicted.step_s * 1e3:.1f} ms per step")
        options.append(Chosen(name, step, plan))
    best = min(options, key=lambda c: c.plan.predicted.step_s)
    if len(options) > 1:
        say(f"auto: training with {best.method} (the faster prediction)")
    return best


# ---- placement (one process or several) -------------------------------------------------------

def global_batch(full: dict, batch_sharding: dict):
    """The global batch from this process's rows of `full` (every process can build `full`:
    the batches are a function of the step index)."""
    import autopar.distributed as dist

    rows = {k: v[dist.process_rows(batch_sharding[k], v.shape)] for k, v in full.items()}
    return dist.global_batch(rows, batch_sharding, len(full["tokens"]))


# ---- metrics, plots, samples ------------------------------------------------------------------

class Metrics:
    """Rows of OUT/metrics.csv (one per step), kept up to `start` on resume; TensorBoard
    scalars too when tensorboardX is installed."""

    def __init__(self, out: pathlib.Path, start: int):
        self.path = out / "metrics.csv"
        self.rows: list[dict] = []
        if start and self.path.exists():
            with self.path.open(newline="") as f:
                self.rows = [r for r in csv.DictReader(f) if int(r["step"]) <= start]
        self._rewrite()
        self.board = None
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            pass
        else:
            self.board = SummaryWriter(str(out / "tensorboard"), purge_step=start + 1)

    def add(self, row: dict) -> None:
        self.rows.append({k: row.get(k, "") for k in CSV_FIELDS})
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, CSV_FIELDS).writerow(self.rows[-1])
        if self.board is not None:
            for key in ("train_loss", "val_loss", "tokens_per_s"):
                if row.get(key, "") != "":
                    self.board.add_scalar(key, float(row[key]), int(row["step"]))

    def _rewrite(self) -> None:
        with self.path.open("w", newline="") as f:
            writer = csv.DictWriter(f, CSV_FIELDS)
            writer.writeheader()
            writer.writerows(self.rows)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def plot(rows: list[dict], unigram: float, path: pathlib.Path, title: str) -> bool:
    """Train and validation loss against the step, with the unigram baseline, as a PNG;
    False (nothing written) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [float(r["train_loss"]) for r in rows], lw=0.8, alpha=0.7, label="train")
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"] != ""]
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.axhline(unigram, color="gray", ls="--", label=f"unigram baseline ({unigram:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
    return True


def sample(model, params, seq: int, prompt: str, chars: int, temperature: float,
           seed: int) -> str:
    """`chars` characters generated after `prompt` (temperature sampling; 0: greedy), one
    compiled forward over a window of the last `seq` characters."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def next_logits(params, window, last):
        logits = model.apply({"params": params}, window)
        return logits[0, last]

    ids = list(encode(prompt))
    rng = np.random.default_rng(seed)
    for _ in range(chars):
        context = ids[-seq:]
        window = np.zeros((1, seq), np.int32)
        window[0, :len(context)] = context
        logits = np.asarray(next_logits(params, jnp.asarray(window), len(context) - 1),
                            np.float64)
        if temperature <= 0:
            ids.append(int(np.argmax(logits)))
        else:
            p = np.exp((logits - logits.max()) / temperature)
            ids.append(int(rng.choice(VOCAB, p=p / p.sum())))
    return decode(ids)


def write_summary(args: argparse.Namespace, chosen: Chosen, rows: list[dict], unigram: float,
                  devices: int, measured_s: float | None, wall_s: float) -> None:
    """OUT/summary.json: the command, where and when it ran, the plan, and the last losses
    (nats per character) against the unigram baseline; times in seconds."""
    import json
    import platform
    import subprocess

    import jax

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=pathlib.Path(__file__).parent,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    val = [r for r in rows if r["val_loss"] != ""]
    summary = {
        "command": " ".join(["python", *sys.argv]), "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": platform.node(),
        "cpus": os.cpu_count(), "platform": jax.devices()[0].platform,
        "processes": jax.process_count(), "devices": devices, "model": args.model,
        "batch": args.batch, "method": chosen.method,
        "plan": chosen.plan.summary(), "predicted_step_s": chosen.plan.predicted.step_s,
        "measured_step_s_median_this_run": measured_s, "wall_s_this_run": round(wall_s, 1),
        "steps": int(rows[-1]["step"]) if rows else 0,
        "unigram_val_loss": unigram,
        "final_train_loss": float(rows[-1]["train_loss"]) if rows else None,
        "final_val_loss": float(val[-1]["val_loss"]) if val else None,
    }
    tmp = args.out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    tmp.replace(args.out / "summary.json")


# ---- the run ----------------------------------------------------------------------------------

def setup_devices(args: argparse.Namespace):
    """Starts JAX: under `autopar launch` the distributed runtime (which sets the devices),
    else `--devices` emulated CPU devices; returns the devices to use."""
    import autopar.distributed as dist

    if dist.launched():
        dist.initialize()
        import jax
        return jax.devices()
    import jax
    jax.config.update("jax_num_cpu_devices", args.devices)
    devices = jax.devices()
    if len(devices) < args.devices:
        raise SystemExit(f"--devices {args.devices}: JAX has {len(devices)} "
                         f"{devices[0].platform} devices")
    return devices[:args.devices]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    devices = setup_devices(args)
    import jax

    import autopar
    import autopar.distributed as dist

    rank = jax.process_index()
    lead = rank == 0

    def say(message: str) -> None:
        if lead:
            print(message, flush=True)

    train, val = load_corpus(args.stdlib)
    unigram = unigram_loss(train, val)
    cfg, train_step, init, loss_fn, model = make_step(args)
    say(f"corpus: {len(train):,} train / {len(val):,} validation characters from "
        f"{len(corpus_files(args.stdlib))} files; unigram baseline {unigram:.3f} nats/char")
    say(f"model: GPT {args.model} (hidden {cfg.hidden}, {cfg.layers} layers, {cfg.heads} "
        f"heads, seq {cfg.seq}), batch {args.batch}, on {len(devices)} "
        f"{devices[0].platform} devices in {jax.process_count()} process(es)")

    state_abs = jax.eval_shape(init)
    batch_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                             batch_at(train, 0, args.batch, cfg.seq, args.seed))
    chosen = choose(args, train_step, devices, state_abs, batch_abs, say)
    say(chosen.plan.summary())
    predicted_s = chosen.plan.predicted.step_s

    args.out.mkdir(parents=True, exist_ok=True)
    ckpts = autopar.Checkpoints(args.out / "checkpoints", max_to_keep=2)
    start = ckpts.latest_step() if args.resume else None
    if args.resume and start is None:
        say(f"--resume: no checkpoint in {args.out / 'checkpoints'}; starting fresh")
    # Where the arguments live on every process: the plan's layouts for a single-mesh plan;
    # for a pipeline, the state replicated and the batch split by rows over the devices.
    state_sharding, batch_sharding = dist.input_shardings(chosen.step, state_abs, batch_abs)
    if start is None:
        start = 0
        state = jax.jit(init, out_shardings=state_sharding)()
    else:
        # Into the layout a fresh start creates (for a single-mesh plan the one
        # `ckpts.restore_into(chosen.step, state_abs, batch_abs)` reads into too).
        state = ckpts.restore(jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            state_abs, state_sharding))
        say(f"resumed from the checkpoint of step {start}")
    metrics = Metrics(args.out, start) if lead else None

    eval_loss = jax.jit(loss_fn)
    val_batches = [batch_at(val, k, args.batch, cfg.seq, args.seed + 1)
                   for k in range(args.eval_batches)]

    def validation(state) -> float:
        params = dist.gather(state["params"])   # every process: a full copy on the host
        with jax.default_device(jax.local_devices()[0]):
            return float(np.mean([eval_loss(params, b) for b in val_batches]))

    tokens = args.batch * cfg.seq
    timed: list[float] = []
    bar = Bar(enabled=lead and not args.quiet)
    bar.start(start, args.steps)
    for i in range(start, args.steps):
        batch = global_batch(batch_at(train, i, args.batch, cfg.seq, args.seed),
                             batch_sharding)
        t0 = time.perf_counter()
        state, out = chosen.step(state, batch)
        loss = float(dist.gather(out["loss"]))   # the last stage's, for pipelines
        step_s = time.perf_counter() - t0
        if i > start:                            # the first call compiles
            timed.append(step_s)
        n = i + 1
        val_loss = validation(state) if n % args.eval_every == 0 or n == args.steps else None
        if n % args.ckpt_every == 0 or n == args.steps:
            ckpts.save(n, state, force=True)
        measured = float(np.median(timed)) if timed else step_s
        if lead:
            metrics.add({"step": n, "train_loss": f"{loss:.5f}",
                         "val_loss": "" if val_loss is None else f"{val_loss:.5f}",
                         "step_s": f"{step_s:.5f}", "tokens_per_s": f"{tokens / step_s:.1f}",
                         "predicted_step_s": f"{predicted_s:.5f}", "method": chosen.method,
                         "devices": len(devices),
                         "wall_s": f"{time.perf_counter() - t_start:.1f}"})
            bar.advance(loss, tokens / measured, measured, predicted_s)
            if val_loss is not None:
                bar.print(f"step {n:>5}  train {loss:.3f}  validation {val_loss:.3f}  "
                          f"(unigram {unigram:.3f})  {tokens / measured:,.0f} tokens/s  "
                          f"step {measured * 1e3:.1f} ms, predicted {predicted_s * 1e3:.1f} ms")
    bar.stop()
    ckpts.wait_until_finished()
    ckpts.close()

    params = dist.gather(state["params"])
    if lead:
        metrics.close()
        title = (f"GPT {args.model} on the stdlib source, {chosen.method} on "
                 f"{len(devices)} devices, batch {args.batch}")
        if plot(metrics.rows, unigram, args.out / "loss.png", title):
            say(f"loss curve: {args.out / 'loss.png'}")
        else:
            say("matplotlib is not installed: no loss.png (pip install matplotlib)")
        if args.sample_chars:
            with jax.default_device(jax.local_devices()[0]):
                text = sample(model, params, cfg.seq, "def ", args.sample_chars,
                              args.temperature, args.seed)
            (args.out / "sample.txt").write_text(text + "\n")
            say("sample:\n" + text)
        write_summary(args, chosen, metrics.rows, unigram, len(devices),
                      float(np.median(timed)) if timed else None, time.perf_counter() - t_start)
        say(f"metrics: {args.out / 'metrics.csv'}, summary: {args.out / 'summary.json'}; "
            f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


class Bar:
    """A rich progress bar (rich comes with Flax) with the loss, tokens/s and the measured
    against the predicted step time; `print` writes a line above it."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.progress = None

    def start(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                 transient=False)
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, completed=done, info="")

    def advance(self, loss: float, tokens_per_s: float, step_s: float,
                predicted_s: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=1, info=(
                f"loss {loss:.3f}  {tokens_per_s:,.0f} tok/s  step {step_s * 1e3:.0f} ms "
                f"(predicted {predicted_s * 1e3:.0f})"))

    def print(self, line: str) -> None:
        if self.progress is not None:
            self.progress.console.print(line, highlight=False, soft_wrap=True)
        else:
            print(line, flush=True)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()


if __name__ == "__main__":
    sys.exit(main())
