"""When everything fails, ``rl-controller run`` stops and says why, and goes on once fixed.

Through the installed command, with Ray workers (the default), the two cases a user met:

* a task plugin whose ``reward()`` raises on every group: the run stops after the
  failure budget (a bounded number of events) with exit status 4 and one line naming
  the worker's exception -- type and message, not Ray's coloured traceback -- which the
  console also printed when it first happened; ``audit`` exits 0, ``tail`` prints the
  reason clean, and once the plugin is fixed the printed resume command finishes the run;
* an HF model directory without tokenizer files: refused before anything is written
  (the pre-check loads the tokenizer the workers would), and trained once the files
  are back.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from events.embedded import stop_embedded_redis
from tests.integration.test_run_cli import ROOT, assert_one_line_error, cli, runs
from tests.plugin_tasks import MARKER_ENV, MESSAGE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL = ["--no-progress", "--set", "train.groups_per_step=4", "--set", "train.groups_per_microbatch=2",
         "--set", "rollout.samples_per_group=4", "--set", "rollout.groups_per_call=2"]
PROMPT = "the log is consistent: fix the cause, then continue with: "


@pytest.fixture
def data_dir(tmp_path):
    try:
        yield tmp_path / "rlc-data"
    finally:
        stop_embedded_redis(tmp_path / "rlc-data")


def test_a_reward_that_raises_stops_the_run_in_one_line_and_it_resumes_once_fixed(
    data_dir, tmp_path
):
    marker = tmp_path / "reward-broken"
    marker.write_text("")
    env = {**os.environ, MARKER_ENV: str(marker), "PYTHONPATH": str(ROOT)}
    proc = cli("run", "--steps", "2", "--run-id", "flaky", "--data-dir", str(data_dir), *SMALL,
               "--set", 'task.name="tests.plugin_tasks:RewardFailsWhileMarked"',
               env=env, timeout_s=600)
    assert proc.returncode == 4, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    budget = 2 * 8  # groups_per_call x max(8, 2 x num_generators)
    assert last.startswith(f"rl-controller: error: stopped: {budget} groups failed in a row"), last
    assert f"all with: RuntimeError: {MESSAGE} (on generator-0)" in last, last
    for noise in ("Traceback", "RayTaskError", "\x1b["):
        assert noise not in proc.stderr, noise
    # the console said it when it first happened, in full, once
    said = [line for line in proc.stderr.splitlines() if line.startswith("generation failed on")]
    assert len(said) == 1 and f"RuntimeError: {MESSAGE}" in said[0], said

    row = runs(data_dir)["flaky"]
    # no step finished: runs reads the version back past the failures (it showed none)
    assert not row["finished"] and row["trainer_version"] == 0
    # RunStarted, ControllerStarted, the first publish, then admissions and failures of
    # the budget's groups and of what was in flight when it ran out, then RunStopped
    assert row["events"] <= 3 + 2 * (budget + 2) + 1, row
    audit = cli("audit", "--run", "flaky", "--data-dir", str(data_dir))
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
    tail = cli("tail", "--run", "flaky", "--data-dir", str(data_dir))
    assert tail.returncode == 0 and "\x1b[" not in tail.stdout and "RayTaskError" not in tail.stdout
    assert f"reason=generator-0: RuntimeError: {MESSAGE}" in tail.stdout
    assert "RunStopped" in tail.stdout.splitlines()[-1] or "RunStopped" in tail.stdout

    marker.unlink()  # the fix
    resume = shlex.split(last.split(PROMPT, 1)[1])
    resumed = subprocess.run(resume, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    row = runs(data_dir)["flaky"]
    assert row["finished"] and row["trainer_version"] == 2, row
    audit = cli("audit", "--run", "flaky", "--data-dir", str(data_dir))
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]


def test_an_hf_directory_without_tokenizer_files_is_refused_up_front_and_runs_once_fixed(
    data_dir, tmp_path
):
    pytest.importorskip("transformers")
    from tests.hf_fixture import save_tiny_hf_lm

    model = save_tiny_hf_lm(tmp_path / "model", "qwen2")
    kept = tmp_path / "tokenizer-files"
    kept.mkdir()
    for f in model.iterdir():
        if "token" in f.name:
            shutil.move(str(f), kept / f.name)
    args = ["run", "--steps", "1", "--run-id", "hf", "--data-dir", str(data_dir), *SMALL,
            "--set", "model.kind=hf", "--set", f'model.path="{model}"',
            "--set", "sampling.max_new_tokens=4"]
    refused = cli(*args, timeout_s=300)
    assert_one_line_error(refused, "model.path", "the tokenizer encodes the prompt", "to no tokens")
    assert not (data_dir / "runs" / "hf").exists()

    for f in kept.iterdir():  # the fix: the tokenizer files are back
        shutil.move(str(f), model / f.name)
    trained = cli(*args, timeout_s=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert runs(data_dir)["hf"]["trainer_version"] == 1
    audit = cli("audit", "--run", "hf", "--data-dir", str(data_dir))
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
