"""``store.replicas``: an append returns only once N replicas hold it; a timeout is an error.

Real redis-server processes on loopback: a primary and a replica (``replicaof``).
The replica is frozen with SIGSTOP so that it cannot acknowledge a write, which is how a
lagging or partitioned replica looks to the primary's ``WAIT``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from events.errors import ReplicasMissingError, ReplicationTimeoutError
from events.redis_store import RedisEventStore, events_key
from events.store_config import StoreConfig
from events.schema import GroupFailed
from tests.sentinel_cluster import SentinelCluster

pytestmark = pytest.mark.integration

RUN = "replicated"


def failed(n: int, epoch: int) -> GroupFailed:
    return GroupFailed(event_id=f"group:g{n}:failed:a0", epoch=epoch, ts=float(n),
                       group_id=f"g{n}", attempt=0, reason="replication test")


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[SentinelCluster]:
    """Primary and replica only (no sentinels)."""
    cluster = SentinelCluster(tmp_path, n_sentinels=0)
    cluster.primary.start()
    cluster.replica.start()
    cluster.wait_replica_in_sync(cluster.replica)
    try:
        yield cluster
    finally:
        cluster.stop()


def replica_len(cluster: SentinelCluster) -> int:
    return int(cluster.client(cluster.replica).xlen(events_key(RUN)))


def test_an_acknowledged_append_is_already_on_the_replica(pair: SentinelCluster) -> None:
    store = RedisEventStore(pair.primary.url, replication=StoreConfig(replicas=1))
    epoch = store.claim_epoch(RUN)
    # WAIT covered the claim: the replica has the epoch before any append.
    assert int(pair.client(pair.replica).hget(f"rlc:{{{RUN}}}:meta", "epoch")) == epoch
    for n in range(1, 51):
        (pos,) = store.append(RUN, [failed(n, epoch)], expected_position=n - 1, epoch=epoch)
        # No sleep, no polling: the append's return is the proof.
        assert replica_len(pair) >= pos
    store.close()


def test_a_wait_timeout_is_an_error_and_the_retry_resolves_it(pair: SentinelCluster) -> None:
    cfg = StoreConfig(replicas=1, wait_timeout_s=0.3)
    store = RedisEventStore(pair.primary.url, replication=cfg)
    epoch = store.claim_epoch(RUN)
    store.append(RUN, [failed(1, epoch)], expected_position=0, epoch=epoch)
    pair.pause(pair.replica)
    try:
        with pytest.raises(ReplicationTimeoutError, match="in doubt"):
            store.append(RUN, [failed(2, epoch)], expected_position=1, epoch=epoch)
        # The primary holds it, unconfirmed: in doubt, not lost and not acknowledged.
        assert store.last_position(RUN) == 2
        # Still frozen, retried on a fresh connection that wrote nothing: WAIT there
        # would count the frozen replica at once, so the replay must write a barrier
        # and wait for it, and fail like the first attempt.
        fresh = RedisEventStore(pair.primary.url, replication=cfg)
        with pytest.raises(ReplicationTimeoutError):
            fresh.append(RUN, [failed(2, epoch)], expected_position=1, epoch=epoch)
        fresh.close()
    finally:
        pair.resume(pair.replica)
    retry = RedisEventStore(pair.primary.url, replication=cfg)
    assert retry.append(RUN, [failed(2, epoch)], expected_position=1, epoch=epoch) == [2]
    assert replica_len(pair) == 2
    assert [s.event.event_id for s in retry.read(RUN)] == [failed(n, epoch).event_id for n in (1, 2)]
    store.close()
    retry.close()


def test_more_replicas_than_exist_never_succeeds_silently(pair: SentinelCluster) -> None:
    store = RedisEventStore(pair.primary.url, replication=StoreConfig(replicas=2, wait_timeout_s=0.2))
    with pytest.raises(ReplicationTimeoutError, match="of 2 replicas confirmed"):
        store.claim_epoch(RUN)
    store.close()


def test_the_store_refuses_more_replicas_than_the_server_has_before_writing(
    pair: SentinelCluster,
) -> None:
    store = RedisEventStore(pair.primary.url, replication=StoreConfig(replicas=1))
    store.require_replicas(1)  # the pair's one replica is connected
    with pytest.raises(ReplicasMissingError) as refused:
        store.require_replicas(2)
    assert str(refused.value).startswith("store.replicas = 2 ")
    assert f"127.0.0.1:{pair.primary.port}/0 has 1 connected replica;" in str(refused.value)
    assert pair.client(pair.primary).keys("*") == []  # asked, nothing written
    store.close()


def test_a_replica_that_drops_away_fails_the_append_naming_the_cause(
    pair: SentinelCluster,
) -> None:
    """Mid-run the only replica goes away: the append that waited past its timeout
    fails (in doubt, as any unconfirmed append) and its line says why -- the server has
    no replica left to confirm it -- where a lagging replica's line says it lags."""
    store = RedisEventStore(pair.primary.url,
                            replication=StoreConfig(replicas=1, wait_timeout_s=0.3))
    epoch = store.claim_epoch(RUN)
    store.append(RUN, [failed(1, epoch)], expected_position=0, epoch=epoch)
    pair.pause(pair.replica)
    try:
        with pytest.raises(ReplicationTimeoutError, match=r"only 0 of 1 replicas confirmed"
                           r".* has 1 connected replica, which did not confirm in time"):
            store.append(RUN, [failed(2, epoch)], expected_position=1, epoch=epoch)
    finally:
        pair.resume(pair.replica)
    pair.replica.stop()
    primary = pair.client(pair.primary)
    pair.wait(lambda: int(primary.info("replication")["connected_slaves"]) == 0, 30,
              "the primary to see its replica gone")
    with pytest.raises(ReplicationTimeoutError) as failed_append:
        store.append(RUN, [failed(3, epoch)], expected_position=2, epoch=epoch)
    said = str(failed_append.value)
    assert "only 0 of 1 replicas confirmed the append within 0.3s" in said
    assert "has 0 connected replicas (store.replicas = 1 wants 1)" in said
    assert "in doubt" in said and "\n" not in said
    store.close()


def test_replicas_zero_does_not_wait(pair: SentinelCluster) -> None:
    store = RedisEventStore(pair.primary.url)
    epoch = store.claim_epoch(RUN)
    pair.pause(pair.replica)
    try:  # a frozen replica does not slow the primary down: nothing waits for it
        assert store.append(RUN, [failed(1, epoch)], expected_position=0, epoch=epoch) == [1]
    finally:
        pair.resume(pair.replica)
    store.close()


def test_bad_replication_settings_are_named() -> None:
    with pytest.raises(ValueError, match="store.replicas must be >= 0"):
        StoreConfig(replicas=-1)
    with pytest.raises(ValueError, match="store.wait_timeout_s must be > 0"):
        StoreConfig(wait_timeout_s=0)

