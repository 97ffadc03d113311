"""How long simulated work takes: seeded distributions, or durations from a recorded log.

A ``Timings`` answers every duration the simulated workers need:

* ``generation_s(group_id, attempt)`` -- one group's generation (a call carrying several
  groups ends with its slowest);
* ``microbatch_s(step, index, num_sequences)`` / ``finish_s(step)`` -- the trainer;
* ``publish_s(version)`` -- moving new weights to the generators (refit);
* ``checkpoint_s(version)`` and ``release_s(version)`` (deleting the payload rows the
  checkpoint covers; the train pump waits for both);
* ``group_rewards(group_id, n)`` / ``group_lengths(group_id, n)`` -- what a group's
  samples scored and how long they were (only GRPO advantages and token counts use them).

Per-group values are a function of ``(seed, group_id)`` alone, never of call order: the
same group takes the same time under every window, policy and number of generators,
so two simulated settings differ only by what the controller decided.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Protocol


class Timings(Protocol):
    def generation_s(self, group_id: str, attempt: int) -> float: ...
    def microbatch_s(self, step: int, index: int, num_sequences: int) -> float: ...
    def finish_s(self, step: int) -> float: ...
    def publish_s(self, version: int) -> float: ...
    def checkpoint_s(self, version: int) -> float: ...
    def release_s(self, version: int) -> float: ...
    def group_rewards(self, group_id: str, n: int) -> list[float]: ...
    def group_lengths(self, group_id: str, n: int) -> list[int]: ...


def _rng(seed: int, *key: object) -> random.Random:
    # String seeds hash with SHA-512: stable across processes and Python versions.
    return random.Random(":".join(map(str, (seed, *key))))


@dataclass(frozen=True)
class Lognormal:
    """Lognormal seconds with this median; ``sigma`` is the log-space spread (the tail)."""

    median_s: float
    sigma: float = 0.0
    #: no draw is longer (a max_response_length cuts the tail); None = no cap
    cap_s: float | None = None

    def draw(self, rng: random.Random) -> float:
        value = self.median_s
        if self.sigma > 0:
            value *= math.exp(rng.gauss(0.0, self.sigma))
        return value if self.cap_s is None else min(value, self.cap_s)

    @property
    def mean_s(self) -> float:
        return self.median_s * math.exp(self.sigma**2 / 2)


@dataclass(frozen=True)
class Pareto:
    """Pareto seconds with this median and shape ``alpha`` (a heavier tail than any
    lognormal: P(X > x) = (x_m / x)^alpha above the scale x_m = median / 2^(1/alpha);
    at alpha 1.2 one draw in 30 exceeds 10x the median and one in 500 exceeds 100x).
    ``cap_s`` cuts the tail as a max_response_length does."""

    median_s: float
    alpha: float = 1.5
    cap_s: float | None = None

    def __post_init__(self) -> None:
        if self.median_s <= 0 or self.alpha <= 0:
            raise ValueError(f"Pareto needs median_s > 0 and alpha > 0, got {self}")

    @property
    def scale_s(self) -> float:
        return self.median_s / 2 ** (1 / self.alpha)

    def draw(self, rng: random.Random) -> float:
        value = self.scale_s * (1.0 - rng.random()) ** (-1 / self.alpha)
        return value if self.cap_s is None else min(value, self.cap_s)

    @property
    def mean_s(self) -> float:
        """E[min(X, cap)] (infinite for alpha <= 1 without a cap)."""
        xm, a, cap = self.scale_s, self.alpha, self.cap_s
        if cap is None:
            return xm * a / (a - 1) if a > 1 else math.inf
        if cap <= xm:
            return cap
        if a == 1:
            return xm * (1 + math.log(cap / xm))
        return xm * a / (a - 1) - xm**a * cap ** (1 - a) / (a - 1)


@dataclass(frozen=True)
class SyntheticTimings:
    """Durations from distributions, seeded per group / per step."""

    generation: Lognormal | Pareto
    #: trainer time per sequence of a microbatch (plus ``microbatch_fixed_s`` per call)
    train_per_sequence_s: float
    microbatch_fixed_s: float = 0.0
    finish: float = 0.0
    publish: float = 0.0
    checkpoint: float = 0.0
    release: float = 0.0
    seed: int = 0
    tokens_per_sample: int = 256
    #: long-tailed lengths: a group's completions are ``tokens_per_sample`` x its
    #: generation time / the median (decode time grows with length), not all equal
    lengths_follow_time: bool = False

    def generation_s(self, group_id: str, attempt: int) -> float:
        return self.generation.draw(_rng(self.seed, "gen", group_id, attempt))

    def microbatch_s(self, step: int, index: int, num_sequences: int) -> float:
        return self.microbatch_fixed_s + self.train_per_sequence_s * num_sequences

    def finish_s(self, step: int) -> float:
        return self.finish

    def publish_s(self, version: int) -> float:
        return self.publish

    def checkpoint_s(self, version: int) -> float:
        return self.checkpoint

    def release_s(self, version: int) -> float:
        return self.release

    def group_rewards(self, group_id: str, n: int) -> list[float]:
        rng = _rng(self.seed, "reward", group_id)
        return [float(rng.random() < 0.5) for _ in range(n)]

    def group_lengths(self, group_id: str, n: int) -> list[int]:
        if not self.lengths_follow_time:
            return [self.tokens_per_sample] * n
        scale = self.generation_s(group_id, 1) / self.generation.median_s
        return [max(1, round(self.tokens_per_sample * scale))] * n


@dataclass
class RecordedTimings:
    """Durations taken from a recorded run (``sim.recorded.extract``).

    Groups and steps the recorded run never had (a what-if may admit more groups, or
    train more microbatches per step) draw from the recorded values, seeded by their id.
    """

    generation: dict[str, float]
    rewards: dict[str, list[float]]
    lengths: dict[str, list[int]]
    #: step -> [microbatch seconds, ...]; the first includes begin_train_step
    microbatches: dict[int, list[float]]
    finish: dict[int, float]
    #: trainer_version -> seconds
    publish: dict[int, float]
    checkpoint: dict[int, float]
    #: trainer_version of the checkpoint -> seconds its payload release took
    release: dict[int, float] = field(default_factory=dict)
    #: groups admitted but not committed when the recorded log ends -> the seconds they
    #: had run by then: a drawn time is at least that (the recorded run proves it)
    unfinished: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    _pools: dict[str, list] = field(default_factory=dict, repr=False)

    def _pool(self, name: str, values) -> list:
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = sorted(values) if name != "rewards" else list(values)
        return pool

    def _fallback(self, name: str, values, *key: object):
        pool = self._pool(name, values)
        if not pool:
            return 0.0
        return _rng(self.seed, name, *key).choice(pool)

    def generation_s(self, group_id: str, attempt: int) -> float:
        value = self.generation.get(group_id)
        if value is None:
            value = self._fallback("generation", self.generation.values(), group_id, attempt)
            value = max(value, self.unfinished.get(group_id, 0.0))
        return value

    def microbatch_s(self, step: int, index: int, num_sequences: int) -> float:
        recorded = self.microbatches.get(step)
        if recorded is not None and index < len(recorded):
            return recorded[index]
        every = (d for ds in self.microbatches.values() for d in ds)
        return self._fallback("microbatch", every, step, index)

    def finish_s(self, step: int) -> float:
        value = self.finish.get(step)
        return self._fallback("finish", self.finish.values(), step) if value is None else value

    def publish_s(self, version: int) -> float:
        value = self.publish.get(version)
        return self._fallback("publish", self.publish.values(), version) if value is None else value

    def checkpoint_s(self, version: int) -> float:
        value = self.checkpoint.get(version)
        if value is None:
            value = self._fallback("checkpoint", self.checkpoint.values(), version)
        return value

    def release_s(self, version: int) -> float:
        value = self.release.get(version)
        return self._fallback("release", self.release.values(), version) if value is None else value

    def group_rewards(self, group_id: str, n: int) -> list[float]:
        value = self.rewards.get(group_id)
        if value is None or len(value) != n:
            value = self._fallback("rewards", self.rewards.values(), group_id) or [0.0] * n
            value = (list(value) * n)[:n] if value else [0.0] * n
        return list(value)

    def group_lengths(self, group_id: str, n: int) -> list[int]:
        value = self.lengths.get(group_id)
        if value is None or len(value) != n:
            pool = [x for ls in self.lengths.values() for x in ls] or [1]
            rng = _rng(self.seed, "lengths", group_id)
            value = [rng.choice(pool) for _ in range(n)]
        return list(value)
