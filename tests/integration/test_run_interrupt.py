"""Ctrl-C during ``rl-controller run``, as a terminal sends it, then the printed resume.

The run is started in its own session (so it is the terminal's foreground process
group) and SIGINT goes to the whole group once the first ``step_finished`` is in its
log file, exactly what Ctrl-C does to the command and every process it started (the
command starts with SIGINT at its default action, as a terminal's foreground job does,
even when pytest runs as a background job: ``tests.foreground``). Then:
exit status 130, one line that ends in a resume command and no traceback, a consistent
log (``audit`` exits 0), and the printed command, run word for word, finishes the run.

The run cannot finish before the signal: its task (``tests.plugin_tasks.RewardHeldWhileMarked``)
holds every reward after the first two steps' worth until the test lifts the hold after
the run has exited, so "interrupted before the end" holds by construction, not because
the signal beat five more steps on a loaded machine.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from controller.settings import RolloutSection
from events.embedded import stop_embedded_redis
from tests.plugin_tasks import HELD_TASK, held_env, hold_rewards_after
from workers.trainer.config import TrainSection
from tests.foreground import popen_foreground
from tests.integration.test_run_cli import ROOT, _command, cli, runs

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN_ID = "ctrl-c"
STEPS = 6
PROMPT = "interrupted; the log is consistent, continue with: "


def _same_program(printed: str, expected: str) -> bool:
    """The printed command is the bare name when that name on PATH is this program."""
    return os.path.realpath(shutil.which(printed) or printed) == os.path.realpath(expected)


def _wait_for_first_step(proc: subprocess.Popen, log_file: Path, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run ended ({proc.returncode}) before its first step was logged")
        if log_file.exists() and '"event": "step_finished"' in log_file.read_text():
            return
        time.sleep(0.1)
    pytest.fail(f"no step_finished in {log_file} after {limit_s:g} s")


def test_ctrl_c_leaves_a_consistent_log_and_a_resume_command_that_finishes(tmp_path):
    data_dir = tmp_path / "rlc-data"
    hold = tmp_path / "hold"
    hold_rewards_after(hold, 2 * TrainSection().groups_per_step * RolloutSection().samples_per_group)
    env = {**{k: v for k, v in os.environ.items() if k != "RLC_REDIS_URL"},
           **held_env(hold)}
    proc = popen_foreground(
        [*_command(), "run", "--steps", str(STEPS), "--run-id", RUN_ID, "--no-progress",
         "--data-dir", str(data_dir), *HELD_TASK],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        _wait_for_first_step(proc, data_dir / "runs" / RUN_ID / "controller.log.jsonl", 600)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the whole process group
        out, err = proc.communicate(timeout=180)
        hold.unlink()  # the resume below runs to the end

        assert proc.returncode == 130, (proc.returncode, err[-3000:])
        assert "Traceback" not in out + err, err[-3000:]
        # stderr is also the console (progress lines): the error is its one last line
        errors = [line for line in err.splitlines() if line.startswith("rl-controller: error")]
        assert errors == [err.strip().splitlines()[-1]], err[-3000:]
        assert errors[0].startswith("rl-controller: error: " + PROMPT), errors
        resume = shlex.split(errors[0].split(PROMPT, 1)[1])
        assert _same_program(resume[0], _command()[0]) and resume[1:5] == ["run", "--resume", "--run-id", RUN_ID]

        stopped = runs(data_dir)[RUN_ID]
        assert not stopped["finished"] and 1 <= stopped["trainer_version"] < STEPS, stopped
        audit = cli("audit", "--run", RUN_ID, "--data-dir", str(data_dir))
        assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]

        # the printed command, word for word
        resumed = subprocess.run(resume, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"run {RUN_ID} finished: trainer_version {STEPS}" in resumed.stdout + resumed.stderr
        row = runs(data_dir)[RUN_ID]
        assert row["finished"] and row["trainer_version"] == STEPS, row
        audit = cli("audit", "--run", RUN_ID, "--data-dir", str(data_dir))
        assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stop_embedded_redis(data_dir)
