"""``rl-controller run --steps 3`` with each loss option family switched on, then ``audit``.

Three runs in one data directory (one embedded redis-server) cover every ``[train.loss]``
choice between them, each with its own policy surrogate, aggregation, off-policy
correction and KL placement; each must finish, audit clean, and write finite metrics
including the entropy and the train/inference mismatch. A bad option value is one line
and a non-zero exit before anything starts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.integration.test_run_cli import cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUNS = {
    "gspo": [
        "policy_loss=gspo", "old_policy=generator", "is_correction=seq-tis",
        "aggregation=seq-mean-token-sum-norm", "kl_coef=0.05", "kl_estimator=k2",
        "kl_gradient=score", "entropy_coef=0.01",
    ],
    "cispo": [
        "policy_loss=cispo", "old_policy=generator", "is_correction=icepop", "is_min=0.5",
        "aggregation=seq-mean-token-sum", "kl_coef=0.05", "kl_estimator=k1",
        "kl_placement=reward",
    ],
    "dual-clip": [
        "dual_clip=3.0", "old_policy=generator", "is_correction=seq-mask-tis", "is_min=0.5",
        "aggregation=sequence", "kl_coef=0.05", "kl_input_clamp=5.0", "kl_output_clamp=1.0",
    ],
}


@pytest.mark.parametrize("family", list(RUNS))
def test_three_steps_with_the_family_on_then_audit(data_dir: Path, family: str):
    sets = [arg for opt in RUNS[family] for arg in ("--set", f"train.loss.{opt}")]
    run = cli("run", "--steps", "3", "--run-id", family, "--no-progress",
              "--data-dir", str(data_dir), *sets, timeout_s=600)
    assert run.returncode == 0, run.stderr[-3000:]
    audit = cli("audit", "--run", family, "--data-dir", str(data_dir))
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
    rows = [json.loads(line) for line in (data_dir / "runs" / family / "metrics.jsonl").open()]
    assert [r["trainer_version"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
        assert row["entropy"] > 0 and row["kl"] >= 0
        assert row["mismatch_tokens"] > 0 and row["mismatch_kl"] >= 0
        assert row["mismatch_logprob_diff_max"] >= row["mismatch_logprob_diff_mean"] >= 0


def test_a_bad_option_value_is_one_line(data_dir: Path):
    bad = cli("run", "--steps", "3", "--run-id", "bad", "--no-progress",
              "--data-dir", str(data_dir), "--set", "train.loss.policy_loss=ppo2")
    assert bad.returncode != 0
    lines = [line for line in bad.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "train.loss.policy_loss" in lines[0], bad.stderr
    assert "gspo" in lines[0]  # the choices are named
