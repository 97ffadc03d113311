"""The run's Redis goes away for longer than the append budget (``Backoff``: about 3 s,
a restart or a failover, not an outage): the run stops with one line that names the
store, says the log is consistent and ends in the command that continues it, exit
status 4 -- not 2, which says the command line was wrong. Seen with a redis-server
killed for 8 s under a real run: "Redis at ... is unavailable: Error 111 connecting
...", exit status 2, and no way on named. Once the server is back (AOF, appendfsync
always) the log audits clean.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.chaos.harness import TINY
from tests.integration.test_run_cli import ROOT, _command, cli
from tests.integration.test_run_interrupt import _wait_for_first_step
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = "once the store is back, continue with: "


def test_a_store_gone_past_the_budget_stops_the_run_with_the_way_on(tmp_path, redis_server: RedisServer):
    data_dir = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != "RLC_REDIS_URL"}
    proc = subprocess.Popen(
        [*_command(), "run", "--run-id", "gone", "--steps", "500", "--redis-url", redis_server.url,
         "--data-dir", str(data_dir), *TINY],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        _wait_for_first_step(proc, data_dir / "runs" / "gone" / "controller.log.jsonl", 300)
        redis_server.kill()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 4, (proc.returncode, err[-3000:])
    assert "Traceback" not in out + err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("rl-controller: error: stopped: ") and "is unavailable" in last, last
    assert f"127.0.0.1:{redis_server.port}" in last, last
    said = shlex.split(last.split(PROMPT, 1)[1])
    assert said[said.index("run"):] == [
        "run", "--resume", "--run-id", "gone", "--steps", "500", "--local-workers",
        "--redis-url", redis_server.url, "--data-dir", str(data_dir)], last

    redis_server.start()
    audit = cli("audit", "--run", "gone", "--redis-url", redis_server.url, "--data-dir", str(data_dir))
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
