"""Built-in tasks with verifiable, deterministic rewards.

All use :func:`shaped_match_reward` (per-character partial credit plus a bonus for
stopping with EOS at the right length), so a randomly initialised model scores about
0.02 and GRPO has signal from the first step.

* ``reverse`` (default): ``"abc>"`` -> ``"cba"``; 3 letters from ``"abcd"``.
* ``copy``: ``"abc>"`` -> ``"abc"``; easier (no position reversal).
* ``addition``: ``"47+38="`` -> ``"85"``; two-digit operands, harder.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from workers.tasks.base import Example, register_task, shaped_match_reward

#: the task a run uses when its config names none
DEFAULT_TASK = "reverse"


class _MatchTask:
    name = ""

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        return shaped_match_reward(completion, example.answer, stopped)


@dataclass(frozen=True)
class _LetterTask(_MatchTask):
    #: letters per prompt
    length: int = 3
    #: letters the prompt is drawn from
    alphabet: str = "abcd"

    def __post_init__(self) -> None:
        if self.length < 1 or not self.alphabet:
            raise ValueError(f"{self.name}: length must be >= 1 and alphabet non-empty")

    def _target(self, letters: str) -> str:
        raise NotImplementedError

    def examples(self, count: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        out = []
        for _ in range(count):
            letters = "".join(rng.choice(self.alphabet) for _ in range(self.length))
            out.append(Example(prompt=f"{letters}>", answer=self._target(letters)))
        return out


@register_task("reverse")
@dataclass(frozen=True)
class ReverseTask(_LetterTask):
    """Reverse a short string of letters."""

    name = "reverse"

    def _target(self, letters: str) -> str:
        return letters[::-1]


@register_task("copy")
@dataclass(frozen=True)
class CopyTask(_LetterTask):
    """Copy a short string of letters."""

    name = "copy"

    def _target(self, letters: str) -> str:
        return letters


@register_task("addition")
@dataclass(frozen=True)
class AdditionTask(_MatchTask):
    """Add two non-negative integers of ``digits`` digits each."""

    name = "addition"
    digits: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 9:
            raise ValueError(f"addition: digits must be in 1..9, got {self.digits}")

    def examples(self, count: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        hi = 10**self.digits - 1
        out = []
        for _ in range(count):
            a, b = rng.randint(0, hi), rng.randint(0, hi)
            out.append(Example(prompt=f"{a}+{b}=", answer=str(a + b)))
        return out
