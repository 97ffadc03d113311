"""What a run records and prints for the next command that resumes it.

Seen in real runs: a run started with a relative ``--data-dir`` recorded its checkpoints
as relative paths in ``CheckpointSaved``, so a resume started from another directory
rejected them (``CheckpointRejected``, for good) and stopped, the payloads being released;
and the resume command printed after Ctrl-C (or a stop by the failure budget) of a run
resumed with ``--steps 60`` left the 60 out, so pasted as printed it was refused."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cli import run_cmd


def test_checkpoint_paths_are_absolute_whatever_the_data_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    where = run_cmd.checkpoint_dir(Path("rlc-data") / "runs" / "r1")
    assert os.path.isabs(where), where
    assert where == str(tmp_path / "rlc-data" / "runs" / "r1" / "checkpoints")


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"redis_url": "", "data_dir": "./rlc-data", "steps": None,
                                 "ray_address": None, "local_workers": False, **kw})


def test_the_resume_command_repeats_the_steps_it_was_given(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/opt/venv/bin/rl-controller", "run"])
    monkeypatch.delenv("RLC_REDIS_URL", raising=False)
    assert run_cmd._resume_command(_args(steps=60, local_workers=True, data_dir="/d"), "r1") == (
        "/opt/venv/bin/rl-controller run --resume --run-id r1 --steps 60 --local-workers "
        "--data-dir /d")
    assert run_cmd._resume_command(_args(), "r1") == (
        "/opt/venv/bin/rl-controller run --resume --run-id r1")
