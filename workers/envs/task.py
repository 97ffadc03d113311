"""Episode tasks: a task whose samples are multi-turn episodes with an environment.

An :class:`EpisodeTask` is a ``workers.tasks.Task`` (it draws prompts the same way, so
prompt sets, datasets and the registry work unchanged) that also builds one
:class:`~workers.envs.base.Environment` per episode. The generator hands such a task's
groups to the episode runner (``workers.envs.group``) instead of single-turn sampling.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from workers.envs.base import Action, EnvStep, Environment, Observation, StepKey
from workers.tasks.base import Example, Task, checked_reward


@runtime_checkable
class EpisodeTask(Task, Protocol):
    """A task whose every sample is an episode."""

    #: model turns an episode may take before it is cut off
    max_turns: int

    def make_env(self, example: Example) -> Environment:
        """A fresh environment for one episode of ``example``."""
        ...


def single_turn_reward(task: EpisodeTask, example: Example, completion: str, stopped: bool) -> float:
    """``Task.reward`` for an episode task: ``completion`` as the episode's only turn.

    Keeps an episode task usable where one completion is scored (evaluation, the
    what-if tools); the ids are not needed by any environment's scoring here.
    """
    env = task.make_env(example)
    key = StepKey("score", "score", 0, 0)
    env.reset(key)
    return env.step(Action(completion, (), stopped), key.at(1)).reward


class TaskEnv:
    """Any single-turn ``Task`` as a one-step environment: the prompt, then the reward."""

    #: scoring has no side effect
    dedupes_by_key = True

    def __init__(self, task: Task, example: Example) -> None:
        self.task = task
        self.example = example

    def reset(self, key: StepKey) -> Observation:
        return Observation(text=self.example.prompt)

    def step(self, action: Action, key: StepKey) -> EnvStep:
        reward = checked_reward(f"task {self.task.name!r}",
                                self.task.reward(self.example, action.text, action.stopped))
        return EnvStep(Observation(text=""), reward, True, {})


def as_episode_task(task: Task) -> EpisodeTask:
    """``task`` itself if it is an episode task, else a one-turn wrapper around it."""
    if isinstance(task, EpisodeTask):
        return task
    return _SingleTurn(task)


class _SingleTurn:
    max_turns = 1

    def __init__(self, task: Task) -> None:
        self.task = task
        self.name = task.name

    def examples(self, count: int, seed: int) -> list[Example]:
        return self.task.examples(count, seed)

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        return self.task.reward(example, completion, stopped)

    def make_env(self, example: Example) -> TaskEnv:
        return TaskEnv(self.task, example)
