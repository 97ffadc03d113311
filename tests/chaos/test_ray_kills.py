"""Full Ray + TransferQueue mode: kill -9 a trainer actor and a generator actor during a
run (the controller notices, records WorkerLost, restarts and reconciles them), then the
controller itself at a crash point; a resume reloads the payloads TransferQueue lost from
the durable spill and finishes. Real ``rl-controller`` processes (``subprocess``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.chaos.harness import EXIT_CRASH, REPO, Chaos, ForkServer

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

RAY_ARGS = [
    "--no-progress", "--set", "train.groups_per_step=2", "--set", "train.groups_per_microbatch=1",
    "--set", "rollout.samples_per_group=4", "--set", "checkpoint.every_steps=2",
    "--set", "checkpoint.retain_payloads=all", "--set", "task.num_prompts=64",
    "--set", "model.d_model=32", "--set", "sampling.max_new_tokens=6",
    "--set", "ray.num_cpus=6", "--set", "controller.stall_timeout_s=120",
]


def _cli(args: list[str], crash: str, log) -> int:
    env = {**os.environ, "RLC_CRASH_AT": crash, "PYTHONPATH": str(REPO)}
    with open(log, "w") as out:
        return subprocess.run(
            [sys.executable, "-m", "cli.main", *args], cwd=REPO, env=env,
            stdout=out, stderr=subprocess.STDOUT, timeout=400,
        ).returncode


def test_actor_kills_then_controller_crash(module_redis, forkserver: ForkServer, tmp_path) -> None:
    assert module_redis.command("FLUSHALL") == b"+OK"
    chaos = Chaos(forkserver, module_redis.url, tmp_path)
    store = ["--redis-url", module_redis.url, "--data-dir", str(tmp_path / "data")]
    crash = ("after_microbatch_trained:1@trainer,after_rollout_admitted:g000005@generator-0,"
             "after_step_finished:4")
    rc = _cli(["run", "--run-id", "r", "--steps", "6", *store, *RAY_ARGS], crash, tmp_path / "run.txt")
    assert rc == EXIT_CRASH, (tmp_path / "run.txt").read_text()[-4000:]
    rc = _cli(["run", "--run-id", "r", "--steps", "6", "--resume", "--no-progress", *store], "",
              tmp_path / "resume.txt")
    assert rc == 0, (tmp_path / "resume.txt").read_text()[-4000:]
    state = chaos.check("r", 6)["state"]
    assert sorted(w.role for w in state.workers_lost) == ["generator", "trainer"]
    assert all("Actor" in w.reason or "actor" in w.reason for w in state.workers_lost), state.workers_lost
