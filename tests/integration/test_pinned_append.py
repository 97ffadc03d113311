"""The pinned connection packs a command in one hiredis call: the same bytes, the same
semantics (NOSCRIPT fallback, retry after a lost connection, error translation).

``PinnedConnection.execute_command`` used to go through redis-py's ``send_command``
(its packer's wrapper over the same hiredis call); it now sends ``pack(args)``. What the
server sees must not change, and neither may what an append does when the server lost
the script or the connection dropped.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis import exceptions as rex
from redis.connection import PythonRespSerializer

from events.errors import FencedError
from events.redis_store import RedisEventStore
from events.redis_store.connection import PinnedConnection, pack
from events.redis_store.layout import APPEND, events_key, meta_key
from events.schema import GroupFailed
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration


def _failed(first: int, n: int = 3, epoch: int = 1) -> list[GroupFailed]:
    return [GroupFailed(event_id=f"group:g{i}:failed:a0", epoch=epoch, ts=float(i),
                        group_id=f"g{i}", attempt=0, reason="é — test") for i in range(first, first + n)]


def test_packed_bytes_are_what_redis_py_sends() -> None:
    # an append's command: str, int and bytes arguments, non-ASCII text, an empty
    # string, a value past redis-py's 6000-byte chunking cutoff
    args = ("EVALSHA", APPEND.sha, 2, events_key("r"), meta_key("r"), 7, 0, 2, "", "sha256",
            "GroupFailed", "group:é:failed", b'{"x":1}', "ab" * 32, "GroupFailed", "id2", b"y" * 9000, "")
    python = PythonRespSerializer(6000, lambda a: a if isinstance(a, bytes) else str(a).encode()).pack(*args)
    assert pack(args) == [b"".join(python)]


def test_what_the_packer_cannot_send_is_redis_pys_error() -> None:
    with pytest.raises(rex.DataError):
        pack(("SET", "k", None))
    assert pack(("CONFIG GET", "maxmemory")) is None  # redis-py splits such a name itself


@pytest.fixture
def store(redis_url: str) -> Iterator[RedisEventStore]:
    made = RedisEventStore(redis_url)
    try:
        yield made
    finally:
        made.close()


def test_an_append_after_the_server_lost_its_scripts_falls_back_to_eval(store: RedisEventStore) -> None:
    epoch = store.claim_epoch("r")
    store.append("r", _failed(0), expected_position=0, epoch=epoch)
    store.client.script_flush()
    assert store.append("r", _failed(3), expected_position=3, epoch=epoch) == [4, 5, 6]
    assert store.client.script_exists(APPEND.sha) == [True]  # EVAL loaded it again
    assert [s.event for s in store.read("r")] == _failed(0) + _failed(3)


def test_a_dropped_connection_is_reconnected_and_the_append_written_once(store: RedisEventStore) -> None:
    epoch = store.claim_epoch("r")
    store.append("r", _failed(0), expected_position=0, epoch=epoch)
    # every normal client of the server goes, the pinned connection among them
    store.client.client_kill_filter(_type="normal", skipme=False)
    assert store.append("r", _failed(3), expected_position=3, epoch=epoch) == [4, 5, 6]
    # a retry of the same batch (its reply lost) is recognised, not written again
    assert store.append("r", _failed(3), expected_position=3, epoch=epoch) == [4, 5, 6]
    assert store.last_position("r") == 6


def test_a_fenced_append_is_the_stores_error_and_the_connection_stays_usable(store: RedisEventStore) -> None:
    old = store.claim_epoch("r")
    new = store.claim_epoch("r")
    with pytest.raises(FencedError):
        store.append("r", _failed(0, epoch=old), expected_position=0, epoch=old)
    assert store.current_epoch("r") == new  # same pinned connection, still in step
    assert store.append("r", _failed(0, epoch=new), expected_position=0, epoch=new) == [1, 2, 3]


def test_the_retry_stops_within_its_budget(redis_server: RedisServer) -> None:
    store = RedisEventStore(redis_server.url)
    try:
        pinned = PinnedConnection(store.client, retries=1)
        assert pinned.execute_command("PING") in (b"PONG", "PONG", True)
        redis_server.kill()
        with pytest.raises(rex.ConnectionError):
            pinned.execute_command("PING")
        pinned.close()
    finally:
        store.close()
