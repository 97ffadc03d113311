"""Shared fixtures: real redis-server processes started and stopped by the tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from events.errors import RedisServerNotFoundError
from events.embedded import find_redis_server
from tests.redis_server import RedisServer


def _require_redis_server() -> str:
    try:
        return find_redis_server()
    except RedisServerNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def shared_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real server (AOF, appendfsync always) for the whole session; see ``redis_url``."""
    binary = _require_redis_server()
    server = RedisServer(tmp_path_factory.mktemp("redis-shared"), binary=binary).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(shared_redis_server: RedisServer) -> str:
    """URL of the shared real server, emptied (FLUSHALL) for this test."""
    assert shared_redis_server.command("FLUSHALL") == b"+OK"
    return shared_redis_server.url


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real server of this test's own, which the test may kill -9 and restart."""
    binary = _require_redis_server()
    server = RedisServer(tmp_path_factory.mktemp("redis"), binary=binary).start()
    try:
        yield server
    finally:
        server.stop()
