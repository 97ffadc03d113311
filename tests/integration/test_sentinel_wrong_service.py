"""--redis-sentinel pointed at a Redis server (not a sentinel) is one line, not a traceback.

A plain redis-server answers the sentinel probe with "unknown command 'SENTINEL'": an
answer, so the probe used to hand over to the store's first command, whose untranslated
ResponseError came out as a traceback. A real redis-server is enough to show it.
"""

from __future__ import annotations

import pytest

from cli.main import main
from events.embedded import free_port
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("also_down", [False, True])
def test_a_redis_server_given_as_a_sentinel_is_named(capsys, shared_redis_server: RedisServer,
                                                     also_down: bool) -> None:
    server = f"127.0.0.1:{shared_redis_server.port}"
    down = f"127.0.0.1:{free_port()}"
    spec = f"{server},{down}" if also_down else server
    try:
        code = main(["runs", "--redis-sentinel", spec, "--redis-master", "mymaster"])
    except SystemExit as exc:
        code = exc.code
    _, err = capsys.readouterr()
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert (f"{server} does not know the SENTINEL command, so it is not a sentinel (a Redis "
            "server? that takes --redis-url;") in err
    assert (f"no answer from {down}" in err) == also_down
