"""Tasks: prompts with verifiable rewards, a registry of built-ins and plugin loading.

``make_task("reverse")`` builds a built-in task; ``make_task("pkg.mod:MyTask")`` loads
a user class implementing :class:`Task`. :data:`DEFAULT_TASK` is what a run uses when
its config names none.
"""

from workers.tasks.base import (
    Example,
    Task,
    UnknownTaskError,
    available_tasks,
    make_task,
    register_task,
    shaped_match_reward,
)
from workers.tasks.builtin import DEFAULT_TASK, AdditionTask, CopyTask, ReverseTask
from workers.tasks.dataset import (
    DatasetError,
    PromptTooLongError,
    check_prompts_fit,
    load_jsonl,
    prompt_set,
)

__all__ = [
    "DEFAULT_TASK",
    "AdditionTask",
    "CopyTask",
    "DatasetError",
    "Example",
    "PromptTooLongError",
    "ReverseTask",
    "Task",
    "UnknownTaskError",
    "available_tasks",
    "check_prompts_fit",
    "load_jsonl",
    "make_task",
    "prompt_set",
    "register_task",
    "shaped_match_reward",
]
