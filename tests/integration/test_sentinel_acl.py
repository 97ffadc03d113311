"""ACL users behind Redis Sentinel: the controller and reader roles of
``events/redis_store/acl.py`` on every data node, the store opened through the sentinels
with a username, and a failover in between.

ACLs are not replicated, so the users are created on each node, as docs/security.md
says. The sentinels themselves keep their own password (the default user).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from events.errors import StorePermissionError
from events.redis_store.acl import acl_rules
from events.redis_store.layout import events_key
from events.schema import GroupFailed
from events.redis_store.sentinel import open_sentinel_store
from tests.sentinel_cluster import MASTER, SentinelCluster, find_redis_sentinel

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(find_redis_sentinel() is None, reason="redis-sentinel not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
RUN = "sentinel-acl"


def _event(n: int, epoch: int) -> GroupFailed:
    return GroupFailed(event_id=f"group:g{n}:failed:a0", epoch=epoch, ts=0.0,
                       group_id=f"g{n}", attempt=0, reason="test")


@pytest.fixture
def cluster(tmp_path: Path):
    c = SentinelCluster(tmp_path / "redis", n_replicas=1, relay=False).start()
    try:
        for node in c.nodes:  # ACLs are per node: a promoted replica needs them too
            client = c.client(node)
            for user, role in (("rlc-controller", "controller"), ("rlc-reader", "reader")):
                assert client.execute_command(
                    "ACL", "SETUSER", user, "on", f">{user}-pw", *acl_rules(role)) in (b"OK", "OK", True)
            client.close()
        yield c
    finally:
        c.stop()


def _names_healthy_master(c: SentinelCluster, sentinel_port: int) -> bool:
    state = c.sentinel_state(sentinel_port)
    if state is None:
        return False
    return (int(state["port"]) == c.replica.port and state.get("is_master")
            and not state.get("is_sdown") and not state.get("is_odown"))


def _store(c: SentinelCluster, user: str):
    return open_sentinel_store(c.sentinel_spec, MASTER, username=user, password=f"{user}-pw",
                               sentinel_password=c.sentinel_password, failover_window_s=60.0)


def test_controller_user_writes_across_a_failover_and_reader_only_reads(cluster) -> None:
    store = _store(cluster, "rlc-controller")
    epoch = store.claim_epoch(RUN)
    store.append(RUN, [_event(0, epoch)], expected_position=0, epoch=epoch)
    # One replica must hold the entry before the primary dies, or the failover loses it.
    replica = cluster.client(cluster.replica)
    cluster.wait(lambda: replica.xlen(events_key(RUN)) == 1, 30,
                 "the replica did not receive the first entry")
    replica.close()
    cluster.primary.kill()
    # The controller user is followed to the promoted replica, where it exists too.
    store.append(RUN, [_event(1, epoch)], expected_position=1, epoch=epoch)
    assert cluster.node_named_master() is cluster.replica
    assert [e.event.group_id for e in store.read(RUN)] == ["g0", "g1"]
    store.close()

    reader = _store(cluster, "rlc-reader")
    assert reader.last_position(RUN) == 2
    with pytest.raises(StorePermissionError, match="rlc-reader|refused"):
        reader.append(RUN, [_event(2, epoch)], expected_position=2, epoch=epoch)
    assert reader.last_position(RUN) == 2  # nothing was written
    reader.close()

    # The CLI takes the username from the environment: a read-only command works. It
    # asks the sentinels once, without the store's retry window, so first let every
    # sentinel settle on the promoted node (redis-py skips a master flagged down).
    cluster.wait(lambda: all(_names_healthy_master(cluster, s.port) for s in cluster.sentinels),
                 60, "the sentinels did not settle on the promoted replica")
    env = {**os.environ, "RLC_REDIS_USERNAME": "rlc-reader", "RLC_REDIS_PASSWORD": "rlc-reader-pw",
           "RLC_SENTINEL_PASSWORD": cluster.sentinel_password}
    proc = subprocess.run([sys.executable, "-m", "cli.main", "runs",
                           "--redis-sentinel", cluster.sentinel_spec, "--redis-master", MASTER],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert RUN in proc.stdout
