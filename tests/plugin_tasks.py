"""Task plugins the CLI tests name as ``task.name = "tests.plugin_tasks:Class"``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from workers.tasks.base import Example
from workers.tasks.builtin import ReverseTask

#: while the file this names exists, RewardFailsWhileMarked's reward() raises
MARKER_ENV = "RLC_TEST_REWARD_BROKEN"
MESSAGE = "reward service unreachable (the test's marker file exists)"


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
