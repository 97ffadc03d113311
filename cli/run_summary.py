"""What ``rl-controller run`` tells the user at its end: the summary and the follow-ups.

Every command printed can be pasted as it is (``cli.followup``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from cli import followup
from controller.core.state import RunState, StepStatus


def print_summary(args: argparse.Namespace, console: Console, run_id: str, state: RunState,
                  run_dir: Path, *, startup_s: float | None, train_s: float) -> None:
    """One line of totals, then the commands to look at or go on with the run.

    Steps count finished ones only (a resumed run's aborted step is named apart, and so
    are finished steps a rewind discarded: the version counts only the others), and
    the time is the whole command's: start-up (Ray, workers, recovery) and training.
    """
    last = state.steps.get(state.version_steps.get(state.trainer_version, -1))
    reward = last.metrics.get("reward/mean") if last else None
    finished = sum(1 for s in state.steps.values() if s.status is StepStatus.FINISHED)
    aborted = len(state.steps) - finished
    # finished, then discarded by a rewind (RunRewound): not in trainer_version
    discarded = sum(1 for s in state.steps.values() if s.lost)
    apart = [f"{n} {what}" for n, what in ((aborted, "aborted"), (discarded, "discarded by a rewind"))
             if n]
    took = f"{train_s:.0f} s training"
    if startup_s is not None:
        took = f"{startup_s + train_s:.0f} s ({startup_s:.0f} s start-up, {took})"
    c = console
    c.print(f"\n[bold]run {run_id}[/] finished: trainer_version {state.trainer_version}, "
            f"{finished} steps" + (f" ({', '.join(apart)})" if apart else "")
            + f", {state.position} events, {took}"
            + (f", last reward {reward:.3f}" if reward is not None else ""))
    run = run_id
    c.print(f"  metrics   {run_dir / 'metrics.jsonl'}", markup=False, highlight=False)
    more = str(2 * state.trainer_version or 1)
    for label, words in (
        ("audit", ("audit", "--run", run)),
        ("staleness", ("staleness", "--run", run)),
        ("replay", ("replay", "--run", run)),  # the end: finished, the last checkpoint
        ("continue", ("run", "--resume", "--run-id", run, "--steps", more,
                      *followup.worker_flags(args))),
        ("delete", ("delete", "--run", run)),
    ):
        c.print(f"  {label:<9} {followup.command(args, *words)}", markup=False, highlight=False)


def nothing_to_do(run_id: str, version: int) -> int:
    print(
        f"run {run_id} is finished at trainer_version {version}: nothing to do "
        f"(pass --steps N with N > {version} to train further)"
    )
    return 0
