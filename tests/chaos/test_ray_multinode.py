"""A real two-node Ray cluster on one machine: trainer on one node, generators on the other.

``ray start --head`` (resource ``rlc_train``) and a second ``ray start --address``
process (resource ``rlc_rollout``), both on loopback with ports and temp dir of their
own and token auth on. ``rl-controller run --ray-address`` places the trainer and the
generators by ``train.node_resource`` / ``rollout.node_resource``; TransferQueue's
storage units are spread over the nodes round-robin. The run learns for a few steps and
``audit`` exits 0.

Then, in a second run, the generator node's raylet is killed with SIGKILL mid-run: Ray
fails the node and every process on it. The controller records ``WorkerLost`` and, with
the default ``rollout.on_node_loss = "wait"``, its replacement generator waits (pending
in Ray) until a node offering ``rlc_rollout`` joins; the test starts one, and the run
finishes with every invariant holding. That run keeps TransferQueue's storage units on
the trainer's node (``dataplane.storage_node_resource``): a SimpleStorage unit holds
the only copy of its payloads, and with a unit lost to the node the run hung (the
TransferQueue client does not fail over), so a node one expects to lose must hold none.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.chaos.harness import REPO
from tests.ray_cluster import RayCluster
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
    return [sys.executable, "-m", "cli.main", *argv]


_PLACEMENT = """
import json, ray
from ray._private import state
ray.init(address=ADDRESS, logging_level="ERROR", log_to_driver=False)
labels = {n["NodeID"]: sorted(k for k in n["Resources"] if k.startswith("rlc_")) for n in ray.nodes()}
print(json.dumps([[a["ActorClassName"], labels.get(a["Address"]["NodeID"], [])]
                  for a in state.actors().values()]))
"""


def _placement(cluster: RayCluster) -> dict[str, set[str]]:
    """Actor class -> the node labels (``rlc_*`` resources) its actors ran on, from the
    GCS's actor table, which keeps dead actors: read after the run ended, it does not
    depend on catching the actors alive (a short run may be shutting them down already
    when its first step is visible)."""
    out = subprocess.run([sys.executable, "-c", _PLACEMENT.replace("ADDRESS", repr(cluster.address))],
                         cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    placed: dict[str, set[str]] = {}
    for cls, labels in json.loads(out.stdout.strip().splitlines()[-1]):
        placed.setdefault(cls, set()).update(labels)
    return placed


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = RayCluster(tmp_path_factory.mktemp("ray"))
    try:
        c.add_node("head", "rlc_train", num_cpus=4, head=True)
        c.wait_for_resources({"rlc_train": 1})  # a node can only join a head that is up
        c.add_node("rollout", "rlc_rollout", num_cpus=3)
        c.wait_for_resources({"rlc_train": 1, "rlc_rollout": 1})
        yield c
    finally:
        c.stop()


def _start(cluster: RayCluster, redis_server: RedisServer, tmp_path: Path, run_id: str,
           steps: int, *extra: str) -> tuple[subprocess.Popen, Path, list[str]]:
    store = ["--redis-url", redis_server.url, "--data-dir", str(tmp_path / "data")]
    log = tmp_path / f"{run_id}.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(
            _cli(cluster, "run", "--run-id", run_id, "--steps", str(steps), "--ray-address",
                 cluster.address, *store, *ARGS, *extra),
            cwd=REPO, env=cluster.env, stdout=out, stderr=subprocess.STDOUT,
        )
    return proc, log, store


def _wait_steps(proc: subprocess.Popen, log: Path, metrics: Path, n: int) -> None:
    deadline = time.monotonic() + 400
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)


def _audit(cluster: RayCluster, run_id: str, store: list[str]) -> None:
    audit = subprocess.run(_cli(cluster, "audit", "--run", run_id, *store), cwd=REPO,
                           env=cluster.env, capture_output=True, text=True, timeout=300)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-2000:]


def test_trainer_and_generators_on_their_nodes(cluster: RayCluster, redis_server: RedisServer,
                                               tmp_path: Path) -> None:
    proc, log, store = _start(cluster, redis_server, tmp_path, "placed", 4)
    try:
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    placed = _placement(cluster)
    assert placed.get("TrainerWorker") == {"rlc_train"}, placed
    assert placed.get("GeneratorWorker") == {"rlc_rollout"}, placed
    # TransferQueue's storage units: spread over both nodes.
    assert placed.get("SimpleStorageUnit") == {"rlc_train", "rlc_rollout"}, placed
    _audit(cluster, "placed", store)
    state = _fold(redis_server.url, "placed")
    assert state.trainer_version == 4 and not state.workers_lost


def test_generator_node_lost_mid_run(cluster: RayCluster, redis_server: RedisServer,
                                     tmp_path: Path) -> None:
    proc, log, store = _start(cluster, redis_server, tmp_path, "lost", 10,
                              "--set", 'dataplane.storage_node_resource="rlc_train"')
    rollout = cluster.nodes[1]
    try:
        _wait_steps(proc, log, tmp_path / "data" / "runs" / "lost" / "metrics.jsonl", 2)
        os.kill(rollout.raylet_pid(), signal.SIGKILL)
        deadline = time.monotonic() + 300
        while "generator" not in _lost_roles(redis_server.url, "lost"):
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        rollout.stop()  # what is left of the node's processes
        # rollout.on_node_loss = "wait": the replacement pends until such a node joins.
        cluster.add_node("rollout-2", "rlc_rollout", num_cpus=3)
        deadline = time.monotonic() + 400
        while proc.poll() is None:
            cluster.restart_failed_nodes()
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1)
        assert proc.returncode == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    _audit(cluster, "lost", store)
    state = _fold(redis_server.url, "lost")
    assert state.trainer_version == 10
    assert [w.role for w in state.workers_lost] == ["generator"]


def _fold(url: str, run_id: str):
    from events.redis_store import RedisEventStore
    from controller.projector import Projector

    store = RedisEventStore(url)
    try:
        result = Projector(store).get(run_id)
    finally:
        store.close()
    assert result.problem is None, result.problem
    return result.state


def _lost_roles(url: str, run_id: str) -> list[str]:
    from events.redis_store import RedisEventStore

    store = RedisEventStore(url)
    try:
        return [json.loads(e.data).get("role", "") for e in store.read_raw(run_id)
                if e.event_type == "WorkerLost"]
    finally:
        store.close()
