"""``runs`` states the trainer_version the log states: 0 before the first step, and the
newest step's version however far back it is. It looked at the last 200 events only and
showed '?' (JSON null) past them: a run stopped by failed generations or a long step."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_readonly_cli import cli, write_log
from tests.unit.log_builder import LogBuilder

pytestmark = pytest.mark.integration


def _versions(capsys, url: str) -> dict[str, int | None]:
    code, out, err = cli(capsys, url, "runs", "--json")
    assert code == 0, err
    return {row["run_id"]: row["trainer_version"] for row in json.loads(out)}


def test_runs_finds_the_version_past_a_long_tail(capsys, redis_url: str) -> None:
    fresh = LogBuilder("fresh").start()
    failing = LogBuilder("failing").start().group("g0").group("g1")
    failing.train_step(["g0", "g1"])
    for _ in range(150):  # 300 events after the step: a generator that keeps failing
        failing.admit("g2").fail("g2")
    write_log(redis_url, fresh)
    write_log(redis_url, failing)
    assert failing.last_position > 300
    assert _versions(capsys, redis_url) == {"fresh": 0, "failing": 1}
