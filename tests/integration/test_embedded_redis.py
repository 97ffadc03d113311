"""The embedded redis-server (start / reuse / stop) and how connection failures read."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from events.embedded import (
    EmbeddedRedis,
    ensure_embedded_redis,
    find_redis_server,
    free_port,
    pid_alive,
    stop_embedded_redis,
)
from events.errors import RedisServerNotFoundError, StoreUnavailableError
from events.redis_store import RedisEventStore
from events.schema import RunFinished
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    try:
        find_redis_server()
    except RedisServerNotFoundError as err:
        pytest.skip(str(err))
    yield tmp_path / "rlc-data"
    stop_embedded_redis(tmp_path / "rlc-data")


def finished(epoch: int) -> RunFinished:
    return RunFinished(event_id="run:finished", epoch=epoch, ts=0.0, reason="done")


def test_start_reuse_stop_keeps_the_log(data_dir: Path) -> None:
    first = ensure_embedded_redis(data_dir)
    assert not first.reused and pid_alive(first.pid)
    assert first.url == f"redis://127.0.0.1:{first.port}/0"
    assert (data_dir / "redis.pid").read_text().strip() == str(first.pid)
    assert (data_dir / "redis.port").read_text().strip() == str(first.port)

    store = RedisEventStore(first.url)
    assert store.client.config_get("bind") == {"bind": "127.0.0.1"}
    assert store.client.config_get("appendfsync") == {"appendfsync": "always"}
    epoch = store.claim_epoch("r")
    store.append("r", [finished(epoch)], expected_position=0, epoch=epoch)
    store.close()

    again = ensure_embedded_redis(data_dir)
    assert again == EmbeddedRedis(first.url, first.port, first.pid, first.data_dir, reused=True)

    assert stop_embedded_redis(data_dir)
    assert not pid_alive(first.pid)
    assert not (data_dir / "redis.pid").exists()
    assert not stop_embedded_redis(data_dir)

    restarted = ensure_embedded_redis(data_dir)  # a fresh server replays the AOF
    assert not restarted.reused and restarted.pid != first.pid
    store = RedisEventStore(restarted.url)
    assert [s.event for s in store.read("r")] == [finished(epoch)]
    store.close()


def test_stale_pidfile_is_replaced(data_dir: Path) -> None:
    data_dir.mkdir(parents=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (data_dir / "redis.pid").write_text(f"{gone.pid}\n")
    (data_dir / "redis.port").write_text(f"{free_port()}\n")
    server = ensure_embedded_redis(data_dir)
    assert not server.reused and server.pid != gone.pid
    assert (data_dir / "redis.pid").read_text().strip() == str(server.pid)


def test_missing_binary_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(RedisServerNotFoundError, match="apt-get install redis-server"):
        find_redis_server(search_path=str(tmp_path), fallbacks=False)
    with pytest.raises(RedisServerNotFoundError, match="apt-get install redis-server") as info:
        ensure_embedded_redis(tmp_path / "d", redis_server=str(tmp_path / "no-redis-server"))
    assert "\n" not in str(info.value)
    assert isinstance(info.value, StoreUnavailableError)


def test_unreachable_url_is_one_clear_line() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(StoreUnavailableError) as info:
        RedisEventStore(url, connect_timeout_s=1)
    message = str(info.value)
    assert url in message and "\n" not in message


def test_wrong_password_is_unavailable_and_not_echoed(tmp_path: Path) -> None:
    try:
        binary = find_redis_server()
    except RedisServerNotFoundError as err:
        pytest.skip(str(err))
    with RedisServer(tmp_path, password="right-pw", binary=binary) as server:
        base = f"127.0.0.1:{server.port}/0"
        for url in (f"redis://:wrong-pw@{base}", f"redis://{base}"):
            with pytest.raises(StoreUnavailableError) as info:
                RedisEventStore(url, connect_timeout_s=1)
            message = str(info.value)
            assert base in message and "wrong-pw" not in message and "\n" not in message
        store = RedisEventStore(f"redis://:right-pw@{base}")
        assert store.claim_epoch("r") == 1
        store.close()
        # TLS against a plain-text server fails the handshake: unavailable, not a hang.
        with pytest.raises(StoreUnavailableError, match="rediss://"):
            RedisEventStore(
                f"rediss://:right-pw@{base}", connect_timeout_s=0.5, command_timeout_s=0.5
            )


def test_live_but_silent_server_is_not_doubled(data_dir: Path) -> None:
    server = ensure_embedded_redis(data_dir)
    (data_dir / "redis.port").write_text(f"{free_port()}\n")  # records a port nobody serves
    with pytest.raises(StoreUnavailableError, match=f"pid {server.pid}"):
        ensure_embedded_redis(data_dir, start_timeout_s=0.2)
    assert stop_embedded_redis(data_dir)  # stop goes by the pid, answered or not
    assert not pid_alive(server.pid)


def test_a_database_number_the_server_lacks_is_one_line(redis_url: str) -> None:
    # the URL's /DB is SELECTed at connect: "DB index is out of range" was a traceback
    url = redis_url.rsplit("/", 1)[0] + "/99"
    with pytest.raises(StoreUnavailableError) as info:
        RedisEventStore(url, connect_timeout_s=1)
    message = str(info.value)
    assert url in message and "no database with the number" in message and "\n" not in message
