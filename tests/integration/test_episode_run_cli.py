"""``rl-controller run`` on the built-in ``calculator`` task through the installed command.

A smoke test of the whole path for two-turn episodes with a tool (embedded redis-server,
local Ray, TransferQueue, the tiny model): three steps, the run says which of the task's
run defaults it took, the log audits clean and every step's metrics are written. How
well the task is learnt is measured in docs/learning.md, never asserted here (a few
steps say nothing about learning, and a time limit would fail on a busy machine).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.integration.test_run_cli import cli

pytestmark = pytest.mark.integration

RUN_ID = "calc-smoke"


def test_three_calculator_steps_through_the_cli_then_audit(data_dir: Path):
    run = cli("run", "--steps", "3", "--run-id", RUN_ID, "--no-progress",
              "--data-dir", str(data_dir), "--set", 'task.name="calculator"', timeout_s=600)
    assert run.returncode == 0, run.stderr[-3000:]
    said = run.stdout + run.stderr
    assert ("task calculator: its run defaults model.alphabet='0123456789+-*=>c', "
            "train.loss.entropy_coef=0.08") in said
    assert f"run {RUN_ID} finished: trainer_version 3" in said
    audit = cli("audit", "--run", RUN_ID, "--data-dir", str(data_dir))
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
    rows = [json.loads(line) for line in (data_dir / "runs" / RUN_ID / "metrics.jsonl").open()]
    assert [r["trainer_version"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert 0.0 <= row["reward/mean"] <= 1.0
        # the entropy bonus is on: the loss has the term, and its metric is finite
        assert math.isfinite(row["entropy"]) and row["entropy"] > 0
