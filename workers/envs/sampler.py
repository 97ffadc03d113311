"""The model side of an episode: turn requests in, sampled turns out.

:class:`TorchTurnSampler` serves a batch of :class:`TurnRequest` with
``workers.models.decoder.sample``: requests whose context ids are identical (every
sample's first turn of a group) are sampled together as one batch of ``n``; requests
of equal context length are sampled as one batch, a row per context. A caller-owned ``torch.Generator`` keeps it deterministic given the
weights, the seed and the order of the requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import torch
from torch import nn

from workers.envs.recorder import ModelTurn, TurnRequest
from workers.models.config import SamplingSection
from workers.models.decoder import sample


class TurnSampler(Protocol):
    """Generates model turns (the generator's model, or a remote one)."""

    def generate(self, requests: Sequence[TurnRequest]) -> list[ModelTurn]: ...


@dataclass
class TorchTurnSampler:
    """Model turns from a torch model, KV-cached, batched by context length."""

    model: nn.Module
    eos_id: int
    sampling: SamplingSection
    generator: torch.Generator
    #: the weight version in force (read at each turn's start and end)
    version: Callable[[], int] = lambda: 0
    #: called between token steps (the generator applies pending refits there)
    between_steps: Callable[[], None] | None = None
    use_cache: bool = True

    def generate(self, requests: Sequence[TurnRequest]) -> list[ModelTurn]:
        batches: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(requests):
            batches.setdefault((len(r.context), r.max_new_tokens), []).append(i)
        out: list[ModelTurn | None] = [None] * len(requests)
        for (_, budget), members in batches.items():
            cfg = msgspec.structs.replace(self.sampling, max_new_tokens=budget)
            start = self.version()
            contexts = [list(requests[i].context) for i in members]
            # one prompt repeated, or one row per context (equal lengths: no padding)
            prompt = contexts[0] if all(c == contexts[0] for c in contexts) else contexts
            completions = sample(
                self.model, prompt, len(members), cfg, self.generator, self.eos_id,
                use_cache=self.use_cache, between_steps=self.between_steps,
                version=self.version,
            )
            end = self.version()
            for i, c in zip(members, completions):
                versions = () if c.versions is None else tuple(int(v) for v in c.versions.tolist())
                out[i] = ModelTurn(
                    tokens=tuple(c.tokens),
                    logprobs=tuple(float(x) for x in c.logprobs.tolist()),
                    stopped=c.stopped,
                    version_start=min(versions, default=start),
                    version_end=max(versions, default=end),
                    versions=versions,
                )
        return [t for t in out if t is not None]


@dataclass
class HoldingWeights:
    """A sampler that marks the generator's weights in use while it samples (and only
    then: an episode paused between turns, or an idle endpoint, lets a refit land)."""

    sampler: TurnSampler
    #: ``workers.weight_sync.VersionedWeights``
    weights: Any

    def generate(self, requests: Sequence[TurnRequest]) -> list[ModelTurn]:
        self.weights.begin_group()
        try:
            return self.sampler.generate(requests)
        finally:
            self.weights.end_group()


def generator_sampler(gen: Any, sampling: SamplingSection, seed: int) -> TorchTurnSampler:
    """A sampler over a ``workers.generator.Generator``'s model and weights: each turn
    reads the version in force, and a refit lands between its token steps."""
    return TorchTurnSampler(
        gen.model, gen.tokenizer.eos_id, sampling, torch.Generator().manual_seed(seed),
        version=lambda: gen.weights.version, between_steps=gen.weights.at_step_boundary,
        use_cache=gen.use_cache,
    )
