"""Checkpoints: the plan's layouts as data (`input_shardings`, `output_shardings`,
`autopar.place`), Orbax save/restore into the same or another plan, atomic saves, errors
that name the leaf.

The model is the tests' GPT with AdamW (eps 1e-4, see tests/models.py): its state has float
and int32 leaves in optimizer namedtuples.  Tolerances: a run interrupted by a checkpoint is
compared with the uninterrupted jitted run at the equivalence tests' AdamW tolerances
(rtol 1e-3 / atol 1e-4); a restore itself is bit-exact.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import autopar
from autopar.checkpoint import CheckpointMismatchError, restore_target

from helpers import cheap_comm_cluster, run_steps
from models import make_case

TOL = dict(rtol=1e-3, atol=1e-4)
FAST = dict(time_limit_s=5.0)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

METHODS = {   # name -> method on n devices
    "shard": lambda n: autopar.ShardParallel(mesh_shape=(2, n // 2), **FAST),
    "zero3": lambda n: autopar.Zero3Parallel(min_split_elements=0, **FAST),
    "pipeshard": lambda n: autopar.PipeshardParallel(num_micro_batches=2, num_stages=2, **FAST),
}


@functools.cache
def _case():
    return make_case("gpt", "adamw")


@functools.cache
def _step(method: str, num_devices: int = 8):
    """One parallelized step per configuration for the whole module (plans are searched
    once)."""
    return autopar.parallelize(_case().step, method=METHODS[method](num_devices),
                               cluster=cheap_comm_cluster(),
                               devices=jax.devices()[:num_devices])


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _leaves(tree) -> list[tuple[str, object]]:
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _assert_equivalent(actual, expected, what: str) -> None:
    """Every leaf of `actual` (arrays) laid out as `expected` (shardings) says."""
    for (path, x), s in zip(_leaves(actual), jax.tree.leaves(expected), strict=True):
        assert x.sharding.is_equivalent_to(s, x.ndim), f"{what} {path}: {x.sharding} != {s}"


@pytest.mark.parametrize("method", list(METHODS))
def test_place_lays_out_arguments_as_the_step_expects(method):
    case = _case()
    step = _step(method)
    state, batch = case.init()
    expected = step.input_shardings(state, batch)
    # Abstract arguments (a restart: no live state) give the same layouts.
    assert step.input_shardings(*_abstract((state, batch))) == expected
    placed = autopar.place(step, state, batch)
    for (path, x), (_, y), s in zip(_leaves(placed), _leaves((state, batch)),
                                    jax.tree.leaves(expected), strict=True):
        assert x.sharding == s, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=path)
    new_state, metrics = step(*placed)
    # output_shardings() says what the step returns ...
    _assert_equivalent((new_state, metrics), step.output_shardings(state, batch), "output")
    # ... and the parameters come back where the next call expects them.
    _assert_equivalent(new_state["params"], expected[0]["params"], "new params")


@pytest.mark.parametrize("method", ["shard", "zero3", "pipeshard"])
def test_state_keeps_its_layout_across_steps(method):
    case = _case()
    step = _step(method)
    state, batch = case.init()
    new_state, _ = step(*autopar.place(step, state, batch))
    _assert_equivalent(new_state, step.input_shardings(state, batch)[0], "new state")


@pytest.mark.parametrize("method", list(METHODS))
def test_round_trip_is_bit_exact_in_the_steps_layouts(method, tmp_path):
    case = _case()
    step = _step(method)
    state, batch = case.init()
    state, _ = step(*autopar.place(step, state, batch))   # leaves on the step's meshes
    with autopar.Checkpoints(tmp_path) as ckpts:
        assert ckpts.save(1, state)
        ckpts.wait_until_finished()
        restored = ckpts.restore_into(step, *_abstract((state, batch)))
    expected = step.input_shardings(state, batch)[0]
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for (path, x), (_, y), s in zip(_leaves(restored), _leaves(state), jax.tree.leaves(expected),
                                    strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert x.sharding == s, (path, x.sharding, s)
        a, b = np.asarray(x), np.asarray(y)
        assert a.tobytes() == b.tobytes(), path


@pytest.mark.parametrize("before,after", [(("pipeshard", 8), ("shard", 8)),
                                          (("shard", 8), ("shard", 4))],
                         ids=["2-stages-to-2x4", "8-to-4-devices"])
def test_resume_in_another_plan_equals_uninterrupted_run(before, after, tmp_path):
    case = _case()
    state, _ = case.init()
    batches = [case.batch_for_step(i) for i in range(6)]
    ref_state, ref_losses = run_steps(jax.jit(case.step), state, batches)

    first = _step(*before)
    mid, losses = run_steps(first, autopar.place(first, state, batches[0])[0], batches[:3])
    with autopar.Checkpoints(tmp_path) as ckpts:
        ckpts.save(3, mid)
    del mid
    second = _step(*after)
    abstract = _abstract((state, batches[3]))
    with autopar.Checkpoints(tmp_path) as ckpts:
        assert ckpts.latest_step() == 3
        resumed = ckpts.restore_into(second, *abstract)
    _assert_equivalent(resumed, second.input_shardings(*abstract)[0], "restored")
    used = {d for x in jax.tree.leaves(resumed) for d in x.sharding.device_set}
    assert used == set(jax.devices()[:after[1]])
    final, more = run_steps(second, resumed, batches[3:])

    np.testing.assert_allclose(losses + more, ref_losses, **TOL)
    for (path, p), (_, r) in zip(_leaves(final), _leaves(ref_state), strict=True):
        np.testing.assert_allclose(np.asarray(p), np.asarray(r), err_msg=path, **TOL)


def test_mismatched_target_names_the_first_differing_leaf(tmp_path):
    case = _case()
    step = _step("shard")
    state, batch = case.init()
    with autopar.Checkpoints(tmp_path, async_save=False) as ckpts:
        ckpts.save(7, state)
        target = restore_target(step, state, batch)
        where = re.escape(f"checkpoint step 7 in {ckpts.directory}")

        def replace(tree, key, value):
            return {**tree, "params": {**tree["params"], key: value}}

        pos = target["params"]["pos"]
        short = jax.ShapeDtypeStruct((8, 32), pos.dtype, sharding=pos.sharding)
        wrong = [
            (replace(target, "pos", short),
             r"restore target leaf \['params'\]\['pos'\] is float32\[8, 32\], but " + where
             + r" holds float32\[16, 32\]"),
            (replace(target, "pos", jax.ShapeDtypeStruct(pos.shape, "bfloat16",
                                                         sharding=pos.sharding)),
             r"leaf \['params'\]\['pos'\] is bfloat16\[16, 32\], but .* holds float32\[16, 32\]"),
            (replace(target, "extra", pos),
             r"restore target leaf \['params'\]\['extra'\] float32\[16, 32\] is not in " + where),
            ({k: v for k, v in target.items() if k != "opt_state"},
             where + r" holds leaf \['opt_state'\]\[1\]\[0\]\['count'\] int32\[\], which "
             r"the restore target does not have"),
        ]
        for bad, message in wrong:
            with pytest.raises(CheckpointMismatchError, match=message):
                ckpts.restore(bad)
        with pytest.raises(FileNotFoundError, match=r"no checkpoint step 8 .* holds steps \[7\]"):
            ckpts.restore(target, step=8)
        with pytest.raises(ValueError, match=r"leaf \['params'\]\['pos'\] \(ndarray\) has no "
                                             r"sharding"):
            ckpts.restore(replace(target, "pos", np.zeros(pos.shape, pos.dtype)))
        ckpts.restore(target)   # the right target restores


def test_keeps_the_last_k_and_saves_on_the_interval(tmp_path):
    state = {"w": jax.numpy.arange(4.0)}
    with autopar.Checkpoints(tmp_path, max_to_keep=2, save_interval_steps=2) as ckpts:
        assert [ckpts.save(i, state) for i in range(7)] == [True, False] * 3 + [True]
        ckpts.wait_until_finished()
        assert ckpts.all_steps() == [4, 6] and ckpts.latest_step() == 6


_KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, time
    import jax
    import autopar

    directory, when = sys.argv[1], sys.argv[2]
    def state(seed):   # 128 MiB of random float32: takes a while to write
        keys = jax.random.split(jax.random.PRNGKey(seed), 32)
        return {f"w{i}": jax.random.normal(k, (1024, 1024)) for i, k in enumerate(keys)}
    ckpts = autopar.Checkpoints(directory)
    ckpts.save(1, state(1))
    ckpts.wait_until_finished()
    second = jax.block_until_ready(state(2))
    ckpts.save(2, second)   # async: returns while the arrays are written
    tmp = [os.path.join(directory, d) for d in os.listdir(directory) if d.startswith("2.")]
    deadline = time.monotonic() + 60
    while when == "data-written" and time.monotonic() < deadline:
        # Kill once array data has landed in the temporary directory.
        if any(root.endswith(os.sep + "d") and files for t in tmp for root, _, files in os.walk(t)):
            break
    if os.path.exists(os.path.join(directory, "2")) or not tmp:
        sys.exit(3)   # the save was not in progress: the test would prove nothing
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("when", ["save-returned", "data-written"])
def test_killed_save_leaves_the_previous_checkpoint(when, tmp_path):
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(tmp_path), when],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not (tmp_path / "2").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("2.")], list(tmp_path.iterdir())

    keys = jax.random.split(jax.random.PRNGKey(1), 32)
    first = {f"w{i}": jax.random.normal(k, (1024, 1024)) for i, k in enumerate(keys)}
    with autopar.Checkpoints(tmp_path) as ckpts:
        assert ckpts.all_steps() == [1] and ckpts.latest_step() == 1
        restored = ckpts.restore(first)
        for key in first:
            assert np.asarray(restored[key]).tobytes() == np.asarray(first[key]).tobytes()
        assert ckpts.save(2, restored)   # the interrupted step saves again
        ckpts.wait_until_finished()
        assert ckpts.all_steps() == [1, 2]
    assert not [p.name for p in tmp_path.iterdir() if "tmp" in p.name]


_PROCESS = textwrap.dedent("""
    import dataclasses, os, sys
    process_id, port, workdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    import numpy as np
    import autopar
    sys.path.insert(0, "tests")
    from models import make_case

    # The plan searched by the test, on this job's devices (process i holds ids i*2048+...).
    plan = autopar.Plan.load(os.path.join(workdir, "plan.json"))
    plan = dataclasses.replace(plan, device_ids=tuple(d.id for d in jax.devices()))
    case = make_case("gpt", "adamw")
    step = autopar.parallelize(case.step, plan=plan, cluster=os.path.join(workdir, "cluster.json"))
    state, _ = step(*autopar.place(step, *jax.tree.map(np.asarray, case.init())))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), case.init())
    with autopar.Checkpoints(os.path.join(workdir, "ckpt")) as ckpts:
        ckpts.save(1, state)
        ckpts.wait_until_finished()
        restored = ckpts.restore_into(step, *abstract)
    expected = step.input_shardings(*abstract)[0]
    for x, y, s in zip(jax.tree.leaves(restored), jax.tree.leaves(state),
                       jax.tree.leaves(expected), strict=True):
        assert x.sharding == s and not x.is_fully_addressable
        for a, b in zip(x.addressable_shards, y.addressable_shards, strict=True):
            assert a.index == b.index
            assert np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes()
    print("restored", len(jax.tree.leaves(restored)), "leaves", flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_save_and_restore_their_shards(tmp_path):
    """Two processes (4 CPU devices each, gloo) run one step on a 2x4 mesh spanning both,
    save, and each restores its own shards bit-exact; this process then restores the
    two-process checkpoint on its 8 local devices: equal to its own run of the step."""
    case = _case()
    step = _step("shard")
    state, batch = case.init()
    step.get_plan(state, batch).save(tmp_path / "plan.json")
    cheap_comm_cluster().save(tmp_path / "cluster.json")
    port = _free_port()
    logs = [open(tmp_path / f"process{i}.log", "w") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, str(i), str(port), str(tmp_path)],
                              cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
             for i, log in enumerate(logs)]
    try:
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for log in logs:
            log.close()
    outputs = [(tmp_path / f"process{i}.log").read_text() for i in range(2)]
    for code, out in zip(codes, outputs):
        assert code == 0 and "restored 109 leaves" in out, out[-3000:]

    ref, _ = step(*autopar.place(step, state, batch))
    with autopar.Checkpoints(tmp_path / "ckpt") as ckpts:
        assert ckpts.all_steps() == [1]
        restored = ckpts.restore_into(step, *_abstract((state, batch)))
    for (path, x), (_, r) in zip(_leaves(restored), _leaves(ref), strict=True):
        assert x.is_fully_addressable
        np.testing.assert_allclose(np.asarray(x), np.asarray(r), err_msg=path, rtol=1e-5,
                                   atol=1e-6)
