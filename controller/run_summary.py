"""What ``rl-controller run`` tells the user at its end: the summary and the follow-ups.

Every command printed can be pasted as it is (``controller.followup``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from controller import followup
from controller.observe import Progress


def print_summary(args: argparse.Namespace, progress: Progress, writer, run_dir: Path, elapsed_s: float) -> None:
    state = writer.state
    last = state.steps.get(state.version_steps.get(state.trainer_version, -1))
    reward = last.metrics.get("reward/mean") if last else None
    c = progress.console
    c.print(f"\n[bold]run {writer.run_id}[/] finished: trainer_version {state.trainer_version}, "
            f"{len(state.steps)} steps, {state.position} events, {elapsed_s:.0f}s"
            + (f", last reward {reward:.3f}" if reward is not None else ""))
    run = writer.run_id
    c.print(f"  metrics   {run_dir / 'metrics.jsonl'}", markup=False, highlight=False)
    for label, words in (
        ("audit", ("audit", "--run", run)),
        ("staleness", ("staleness", "--run", run)),
        ("replay", ("replay", "--run", run, "--step", str(max(state.steps, default=0)))),
        ("continue", ("run", "--resume", "--run-id", run, "--steps", str(2 * state.trainer_version or 1))),
        ("delete", ("delete", "--run", run)),
    ):
        c.print(f"  {label:<9} {followup.command(args, *words)}", markup=False, highlight=False)


def nothing_to_do(run_id: str, version: int) -> int:
    print(
        f"run {run_id} is finished at trainer_version {version}: nothing to do "
        f"(pass --steps N with N > {version} to train further)"
    )
    return 0
