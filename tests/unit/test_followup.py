"""Follow-up commands printed for people can be pasted as they are (password masked)."""

from __future__ import annotations

import argparse
import sys

from cli import followup


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"redis_url": "", "data_dir": "./rlc-data", **kw})


def test_default_data_dir_is_not_repeated_and_others_are(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/opt/venv/bin/rl-controller", "run"])
    monkeypatch.delenv("RLC_REDIS_URL", raising=False)
    assert followup.command(_args(), "audit", "--run", "r1") == (
        "/opt/venv/bin/rl-controller audit --run r1"
    )
    assert followup.command(_args(data_dir="/data/my runs"), "runs") == (
        "/opt/venv/bin/rl-controller runs --data-dir '/data/my runs'"
    )


def test_redis_url_is_repeated_with_the_password_masked(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rl-controller"])
    monkeypatch.delenv("RLC_REDIS_URL", raising=False)
    out = followup.command(_args(redis_url="redis://:hunter2@db:6380/1"), "runs")
    assert "hunter2" not in out and "--redis-url 'redis://:***@db:6380/1'" in out
    # from the environment: the same environment makes the command work as printed
    monkeypatch.setenv("RLC_REDIS_URL", "redis://:hunter2@db:6380/1")
    assert "--redis-url" not in followup.command(_args(redis_url="redis://:hunter2@db:6380/1"), "runs")


def test_run_as_a_module_prints_the_module_invocation(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/cli/main.py"])
    assert followup.executable().endswith(" -m cli.main")


def test_a_command_that_resumes_a_run_repeats_where_its_workers_ran():
    assert followup.worker_flags(_args(ray_address="10.0.0.5:6379", local_workers=False)) == [
        "--ray-address", "10.0.0.5:6379"]
    assert followup.worker_flags(_args(ray_address=None, local_workers=True)) == ["--local-workers"]
    assert followup.worker_flags(_args()) == []


def test_data_dir_is_repeated_beside_a_redis_url(monkeypatch):
    """The run directory (spill, checkpoints) is under --data-dir whatever holds the log:
    a resume command printed without it read the default one's (absent) spill and
    evicted every buffered group as "payload lost"."""
    monkeypatch.setattr(sys, "argv", ["rl-controller"])
    monkeypatch.delenv("RLC_REDIS_URL", raising=False)
    out = followup.command(_args(redis_url="redis://db:6380/1", data_dir="/data/x"), "runs")
    assert out == "rl-controller runs --redis-url redis://db:6380/1 --data-dir /data/x"
    monkeypatch.setenv("RLC_REDIS_URL", "redis://db:6380/1")
    out = followup.command(_args(redis_url="redis://db:6380/1", data_dir="/data/x"), "runs")
    assert out == "rl-controller runs --data-dir /data/x"


def test_sentinels_are_repeated(monkeypatch):
    """Seen after a failover stopped a run: the printed resume command had no
    --redis-sentinel/--redis-master and answered "no run 's2' in this store"."""
    monkeypatch.setattr(sys, "argv", ["rl-controller"])
    for name in ("RLC_REDIS_URL", "RLC_REDIS_SENTINEL", "RLC_REDIS_MASTER"):
        monkeypatch.delenv(name, raising=False)
    args = _args(redis_sentinel="127.0.0.1:26379,127.0.0.1:26380", redis_master="rlc",
                 data_dir="/data/x")
    assert followup.command(args, "runs") == (
        "rl-controller runs --redis-sentinel 127.0.0.1:26379,127.0.0.1:26380 "
        "--redis-master rlc --data-dir /data/x")
    monkeypatch.setenv("RLC_REDIS_SENTINEL", "127.0.0.1:26379,127.0.0.1:26380")
    monkeypatch.setenv("RLC_REDIS_MASTER", "rlc")
    assert followup.command(args, "runs") == "rl-controller runs --data-dir /data/x"
