"""Chaos fixtures: one real redis-server (AOF, appendfsync always) and one fork server
per module; every scenario gets its own run id and data directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.harness import Chaos, ForkServer
from tests.conftest import _require_redis_server
from tests.redis_server import RedisServer


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    binary = _require_redis_server()
    server = RedisServer(tmp_path_factory.mktemp("chaos-redis"), binary=binary).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def forkserver() -> Iterator[ForkServer]:
    server = ForkServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def chaos(forkserver: ForkServer, module_redis: RedisServer, tmp_path: Path) -> Chaos:
    assert module_redis.command("FLUSHALL") == b"+OK"
    return Chaos(forkserver, module_redis.url, tmp_path)
