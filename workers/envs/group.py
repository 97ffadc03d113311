"""A generator's group of episodes: what ``Generator.generate_group`` does for an
:class:`~workers.envs.task.EpisodeTask`.

The generator keeps its contract (one :class:`GroupResult`, one data-plane row per
sample under the same keys); only the rows differ: each is an episode's trajectory
(``workers.envs.trajectory``) with its ``token_rewards``. The weights in force are
read at each turn's start and end; a refit lands between token steps or between turns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from torch import nn

from workers.envs.agent import AgentTask, run_agent_group
from workers.envs.base import StepKey
from workers.envs.recorder import InMemoryTurnRecorder, TurnRecorder
from workers.envs.runner import EpisodeRunner
from workers.envs.sampler import HoldingWeights, TurnSampler, generator_sampler
from workers.envs.task import EpisodeTask
from workers.envs.trajectory import Trajectory
from workers.dataplane.api import DataPlane
from workers.generator.segments import version_runs
from workers.models.config import SamplingSection
from workers.models.factory import Tokenizer, context_len
from workers.tasks.base import Example
from workers.weight_sync import VersionedWeights



class EpisodeHost(Protocol):
    """What a generator lends the episode runner (``workers.generator.Generator``)."""

    model: nn.Module
    tokenizer: Tokenizer
    task: Any
    dataplane: DataPlane
    run_id: str
    use_cache: bool
    weights: VersionedWeights


def episode_keys(
    run_id: str, group_id: str, n: int, restarts: Sequence[int] | None = None
) -> list[StepKey]:
    """The episodes' turn-0 keys (``restarts``: per sample, times it was started over)."""
    again = restarts or [0] * n
    return [StepKey(run_id, group_id, i, 0, again[i]) for i in range(n)]


def run_episodes(
    gen: EpisodeHost,
    task: EpisodeTask,
    group_id: str,
    prompt: Example,
    n: int,
    sampling: SamplingSection,
    seed: int,
    recorder: TurnRecorder | None = None,
    restarts: Sequence[int] | None = None,
) -> list[Trajectory]:
    """Run the group's ``n`` episodes with the generator's model and weights.

    Without a recorder (in memory, the group in one call) the caller holds the weights
    for the whole group; with one, each sampling call holds them, so a refit lands
    while the episodes wait for the log or for an environment."""
    sampler: TurnSampler = generator_sampler(gen, sampling, seed)
    if recorder is not None:
        sampler = HoldingWeights(sampler, gen.weights)
    runner = EpisodeRunner(
        sampler, gen.tokenizer, recorder if recorder is not None else InMemoryTurnRecorder(),
        context_len=context_len(gen.model), max_new_tokens=sampling.max_new_tokens,
        max_turns=task.max_turns, env_name=task.name,
    )
    envs = [task.make_env(prompt) for _ in range(n)]
    return runner.run(episode_keys(gen.run_id, group_id, n, restarts), envs)


def generate_episode_group(
    gen: EpisodeHost,
    keys: list[str],
    group_id: str,
    prompt: Example,
    n: int,
    sampling: SamplingSection,
    seed: int,
    attempt: int = 0,
    recorder: TurnRecorder | None = None,
    restarts: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The episode counterpart of ``Generator.generate_group``: stores the rows under
    ``keys`` and returns the ``GroupResult`` fields (same result, same keys). The
    group's versions are its oldest and newest model token's."""
    task = gen.task
    if isinstance(task, AgentTask):  # the user's OpenAI-client code drives the episodes
        trajs = run_agent_group(gen, task, group_id, prompt, n, sampling, seed, attempt, recorder,
                                restarts)
        return commit_trajectories(gen, keys, group_id, attempt, trajs, task.name)
    assert isinstance(task, EpisodeTask)
    if recorder is None:
        gen.weights.begin_group()
        try:
            trajs = run_episodes(gen, task, group_id, prompt, n, sampling, seed)
        finally:
            gen.weights.end_group()
    else:
        trajs = run_episodes(gen, task, group_id, prompt, n, sampling, seed, recorder, restarts)
    return commit_trajectories(gen, keys, group_id, attempt, trajs, task.name)


def commit_trajectories(
    gen: EpisodeHost, keys: list[str], group_id: str, attempt: int,
    trajs: Sequence[Trajectory], task_name: str,
) -> dict[str, Any]:
    """Store one row per trajectory under ``keys``; the ``GroupResult`` fields."""
    rewards = [t.reward for t in trajs]
    bad = [r for r in rewards if not math.isfinite(r)]
    if bad:
        raise ValueError(f"task {task_name!r} returned non-finite rewards {bad}")
    seen = [v for t in trajs for v in t.versions if v >= 0] or [gen.weights.version]
    start, end = min(seen), max(seen)
    tag = {"group": group_id, "attempt": attempt, "v_start": start, "v_end": end}
    gen.dataplane.put(gen.run_id, keys, [t.row() for t in trajs],
                      [dict(tag, sample=i, turns=len(t.turns)) for i, t in enumerate(trajs)])
    return {
        "group_id": group_id, "attempt": attempt, "partition": gen.run_id, "keys": keys,
        "rewards": rewards, "completion_lens": [t.completion_len for t in trajs],
        "prompt_len": trajs[0].prompt_len, "weight_version_start": start,
        "weight_version_end": end,
        "version_runs": [version_runs(t.versions[t.prompt_len:]) for t in trajs],
    }
