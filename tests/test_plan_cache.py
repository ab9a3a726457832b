"""The persistent plan cache: a hit returns the plan the search found (without searching);
a changed program, input shape, cluster or method misses; a corrupt, foreign or invalid
entry is ignored with a warning and searched again; `autopar plan` says "plan cache hit".

Offline planning of a small MLP on the `cpu-local` preset keeps each search short.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar import cli, plan_cache, planner
from autopar.plan_cache import PlanCacheWarning

METHOD = autopar.ShardParallel(time_limit_s=5.0)


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def step(params, batch):
    loss, grads = autopar.value_and_grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def relu_loss_fn(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def relu_step(params, batch):
    loss, grads = autopar.value_and_grad(relu_loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def args(batch: int = 16, hidden: int = 32):
    s = jax.ShapeDtypeStruct
    return ({"w1": s((16, hidden), jnp.float32), "w2": s((hidden, 8), jnp.float32)},
            {"x": s((batch, 16), jnp.float32), "y": s((batch, 8), jnp.float32)})


def make(batch: int = 16):
    """`autopar plan tests.test_plan_cache:make` (the CLI's package.module:function)."""
    return step, args(batch)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "plans"
    monkeypatch.setenv(plan_cache.ENV_VAR, str(d))
    return d


def plan_of(fun=step, a=None, cluster="cpu-local", method=METHOD, progress=None):
    return autopar.plan(fun, *(a or args()), cluster=cluster, method=method, progress=progress)


def comparable(plan: autopar.Plan) -> dict:
    data = plan.to_json()
    data["solver"].pop("plan_cache", None)
    return data


def test_hit_returns_an_equal_plan_without_searching(cache_dir, monkeypatch):
    first = plan_of()
    assert first.solver["plan_cache"]["hit"] is False
    assert len(list(cache_dir.glob("*.json"))) == 1

    def no_search(*a, **k):
        raise AssertionError("a cache hit must not search")

    monkeypatch.setattr(planner, "search", no_search)
    messages = []
    second = plan_of(progress=messages.append)
    assert second.solver["plan_cache"]["hit"] is True
    assert any(m.startswith("plan cache hit") for m in messages), messages
    assert comparable(second) == comparable(first)
    assert second.predicted == first.predicted and second.in_specs == first.in_specs
    assert second.value_specs == first.value_specs and second.fingerprint == first.fingerprint


@pytest.mark.parametrize("change", ["program", "shape", "cluster", "method"])
def test_a_changed_program_shape_cluster_or_method_misses(cache_dir, change):
    plan_of()
    changed = {
        "program": dict(fun=relu_step),
        "shape": dict(a=args(batch=32)),
        "cluster": dict(cluster="8xA100-80GB"),
        "method": dict(method=autopar.ShardParallel(time_limit_s=5.0, mesh_shape=(8,))),
    }[change]
    again = plan_of(**changed)
    assert again.solver["plan_cache"]["hit"] is False
    assert len(list(cache_dir.glob("*.json"))) == 2
    assert plan_of(**changed).solver["plan_cache"]["hit"] is True


def _entry(cache_dir):
    (path,) = cache_dir.glob("*.json")
    return path, json.loads(path.read_text())


def _corrupt(path, data):
    path.write_text("{not json")


def _foreign(path, data):
    data["key"] = "0" * 64
    path.write_text(json.dumps(data))


def _invalid(path, data):
    data["plan"]["in_specs"][0] = [["z"], []]  # an axis the mesh does not have
    path.write_text(json.dumps(data))


def _other_fingerprint(path, data):
    data["plan"]["fingerprint"] = "0123456789abcdef"
    path.write_text(json.dumps(data))


def _not_utf8(path, data):
    path.write_bytes(b"\xff\xfe{" + json.dumps(data).encode())


def _deeply_nested(path, data):
    path.write_text("[" * 200_000 + "]" * 200_000)


def _wrong_types(path, data):
    data["plan"]["stages"] = 7
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("damage, reason", [
    (_corrupt, "Expecting property name"), (_foreign, "written for key"),
    (_not_utf8, "UnicodeDecodeError"), (_deeply_nested, "RecursionError"),
    (_wrong_types, "Error"),
    (_invalid, "unknown mesh axis 'z'"), (_other_fingerprint, "fingerprint 0123456789abcdef"),
])
def test_a_bad_entry_is_ignored_with_a_warning(cache_dir, damage, reason):
    first = plan_of()
    path, data = _entry(cache_dir)
    damage(path, data)
    with pytest.warns(PlanCacheWarning, match=f"ignoring plan cache entry .*{reason}"):
        again = plan_of()
    assert again.solver["plan_cache"]["hit"] is False
    assert comparable(again)["in_specs"] == comparable(first)["in_specs"]
    assert plan_of().solver["plan_cache"]["hit"] is True  # the search rewrote the entry


def test_empty_cache_dir_disables_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(plan_cache.ENV_VAR, "")
    monkeypatch.chdir(tmp_path)
    plan = plan_of()
    assert "plan_cache" not in plan.solver
    assert plan_cache.cache_dir() is None and not list(tmp_path.iterdir())


def test_default_dir_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(plan_cache.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert plan_cache.cache_dir() == tmp_path / "autopar" / "plans"


def test_key_covers_method_options_cluster_and_code():
    cluster = autopar.ClusterSpec.preset("cpu-local")
    key = lambda m, c=cluster, fp="f": plan_cache.cache_key(fp, m, c, device_ids=range(8))[0]
    base = key(METHOD)
    assert key(autopar.ShardParallel(time_limit_s=5.0)) == base
    assert key(autopar.ShardParallel(time_limit_s=6.0)) != base
    assert key(autopar.DataParallel(time_limit_s=5.0)) != base
    assert key(METHOD, c=autopar.ClusterSpec.preset("8xA100-80GB")) != base
    assert key(METHOD, fp="g") != base
    fields = plan_cache.cache_key("f", METHOD, cluster, device_ids=range(8))[1]
    assert fields["code"] == plan_cache.code_version() and "+" in fields["code"]


def test_cli_says_plan_cache_hit(cache_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", [*sys.path])
    argv = ["plan", "tests.test_plan_cache:make", "--cluster", "cpu-local", "--method",
            "shard", "--time-limit", "5", "--quiet"]
    assert cli.main(argv) == 0
    assert "plan cache hit" not in capsys.readouterr().out
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "plan cache hit:" in out and "hit, no search" in out
