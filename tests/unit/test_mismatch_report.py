"""The train/inference mismatch reaches people every step: the live table's column, a
warning above ``train.loss.mismatch_kl_warn``, metrics.jsonl and TensorBoard."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from controller.observe import MetricsSink, Progress
from workers.loss.metrics import mismatch_warning

STEP = {
    "reward/mean": 0.5, "mismatch_kl": 0.03, "mismatch_tokens": 812.0,
    "mismatch_logprob_diff_mean": 0.031, "mismatch_logprob_diff_max": 0.097,
}


def test_warning_only_above_a_set_threshold():
    assert mismatch_warning(STEP, 0.0) is None  # 0 = never
    assert mismatch_warning(STEP, 0.05) is None
    assert mismatch_warning({"reward/mean": 1.0}, 0.01) is None  # no token at the version
    line = mismatch_warning(STEP, 0.01)
    assert line is not None and "\n" not in line
    assert "train.loss.mismatch_kl_warn = 0.01" in line and "0.03" in line and "812" in line


def test_the_live_table_shows_the_mismatch_and_the_warning():
    out = io.StringIO()
    progress = Progress(3, console=Console(file=out, force_terminal=False, width=200))
    progress.step(0, 1, STEP, buffer=0, in_flight=2)
    progress.step(1, 2, {"reward/mean": 0.6}, buffer=0, in_flight=2)
    progress.warn(mismatch_warning(STEP, 0.01))
    lines = out.getvalue().splitlines()
    assert "mismatch kl=3.0e-02" in lines[0]
    assert "mismatch kl=-" in lines[1]  # no token generated at the trainer's version
    assert lines[2].startswith("warning: train/inference mismatch")


def test_metrics_jsonl_and_tensorboard_get_the_mismatch(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsSink(tmp_path)
    sink.write(0, 1, STEP)
    sink.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["mismatch_kl"] == 0.03 and row["mismatch_logprob_diff_max"] == 0.097
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"mismatch_kl", "mismatch_logprob_diff_mean"} <= set(events.Tags()["scalars"])
    assert events.Scalars("mismatch_kl")[0].value == pytest.approx(0.03)
