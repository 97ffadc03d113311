"""Ctrl-C while ``run`` starts its workers, after the run was opened: exit 130 and one
line ending in the resume command, as Ctrl-C during training says. It printed a bare
"interrupted", so the user of a default-named run had to find its id by hand.

SIGINT goes to the whole process group right after the line that opens the run
(printed before the workers start: seconds of imports, Ray and the data plane); every
reward is held (``tests.plugin_tasks.RewardHeldWhileMarked``), so the run cannot have
finished whichever point of its start or its loop the signal lands at, and the line
expected is the same at each of them."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from events.embedded import stop_embedded_redis
from tests.foreground import popen_foreground
from tests.integration.test_run_cli import ROOT, _command
from tests.plugin_tasks import HELD_TASK, held_env, hold_rewards_after

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = "interrupted; the log is consistent, continue with: "


def test_ctrl_c_while_workers_start_names_the_resume_command(tmp_path: Path) -> None:
    data_dir, hold = tmp_path / "rlc-data", tmp_path / "hold"
    hold_rewards_after(hold, 0)
    env = {**{k: v for k, v in os.environ.items() if k != "RLC_REDIS_URL"}, **held_env(hold)}
    proc = popen_foreground(
        [*_command(), "run", "--steps", "3", "--no-progress", "--local-workers",
         "--data-dir", str(data_dir), *HELD_TASK],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        opened = ""
        for line in proc.stdout:
            if " epoch 1: trainer_version 0 -> 3" in line:
                opened = line
                os.killpg(proc.pid, signal.SIGINT)
                break
        rest = proc.stdout.read()
        hold.unlink()
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stop_embedded_redis(data_dir)
    run_id = opened.split()[1] if opened else "?"
    assert proc.returncode == 130 and "Traceback" not in rest, rest[-3000:]
    last = rest.strip().splitlines()[-1]
    assert last.startswith("rl-controller: error: " + PROMPT), rest[-3000:]
    assert f"run --resume --run-id {run_id} --steps 3 --local-workers" in last, last
