"""A real two-node Ray cluster on one machine: trainer on one node, generators on the other.

``ray start --head`` (resource ``rlc_train``) and a second ``ray start --address``
process (resource ``rlc_rollout``), both on loopback with ports and temp dir of their
own and token auth on. ``rl-controller run --ray-address`` places the trainer and the
generators by ``train.node_resource`` / ``rollout.node_resource``; TransferQueue's
storage units are spread over the nodes round-robin. The run learns for a few steps and
``audit`` exits 0.

Then the generator node's raylet is killed with SIGKILL mid-run: Ray fails the node
and every process on it. The controller records ``WorkerLost`` and, with the default
``rollout.on_node_loss = "wait"``, its replacement generator waits (pending in Ray)
until a node offering ``rlc_rollout`` joins; the test starts one, and the run finishes
with every invariant holding.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.chaos.harness import REPO
from tests.ray_cluster import RayCluster, RayNode
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.multinode,
              pytest.mark.timeout(900)]

ARGS = [
    "--no-progress", "--set", "train.groups_per_step=2", "--set", "train.groups_per_microbatch=1",
    "--set", "rollout.samples_per_group=4", "--set", "checkpoint.every_steps=2",
    "--set", "checkpoint.retain_payloads=all", "--set", "task.num_prompts=64",
    "--set", "model.d_model=32", "--set", "sampling.max_new_tokens=6",
    "--set", "controller.stall_timeout_s=300",
    "--set", 'train.node_resource="rlc_train"', "--set", 'rollout.node_resource="rlc_rollout"',
]


def _cli(cluster: RayCluster, *argv: str) -> list[str]:
    return [sys.executable, "-m", "controller.cli", *argv]


def _actors_on(node: RayNode) -> list[str]:
    """Process titles of Ray actors in the node's process group (ray::<Class>...)."""
    assert node.process is not None
    out = subprocess.run(["ps", "-o", "args=", "-g", str(node.process.pid)],
                         capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("ray::")]


@pytest.fixture
def cluster(tmp_path: Path):
    c = RayCluster(tmp_path / "ray")
    try:
        c.add_node("head", "rlc_train", num_cpus=4, head=True)
        c.wait_for_resources({"rlc_train": 1})
        c.add_node("rollout", "rlc_rollout", num_cpus=3)
        c.wait_for_resources({"rlc_train": 1, "rlc_rollout": 1})
        yield c
    finally:
        c.stop()


def test_two_nodes_then_generator_node_lost(cluster: RayCluster, redis_server: RedisServer,
                                           tmp_path: Path) -> None:
    store = ["--redis-url", redis_server.url, "--data-dir", str(tmp_path / "data")]
    log = tmp_path / "run.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(
            _cli(cluster, "run", "--run-id", "mn", "--steps", "12", "--ray-address",
                 cluster.address, *store, *ARGS),
            cwd=REPO, env=cluster.env, stdout=out, stderr=subprocess.STDOUT,
        )
    head, rollout = cluster.nodes
    metrics = tmp_path / "data" / "runs" / "mn" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 400
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        on_head, on_rollout = _actors_on(head), _actors_on(rollout)
        assert any(t.startswith("ray::TrainerWorker") for t in on_head), on_head
        assert not any(t.startswith("ray::GeneratorWorker") for t in on_head), on_head
        assert any(t.startswith("ray::GeneratorWorker") for t in on_rollout), on_rollout
        assert not any(t.startswith("ray::TrainerWorker") for t in on_rollout), on_rollout
        storage = [t for t in on_head + on_rollout if "SimpleStorageUnit" in t]
        print("placement", on_head, on_rollout, storage)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
