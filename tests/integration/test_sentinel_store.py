"""The store through Sentinel while the sentinels name no healthy primary.

Right after a failover, or while a loaded machine makes the primary miss Sentinel's
``down-after-milliseconds``, every sentinel can flag the primary down for a moment and
redis-py's master discovery then finds none. A store command that needs a new
connection in that moment must wait for a primary (``store.failover_window_s``) rather
than fail: CI once failed a read that way, one command after a failover.

Here the one node (no replica, so the sentinels cannot fail over) is paused until all
three sentinels flag it down; the store's connections are dropped, so the next command
must ask the sentinels; the node is resumed a moment later. The read must return what
was written. ``FailoverRetry``'s own rules are checked without a cluster too.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis
from redis.exceptions import AuthenticationError
from redis.sentinel import MasterNotFoundError

from events.embedded import free_port
from events.errors import StoreUnavailableError
from events.redis_store.connection import unavailable
from events.redis_store.sentinel import FailoverRetry, open_sentinel_store
from events.schema import GroupFailed
from tests.sentinel_cluster import MASTER, SentinelCluster, find_redis_sentinel

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(find_redis_sentinel() is None, reason="redis-sentinel not installed"),
]

RUN = "sentinel-down"


def _flagged_down(c: SentinelCluster, sentinel_port: int) -> bool:
    state = c.sentinel_state(sentinel_port)
    return state is not None and bool(state.get("is_sdown") or state.get("is_odown"))


def test_a_read_waits_while_every_sentinel_flags_the_primary_down(tmp_path: Path) -> None:
    c = SentinelCluster(tmp_path / "redis", n_replicas=0, relay=False).start()
    try:
        store = open_sentinel_store(c.sentinel_spec, MASTER, password=c.password,
                                    sentinel_password=c.sentinel_password, failover_window_s=60.0)
        epoch = store.claim_epoch(RUN)
        store.append(RUN, [GroupFailed(event_id="group:g0:failed:a0", epoch=epoch, ts=0.0,
                                       group_id="g0", attempt=0, reason="test")],
                     expected_position=0, epoch=epoch)
        c.pause(c.primary)
        resumed = threading.Timer(1.0, c.resume, args=(c.primary,))
        try:
            c.wait(lambda: all(_flagged_down(c, s.port) for s in c.sentinels), 60,
                   "the sentinels did not flag the paused primary down")
            # no healthy primary now: discovery fails until the node is back
            with pytest.raises(MasterNotFoundError):
                redis.sentinel.Sentinel(
                    [("127.0.0.1", s.port) for s in c.sentinels],
                    sentinel_kwargs={"password": c.sentinel_password, "socket_timeout": 2},
                ).discover_master(MASTER)
            store.client.connection_pool.disconnect()  # the next command must ask them
            resumed.start()
            assert store.last_position(RUN) == 1
        finally:
            resumed.cancel()
            c.resume(c.primary)
        store.close()
    finally:
        c.stop()


def test_sentinels_that_do_not_answer_or_know_the_name_fail_at_once(tmp_path: Path) -> None:
    # Neither is a failover, so neither waits out the window (an hour here: without the
    # check each took two windows, then printed a repr of every sentinel's client).
    nowhere = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    with pytest.raises(StoreUnavailableError, match="no sentinel answers") as err:
        open_sentinel_store(nowhere, MASTER, failover_window_s=3600.0)
    assert nowhere.split(",")[1] in str(err.value) and "<redis" not in str(err.value)
    c = SentinelCluster(tmp_path / "redis", n_replicas=0, relay=False).start()
    try:
        with pytest.raises(StoreUnavailableError,
                           match=f"monitor no master named 'typo' \\(they monitor: {MASTER}\\)"):
            open_sentinel_store(c.sentinel_spec, "typo", password=c.password,
                                sentinel_password=c.sentinel_password, failover_window_s=3600.0)
    finally:
        c.stop()


def test_no_primary_found_is_said_without_the_clients_repr():
    # redis-py's message carries each sentinel client's repr after " : "
    err = MasterNotFoundError(f"No master found for {MASTER!r} : <redis.client.Redis("
                              "<redis.connection.ConnectionPool(...)>)> - network:ConnectionError")
    said = str(unavailable(f"redis+sentinel://127.0.0.1:26379/{MASTER}", err))
    assert f"No master found for {MASTER!r} (did any sentinel answer?" in said and "<redis" not in said


def _failing(errors: list[Exception], then: str = "ok"):
    calls = []

    def do():
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return then

    return do, calls


def test_failover_retry_waits_out_a_missing_primary_only():
    # past redis-py's own three retries, within the window: it keeps asking
    do, calls = _failing([MasterNotFoundError("none")] * 6)
    assert FailoverRetry(window_s=30.0).call_with_retry(do, lambda err: None) == "ok"
    assert len(calls) == 7
    # no window: redis-py's behaviour, three retries then the error
    do, calls = _failing([MasterNotFoundError("none")] * 10)
    with pytest.raises(MasterNotFoundError):
        FailoverRetry(window_s=0.0).call_with_retry(do, lambda err: None)
    assert len(calls) == 4
    # wrong credentials are not a missing primary: no waiting beyond redis-py's retries
    do, calls = _failing([AuthenticationError("WRONGPASS")] * 10)
    with pytest.raises(AuthenticationError):
        FailoverRetry(window_s=30.0).call_with_retry(do, lambda err: None)
    assert len(calls) == 4
