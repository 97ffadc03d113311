"""A generator's group of episodes: what ``Generator.generate_group`` does for an
:class:`~workers.envs.task.EpisodeTask`.

The generator keeps its contract (one :class:`GroupResult`, one data-plane row per
sample under the same keys); only the rows differ: each is an episode's trajectory
(``workers.envs.trajectory``) with its ``token_rewards``. The weights in force are
read at each turn's start and end; a refit lands between token steps or between turns.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import nn

from workers.envs.base import StepKey
from workers.envs.recorder import InMemoryTurnRecorder, TurnRecorder
from workers.envs.runner import EpisodeRunner
from workers.envs.sampler import TorchTurnSampler
from workers.envs.task import EpisodeTask
from workers.envs.trajectory import Trajectory
from workers.dataplane.api import DataPlane
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


def episode_keys(run_id: str, group_id: str, n: int) -> list[StepKey]:
    return [StepKey(run_id, group_id, i, 0) for i in range(n)]


def run_episodes(
    gen: EpisodeHost,
    task: EpisodeTask,
    group_id: str,
    prompt: Example,
    n: int,
    sampling: SamplingSection,
    seed: int,
    recorder: TurnRecorder | None = None,
) -> list[Trajectory]:
    """Run the group's ``n`` episodes with the generator's model and weights."""
    sampler = TorchTurnSampler(
        gen.model, gen.tokenizer.eos_id, sampling, torch.Generator().manual_seed(seed),
        version=lambda: gen.weights.version, between_steps=gen.weights.at_step_boundary,
        use_cache=gen.use_cache,
    )
    runner = EpisodeRunner(
        sampler, gen.tokenizer, recorder if recorder is not None else InMemoryTurnRecorder(),
        context_len=context_len(gen.model), max_new_tokens=sampling.max_new_tokens,
        max_turns=task.max_turns, env_name=task.name,
    )
    envs = [task.make_env(prompt) for _ in range(n)]
    return runner.run(episode_keys(gen.run_id, group_id, n), envs)


def generate_episode_group(
    gen: EpisodeHost,
    keys: list[str],
    group_id: str,
    prompt: Example,
    n: int,
    sampling: SamplingSection,
    seed: int,
    attempt: int = 0,
) -> dict[str, Any]:
    """The episode counterpart of ``Generator.generate_group``: stores the rows under
    ``keys`` and returns the ``GroupResult`` fields (same result, same keys)."""
    task = gen.task
    assert isinstance(task, EpisodeTask)
    start = gen.weights.begin_group()
    try:
        trajs = run_episodes(gen, task, group_id, prompt, n, sampling, seed)
    finally:
        end = gen.weights.end_group()
    rewards = [t.reward for t in trajs]
    bad = [r for r in rewards if not math.isfinite(r)]
    if bad:
        raise ValueError(f"task {task.name!r} returned non-finite rewards {bad}")
    tag = {"group": group_id, "attempt": attempt, "v_start": start, "v_end": end}
    gen.dataplane.put(gen.run_id, keys, [t.row() for t in trajs],
                      [dict(tag, sample=i, turns=len(t.turns)) for i, t in enumerate(trajs)])
    return {
        "group_id": group_id, "attempt": attempt, "partition": gen.run_id, "keys": keys,
        "rewards": rewards, "completion_lens": [t.completion_len for t in trajs],
        "prompt_len": trajs[0].prompt_len, "weight_version_start": start,
        "weight_version_end": end,
    }
