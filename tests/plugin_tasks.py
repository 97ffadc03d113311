"""Task plugins the CLI tests name as ``task.name = "tests.plugin_tasks:Class"``."""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from workers.tasks.base import Example
from workers.tasks.builtin import ReverseTask

#: while the file this names exists, RewardFailsWhileMarked's reward() raises
MARKER_ENV = "RLC_TEST_REWARD_BROKEN"
MESSAGE = "reward service unreachable (the test's marker file exists)"
#: the file RewardHeldWhileMarked reads: while it exists, holding the number N, every
#: reward after the first N waits
HOLD_ENV = "RLC_TEST_REWARD_HOLD"

_given = itertools.count()  # rewards asked for in this process (every local generator)
_given_lock = threading.Lock()


def hold_rewards_after(marker: Path, n: int) -> None:
    """Let the first ``n`` rewards of a run with ``HOLD_ENV = marker`` through, hold the
    rest (written whole: the task never reads half a number)."""
    part = marker.with_name(marker.name + ".part")
    part.write_text(str(n))
    os.replace(part, marker)


@dataclass(frozen=True)
class RewardFailsWhileMarked(ReverseTask):
    """The reverse task with a bug its user can fix: ``reward()`` raises while the marker
    file exists (workers read the environment the run was started with)."""

    name = "tests.plugin_tasks:RewardFailsWhileMarked"

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        marker = os.environ.get(MARKER_ENV, "")
        if marker and Path(marker).exists():
            raise RuntimeError(MESSAGE)
        return super().reward(example, completion, stopped)


@dataclass(frozen=True)
class RewardHeldWhileMarked(ReverseTask):
    """The reverse task whose run a test can hold at a known point: while the file named
    by ``HOLD_ENV`` exists, holding N, every reward after the first N of this process
    waits (counted per process: with ``--local-workers`` every generator's, with Ray
    each generator actor's own; a Ray run inherits the variable from the command's
    environment). Deleting the file lets the run go on. A run held this way is alive by construction, so a test
    can watch it between two points without racing it."""

    name = "tests.plugin_tasks:RewardHeldWhileMarked"

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        with _given_lock:
            index = next(_given)
        marker = Path(os.environ.get(HOLD_ENV) or "/nonexistent")  # unset: never held (a resume)
        while True:  # polls the file: what this waits on is the test changing it
            try:
                allowed = int(marker.read_text())
            except FileNotFoundError:
                break
            if index < allowed:
                break
            time.sleep(0.05)
        return super().reward(example, completion, stopped)


#: the ``--set`` that makes a run's task RewardHeldWhileMarked
HELD_TASK = ["--set", f'task.name="{RewardHeldWhileMarked.name}"']


def held_env(hold: Path) -> dict[str, str]:
    """What a run's environment needs for RewardHeldWhileMarked: the hold file, and this
    repository on the path (its generators, Ray actors included, import the task)."""
    return {HOLD_ENV: str(hold), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
