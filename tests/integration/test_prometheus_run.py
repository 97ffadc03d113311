"""A real ``rl-controller run`` with ``metrics.port`` set is scraped while it trains.

The run is held after its first 16 rewards (``tests.plugin_tasks.RewardHeldWhileMarked``:
four groups of four samples, enough for two steps of two groups), so the scrape that
sees trainer_version 2 happens while the run is alive, by construction rather than by
being quick; then the hold is lifted and the run goes on to 8. The scrape is parsed with
``prometheus_client``'s parser; after the run, what was scraped mid-run is checked
against the finished log (no count can exceed the log's).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
from collections import Counter
from pathlib import Path

import pytest

from events.embedded import free_port
from events.redis_store import RedisEventStore
from tests.chaos.harness import TINY
from tests.plugin_tasks import HELD_TASK, held_env, hold_rewards_after
from tests.unit.test_prometheus import scrape

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_is_scraped_while_it_trains(redis_url: str, tmp_path: Path) -> None:
    port = free_port()
    hold = tmp_path / "hold"
    hold_rewards_after(hold, 16)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "run", "--run-id", "scraped", "--steps", "8",
         "--redis-url", redis_url, "--data-dir", str(tmp_path), *TINY,
         "--set", f"metrics.port={port}", "--set", "controller.stall_timeout_s=600",
         *HELD_TASK],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **held_env(hold)},
    )
    got: dict = {}
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                got = scrape(f"http://127.0.0.1:{port}/metrics")
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)  # not serving yet
                continue
            # the gauges appear once the run is open (the port is bound before that)
            if got.get("rlc_trainer_version", {}).get((), 0) >= 2:
                break
            time.sleep(0.2)
        hold.unlink()  # the run goes on to 8
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert f"metrics at http://127.0.0.1:{port}/metrics" in out
    assert got, "never scraped while the run was going"
    assert got["rlc_trainer_version"][()] >= 2  # scraped mid-run (the run goes to 8)
    store = RedisEventStore(redis_url)
    try:
        log = Counter(s.event.__class__.__name__ for s in store.read("scraped"))
    finally:
        store.close()
    scraped = {dict(k)["type"]: v for k, v in got["rlc_events_appended_total"].items()}
    for name, count in scraped.items():
        assert count <= log[name], name
    assert 0 < got["rlc_groups_committed_total"][()] <= got["rlc_groups_admitted_total"][()]
    assert got["rlc_group_lag_versions_count"][()] >= 2 * 2  # 2 steps x groups_per_step
    assert got["rlc_step_duration_seconds_count"][()] >= 2
