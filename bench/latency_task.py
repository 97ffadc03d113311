"""A task wrapper that adds the latencies a real rollout has and the tiny model lacks.

The tiny CPU model decodes a group in milliseconds, and its completions are all about
``max_new_tokens`` long, so on its own it cannot show what asynchrony buys. Real RL
post-training has two latencies that this wrapper *simulates* (both are sleeps, which
release the CPU as a remote inference server or a remote judge would):

1. **Long-tail decode time.** Completion lengths of reasoning models are heavy-tailed:
   most groups are short, a few run to the token budget. Every prompt draws a
   would-be completion length ``L`` (capped at ``max_tokens``); every completion of it
   varies by +-25 % around that, and costs ``L * decode_s_per_token``. The draw is a
   pure function of the prompt text and ``seed``, so two runs over the same prompts see
   the same tail. ``length_dist`` picks its law, both with median ``median_tokens``:

   * ``"lognormal"``: ``L = median_tokens * exp(sigma_tokens * z)``, z standard normal
     (sigma 1.5: 6 % of prompts beyond 10x the median, 1 % beyond 33x);
   * ``"pareto"``: ``P(L > x) = (x_m / x)^alpha`` above ``x_m = median_tokens /
     2^(1/alpha)``, a power law: with ``alpha = 1.2``, 3.2 % of prompts beyond 10x the
     median, 0.2 % beyond 100x, 0.014 % beyond 1000x -- where a lognormal's tail has
     long died out (reasoning traces that run to the budget).

   ``sigma_tokens`` 0 gives every prompt the median (no tail) with either law.
2. **Environment / reward latency.** Each completion's reward call sleeps
   ``lognormal(log(judge_median_s), judge_sigma)`` seconds, like a code sandbox or
   an LLM judge; seeded by (prompt, completion, ``seed``).

The reward itself is the wrapped task's (``reverse`` by default), unchanged. Use it as
a plugin task, ``bench.latency_task:LatencyTask``, with options passed through
``WorkerSpec.task_options``.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from dataclasses import dataclass, field

from workers.tasks import Example, Task, make_task


def _rng(*parts: object) -> random.Random:
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


@dataclass
class LatencyTask:
    """``base`` with simulated long-tail decode time and reward-call latency."""

    name = "bench.latency_task:LatencyTask"
    base: str = "reverse"
    #: median would-be completion length (tokens) and the lognormal's sigma (tail weight)
    median_tokens: float = 64.0
    sigma_tokens: float = 1.0
    max_tokens: int = 2048
    #: the law of the lengths: "lognormal" (sigma_tokens) or "pareto" (alpha)
    length_dist: str = "lognormal"
    alpha: float = 1.2
    #: simulated decode time per token of a remote inference server
    decode_s_per_token: float = 2e-5
    #: per-completion reward/environment call: lognormal median and sigma
    judge_median_s: float = 0.003
    judge_sigma: float = 0.5
    seed: int = 0
    #: spend the decode time inside generation, after each real token step (so a refit
    #: can land in the middle of a long completion), instead of in the reward call
    decode_in_steps: bool = False
    _task: Task = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.median_tokens <= 0 or self.max_tokens < 1:
            raise ValueError("LatencyTask: median_tokens must be > 0 and max_tokens >= 1")
        if min(self.sigma_tokens, self.decode_s_per_token, self.judge_median_s, self.judge_sigma) < 0:
            raise ValueError("LatencyTask: sigmas, per-token time and judge median must be >= 0")
        if self.length_dist not in ("lognormal", "pareto") or self.alpha <= 0:
            raise ValueError(f"LatencyTask: length_dist must be 'lognormal' or 'pareto' and alpha "
                             f"> 0, got {self.length_dist!r}, {self.alpha}")
        self._task = make_task(self.base)

    def examples(self, count: int, seed: int) -> list[Example]:
        return self._task.examples(count, seed)

    def prompt_tokens(self, example: Example) -> int:
        """The would-be completion length of this prompt (its place in the long tail)."""
        rng = _rng("len", self.seed, example.prompt)
        if self.sigma_tokens == 0:
            scale = 1.0
        elif self.length_dist == "pareto":  # inverse CDF, u in (0, 1]; the median at u = 1/2
            scale = (2 * (1.0 - rng.random())) ** (-1 / self.alpha)
        else:
            scale = math.exp(self.sigma_tokens * rng.gauss(0.0, 1.0))
        return min(self.max_tokens, max(1, round(self.median_tokens * scale)))

    def latency_s(self, example: Example, completion: str) -> float:
        """Simulated decode + reward-call time of one completion (deterministic)."""
        rng = _rng("call", self.seed, example.prompt, completion)
        tokens = self.prompt_tokens(example) * rng.uniform(0.75, 1.25)
        judge = self.judge_median_s * math.exp(self.judge_sigma * rng.gauss(0.0, 1.0))
        return (0.0 if self.decode_in_steps else tokens * self.decode_s_per_token) + judge

    def step_latency_s(self, example: Example, max_steps: int) -> float:
        """With ``decode_in_steps``: the group's decode time, spread over the real token
        steps (the generator sleeps it before each; ``Generator.simulated_decode``)."""
        if not self.decode_in_steps:
            return 0.0
        return self.prompt_tokens(example) * self.decode_s_per_token / max(1, max_steps)

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        time.sleep(self.latency_s(example, completion))  # releases the CPU, as a remote call does
        return self._task.reward(example, completion, stopped)
