"""The rollout generator: sample a group, score it, write its rows to the data plane.

``generate_group`` samples ``n`` completions of one prompt with the current weights
(batched, KV-cached; see ``workers.models.sampling``), scores each with the task's
reward, and writes one row per sample (``workers.batch.ROW_FIELDS``) to the data plane
under ``{run}/{group}/a{attempt}/s{i}`` in partition ``{run}``. It returns a
:class:`GroupResult` that the controller turns into a ``GroupCommitted`` event.

Weight updates (``update_weights``) are applied between token steps only; every token
records the version that sampled it (the row's ``token_versions``; the group's
``version_runs``), and the group the oldest and newest of them. Sampling is
deterministic given (weights, seed): every call seeds its own ``torch.Generator`` and
never touches the global RNG.

With ``rollout.partial`` on, the worker drives groups through
``workers.generator.inflight`` instead: a call returns at every durable flush point.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import msgspec
import torch
from torch import nn

from workers.dataplane.api import DataPlane
from workers.envs.agent import AgentTask
from workers.envs.task import EpisodeTask
from workers.generator.segments import version_runs
from workers.models.config import KvOnRefit, SamplingSection
from workers.models.decoder import Decoder, RowPrefix, sample
from workers.models.factory import Tokenizer, context_len
from workers.models.sampling import Completion
from workers.tasks.base import Example, SimulatesDecode, Task, checked_reward
from workers.tasks.dataset import check_prompts_fit
from workers.weight_sync import BucketReceiver, VersionedWeights, WeightsAck


class GroupResult(msgspec.Struct, frozen=True):
    """What one ``generate_group`` produced (payload rows are in the data plane)."""

    group_id: str
    attempt: int
    #: data plane partition holding the rows (the run id)
    partition: str
    #: data plane keys, one per sample, in sample order
    keys: list[str]
    rewards: list[float]
    completion_lens: list[int]
    prompt_len: int
    #: the oldest / newest token version in the group; differ if an update landed mid-group
    weight_version_start: int
    weight_version_end: int
    #: per sample, its token versions run-length encoded ``[v0, n0, v1, n1, ...]``
    version_runs: list[list[int]] = []


def row_key(run_id: str, group_id: str, attempt: int, sample: int) -> str:
    return f"{run_id}/{group_id}/a{attempt}/s{sample}"


def make_row(
    prompt_ids: list[int], completion: Completion, reward: float, version: int = 0
) -> dict[str, torch.Tensor]:
    """One data plane row in the ``workers.batch`` alignment convention.

    ``token_versions`` is -1 on prompt positions; a completion without recorded
    versions gets ``version`` on every token."""
    p, c = len(prompt_ids), len(completion.tokens)
    loss_mask = torch.zeros(p + c, dtype=torch.bool)
    loss_mask[p:] = True
    logprobs = torch.zeros(p + c, dtype=torch.float32)
    logprobs[p:] = completion.logprobs.to(torch.float32)
    versions = torch.full((p + c,), -1, dtype=torch.int64)
    versions[p:] = version if completion.versions is None else completion.versions
    return {
        "token_versions": versions,
        "input_ids": torch.tensor(prompt_ids + completion.tokens, dtype=torch.int64),
        "loss_mask": loss_mask,
        "generator_logprobs": logprobs,
        "reward": torch.tensor(reward, dtype=torch.float32),
        "prompt_len": torch.tensor(p, dtype=torch.int64),
        "completion_len": torch.tensor(c, dtype=torch.int64),
    }


class Generator:
    """Plain-Python rollout generator (the Ray actor in ``actor.py`` is a thin shell)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        task: Task,
        dataplane: DataPlane,
        run_id: str,
        *,
        name: str = "generator-0",
        weight_version: int = 0,
        use_cache: bool = True,
        on_step: Callable[[int], None] | None = None,
        kv_on_refit: KvOnRefit = "recompute",
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.task = task
        self.dataplane = dataplane
        self.run_id = run_id
        self.use_cache = use_cache
        #: partial rollouts only; the one-call path keeps the cache, as it always did
        self.kv_on_refit = kv_on_refit
        #: test hook, called at every token-step boundary with the step index
        self.on_step = on_step
        self.weights = VersionedWeights(self.model, name, weight_version)
        self.receiver = BucketReceiver(self.weights)

    @property
    def weight_version(self) -> int:
        return self.weights.version

    def update_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> WeightsAck:
        """Load weights ``version`` (refuses older ones; see ``workers.weight_sync``)."""
        return self.weights.update(version, state_dict)

    def receive_weight_bucket(
        self, version: int, index: int, count: int, bucket: bytes
    ) -> WeightsAck | None:
        """Refit bucket by bucket (``workers.weight_transport``); the last one acks."""
        return self.receiver.receive(version, index, count, bucket)

    def close(self) -> None:
        """Nothing to free: the model lives in this process (an engine overrides this)."""

    def generate_group(
        self,
        group_id: str,
        prompt: Example,
        n: int,
        sampling: SamplingSection,
        seed: int,
        attempt: int = 0,
    ) -> GroupResult:
        if isinstance(self.task, (EpisodeTask, AgentTask)):  # multi-turn: episodes
            from workers.envs.group import generate_episode_group

            keys = [row_key(self.run_id, group_id, attempt, i) for i in range(n)]
            return GroupResult(**generate_episode_group(
                self, keys, group_id, prompt, n, sampling, seed, attempt))
        prompt_ids = self.prompt_ids(prompt, sampling)
        step = 0

        def boundary() -> None:
            nonlocal step
            if self.on_step is not None:
                self.on_step(step)
            step += 1
            self.weights.at_step_boundary()
            self.simulated_decode(prompt, sampling)  # the next token's time

        start = self.weights.begin_group()
        try:
            # a token's simulated time comes before it (as a real step's compute does), so a
            # refit that lands meanwhile is the version that samples it, and the last token
            # carries the version of the group's end (``InflightRunner._run`` does the same)
            self.simulated_decode(prompt, sampling)
            completions = sample(
                self.model,
                prompt_ids,
                n,
                sampling,
                torch.Generator().manual_seed(seed),
                self.tokenizer.eos_id,
                use_cache=self.use_cache,
                between_steps=boundary,
                version=lambda: self.weights.version,
            )
        finally:
            self.weights.end_group()
        return self.store_group(group_id, attempt, prompt, prompt_ids, completions, start)

    #: longest sleep of :meth:`simulated_decode` between two chances for a refit to land
    DECODE_SLICE_S = 0.002

    def simulated_decode(self, example: Example, sampling: SamplingSection) -> None:
        """A task that simulates a slower model (``step_latency_s``, benchmarks only) adds
        that time before each token step, in slices between which a pending refit lands,
        as it would between the tokens of a real model that slow. Every path spends it
        once per token step (``tests/unit/test_inflight.py``), so modes compare fairly."""
        if not isinstance(self.task, SimulatesDecode):
            return
        left = float(self.task.step_latency_s(example, sampling.max_new_tokens))
        while left > 0:
            time.sleep(min(left, self.DECODE_SLICE_S))
            left -= self.DECODE_SLICE_S
            self.weights.at_step_boundary()

    @contextmanager
    def session(self) -> Iterator[None]:
        """Around a partial-rollout call's work (the vLLM generator serialises it)."""
        yield

    def prompt_ids(self, prompt: Example, sampling: SamplingSection) -> list[int]:
        """The prompt's token ids, refused before sampling if prompt + budget do not fit."""
        check_prompts_fit([prompt], self.tokenizer.encode, self.context_len, sampling.max_new_tokens)
        return self.tokenizer.encode(prompt.prompt)

    @property
    def context_len(self) -> int:
        """Longest prompt + completion the model takes."""
        return context_len(self.model)

    def new_decoder(
        self,
        prompt_ids: list[int],
        n: int,
        sampling: SamplingSection,
        seed: int,
        prefixes: list[RowPrefix] | None,
    ) -> Decoder:
        """A step-at-a-time decoder of one group (``workers.generator.inflight``)."""
        return Decoder(
            self.model, prompt_ids, n, sampling, torch.Generator().manual_seed(seed),
            self.tokenizer.eos_id, use_cache=self.use_cache, kv_on_refit=self.kv_on_refit,
            prefixes=prefixes,
        )

    def store_group(
        self,
        group_id: str,
        attempt: int,
        prompt: Example,
        prompt_ids: list[int],
        completions: list[Completion],
        version: int,
    ) -> GroupResult:
        """Score the completions and write the group's final rows (``version`` stands
        for the tokens' version where a completion did not record it)."""
        where = f"task {self.task.name!r}"
        rewards = [
            checked_reward(where, self.task.reward(prompt, self.tokenizer.decode(c.tokens),
                                                   c.stopped))
            for c in completions
        ]
        rows = [make_row(prompt_ids, c, r, version) for c, r in zip(completions, rewards)]
        runs = [version_runs(row["token_versions"][len(prompt_ids):].tolist()) for row in rows]
        seen = [v for run in runs for v in run[0::2] if v >= 0] or [version]
        start, end = min(seen), max(seen)
        keys = [row_key(self.run_id, group_id, attempt, i) for i in range(len(rows))]
        tag = {"group": group_id, "attempt": attempt, "v_start": start, "v_end": end}
        self.dataplane.put(self.run_id, keys, rows, [dict(tag, sample=i) for i in range(len(rows))])
        return GroupResult(
            group_id=group_id,
            attempt=attempt,
            partition=self.run_id,
            keys=keys,
            rewards=rewards,
            completion_lens=[len(c.tokens) for c in completions],
            prompt_len=len(prompt_ids),
            weight_version_start=start,
            weight_version_end=end,
            version_runs=runs,
        )
