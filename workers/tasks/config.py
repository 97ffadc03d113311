"""``[task]``: which task the generators draw prompts from and score completions with.

The controller's ``Config`` composes this Struct and hands it, unchanged, to the
generator workers (``workers.service.WorkerSpec``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from events.config_checks import flatten, positive


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


def with_task_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """A config's tables (file and ``--set``, not yet validated) laid over the run
    settings its task is tuned for (``workers.tasks.base.task_run_defaults``): a key the
    user gives always wins; the task fills only what is left unset."""
    task = data.get("task")
    name = task.get("name") if isinstance(task, dict) else None
    if not isinstance(name, str):
        name = TaskSection().name
    from workers.tasks.base import task_run_defaults

    return _merge(task_run_defaults(name), data)


def task_defaults_in_effect(name: str, resolved: dict[str, Any]) -> list[str]:
    """``key=value`` for each of the task's defaults that ``resolved`` (a whole config
    as builtins) holds unchanged: what a run says it took from its task."""
    from workers.tasks.base import task_run_defaults

    out = []
    for key, value in flatten(task_run_defaults(name)):
        node: Any = resolved
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node == value:
            out.append(f"{key}={value!r}")
    return out


def _merge(under: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(under)
    for key, value in over.items():
        below = out.get(key)
        out[key] = _merge(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return out
