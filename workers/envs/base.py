"""The environment interface for multi-turn episodes.

An episode alternates model turns and environment steps::

    reset(key turn 0) -> first observation (the prompt)
    model turn 1 -> step(action, key turn 1) -> observation, reward, done
    model turn 2 -> step(action, key turn 2) -> ...            until done

Every step carries an idempotency key (run, group, sample, turn; plus ``restart`` once
the episode was started over). An environment declares whether it deduplicates by that
key (``dedupes_by_key``): one that does executes a step's side effects at most once per
key, however often the step is re-issued after a crash; one that does not is never
re-issued a step whose outcome was lost (the episode starts over, with new keys). The
capability is declared, never probed.

After a crash an episode resumes at its last recorded turn in a *fresh* instance
(``docs/agents.md``): ``reset`` runs again (it must be deterministic given the example
and free of side effects outside the instance), and the recorded steps are brought
back into the instance without being made again -- by its own ``restore_step``
(:class:`RestoresState`: TextArena re-applies the moves to a new game), or, for an
environment that deduplicates by key and has no ``restore_step``, by re-issuing them
with their keys (a pure environment such as the calculator just recomputes them).

Observations are text or token ids. Text is encoded once, when the runner appends it;
token ids are appended as they are (an environment that speaks the model's tokenizer
controls its tokens exactly).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from workers.errors import GroupError
from workers.tasks.base import UnknownTaskError


@dataclass(frozen=True, order=True)
class StepKey:
    """The idempotency key of one turn of one episode."""

    run: str
    group: str
    sample: int
    turn: int
    #: times the sample's episode was started over (its calls are then new calls)
    restart: int = 0

    def __str__(self) -> str:
        again = f".r{self.restart}" if self.restart else ""
        return f"{self.run}/{self.group}/s{self.sample}{again}/t{self.turn}"

    def at(self, turn: int) -> StepKey:
        return StepKey(self.run, self.group, self.sample, turn, self.restart)


@dataclass(frozen=True)
class Observation:
    """What the environment shows the model: text, or token ids; exactly one of them."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("an Observation holds exactly one of text or token_ids")


@dataclass(frozen=True)
class Action:
    """One model turn as the environment receives it."""

    #: the turn's decoded text (EOS excluded)
    text: str
    #: the exact ids the model generated (EOS included when it stopped)
    token_ids: tuple[int, ...]
    #: True when the model ended the turn with EOS, False when it ran out of tokens
    stopped: bool


@dataclass(frozen=True)
class EnvStep:
    """The outcome of one ``step``."""

    observation: Observation
    #: this step's reward (the episode's return is the sum over steps)
    reward: float
    #: True when the episode is over (the observation is then not shown to the model)
    done: bool
    #: JSON-compatible details (e.g. ``error``: why a tool call was refused)
    info: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment. A new instance per episode."""

    #: declared capability: ``step`` runs a key's side effects at most once
    dedupes_by_key: bool

    def reset(self, key: StepKey) -> Observation:
        """Start the episode (its key is turn 0); returns the first observation."""
        ...

    def step(self, action: Action, key: StepKey) -> EnvStep:
        """Apply the model's turn ``key.turn``; returns what follows it."""
        ...


@runtime_checkable
class RestoresState(Protocol):
    """An environment that can take a recorded step back without making it again."""

    def restore_step(self, action: Action, recorded: EnvStep, key: StepKey) -> Observation | None:
        """Bring this instance (reset, then restored up to ``key.turn - 1``) to the state
        after ``action``, whose result the log recorded, with no side effect outside the
        instance. Returns the observation the re-applied step shows, which the caller
        checks against the recorded one (a replay that reached another state fails the
        episode); None when the instance has no observation to show without an effect."""
        ...


class EnvError(GroupError, RuntimeError):
    """An environment failed; the message names the environment and the step."""


class UnknownEnvError(UnknownTaskError):
    """An environment or dataset name that no adapter knows (the message lists them)."""


class ToolCallParseError(ValueError):
    """A tool call that does not parse; the message quotes it and says what was expected."""
