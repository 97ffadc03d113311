"""``[task]``: which task the generators draw prompts from and score completions with.

The controller's ``Config`` composes this Struct and hands it, unchanged, to the
generator workers (``workers.service.WorkerSpec``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from events.config_checks import positive


class TaskSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[task]``: the prompts and the reward (``workers.tasks``)."""

    name: str = "reverse"
    """Built-in task name or a plugin as ``module:Class``."""
    dataset: str = ""
    """Optional JSONL prompt file (``prompt``, ``answer``); empty = generated prompts."""
    num_prompts: int = 4096
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword options of the task's constructor, e.g. ``{ digits = 2 }`` or a
    reasoning-gym dataset's config keys; an unknown one is an error naming it."""

    def __post_init__(self) -> None:
        positive("task", self, "num_prompts")
