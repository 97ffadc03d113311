"""The end-of-run summary: whole time, finished steps, commands that go on as the run did."""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from rich.console import Console

from cli.run_summary import print_summary
from tests.unit.log_builder import LogBuilder


def _resumed_run() -> LogBuilder:
    """Step 0 finished, step 1 aborted by a restart, steps 1 and 2 finished after it."""
    b = LogBuilder(run_id="r").start()
    for g in ("g1", "g2"):
        b.admit(g).commit(g)
    b.train_step(["g1", "g2"]).publish()
    b.admit("g3").commit("g3").begin_step().microbatch(["g3"]).abort_step("restart").restart()
    for g in ("g4", "g5"):
        b.admit(g).commit(g)
    b.train_step(["g3", "g4"]).publish()
    b.train_step(["g5"]).publish().finish_run()
    return b


def test_the_summary_counts_finished_steps_whole_time_and_repeats_the_worker_flags(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rl-controller"])
    monkeypatch.delenv("RLC_REDIS_URL", raising=False)
    state = _resumed_run().fold()
    assert state.trainer_version == 3 and len(state.steps) == 4
    out = io.StringIO()
    args = argparse.Namespace(redis_url="", data_dir="./rlc-data", ray_address="head:6379",
                              local_workers=False)
    print_summary(args, Console(file=out, width=300), "r", state, Path("runs/r"),
                  startup_s=37.2, train_s=132.4)
    text = out.getvalue()
    assert "trainer_version 3, 3 steps (1 aborted)" in text
    assert "170 s (37 s start-up, 132 s training)" in text
    lines = {line.split()[0]: line.split(None, 1)[1] for line in text.splitlines()[2:]}
    assert lines["replay"] == "rl-controller replay --run r"  # the end state, not a step's
    assert lines["continue"] == (
        "rl-controller run --resume --run-id r --steps 6 --ray-address head:6379"
    )


def test_the_summary_names_the_steps_a_rewind_discarded(monkeypatch):
    """Seen after a rewind that discarded steps 3 and 4 of a run then trained to v10:
    "trainer_version 10, 12 steps", nothing saying why the version is two short."""
    monkeypatch.setattr(sys, "argv", ["rl-controller"])
    b = LogBuilder(run_id="r").start()
    for k in range(3):
        b.admit(f"g{k}").commit(f"g{k}")
        b.train_step([f"g{k}"]).publish()
        if k == 0:
            b.checkpoint()
    b.restart().rewind(1)
    b.admit("g3").commit("g3")
    b.train_step(["g3"]).publish().finish_run()
    state = b.fold()
    assert state.trainer_version == 2 and len(state.steps) == 4
    out = io.StringIO()
    args = argparse.Namespace(redis_url="", data_dir="./rlc-data", ray_address=None,
                              local_workers=True)
    print_summary(args, Console(file=out, width=300), "r", state, Path("runs/r"),
                  startup_s=1.0, train_s=2.0)
    assert "trainer_version 2, 4 steps (2 discarded by a rewind)," in out.getvalue()
