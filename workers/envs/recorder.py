"""The turn recorder: the one door every model turn and every env step passes through.

The episode runner never calls the sampler or an environment directly; it asks the
recorder, handing it the call to make. A recorder that has seen the key before answers
from its record and makes no call; otherwise it makes the call and records the
outcome. That is the shape of durable execution (Temporal, Restate): the in-memory
recorder here keeps its record in a dict; the durable one (``workers.envs.durable``)
keeps it in the event log -- a model turn as segments, an intent before the env calls
of a turn and their results after -- and so survives a crash of any process.

Replay must be faithful: a recorded key asked again with a different request (other
context ids, another action) is a :class:`ReplayMismatchError`, never silently served
or re-run. Keys are ``StepKey`` (run, group, sample, turn); a model turn and the env
step that follows it share the turn number but are recorded under separate kinds.

A call the recorder cannot make itself -- an agent's tools, which the agent's own code
runs between two completions (``workers.envs.agent``) -- is recorded in two steps:
:meth:`TurnRecorder.env_requested` (the intent, before the completion goes back to the
agent) and :meth:`TurnRecorder.env_completed` (the result, once the agent's next
request, or its reward, says what it was). ``env_steps`` is exactly those two around
the call. A result completed again is checked against the recorded one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.envs.base import Action, Observation, StepKey


@dataclass(frozen=True)
class TurnRequest:
    """Ask the model for turn ``key.turn`` of an episode."""

    key: StepKey
    #: the exact ids the model continues (prompt, earlier turns, observations)
    context: tuple[int, ...]
    #: this turn's budget (the context window may leave less than the sampling budget)
    max_new_tokens: int


@dataclass(frozen=True)
class ModelTurn:
    """What the model produced for one request."""

    #: sampled ids, the EOS included when the model emitted one
    tokens: tuple[int, ...]
    #: log p(token | prefix) under the weights that produced it, one per token
    logprobs: tuple[float, ...]
    stopped: bool
    #: weight version when the turn started / finished (differ if a refit landed mid-turn)
    version_start: int
    version_end: int
    #: the version that sampled each token (empty: every token has ``version_start``)
    versions: tuple[int, ...] = ()

    def token_versions(self) -> tuple[int, ...]:
        return self.versions or (self.version_start,) * len(self.tokens)


@dataclass(frozen=True)
class StepOutcome:
    """What one env call did to its episode: the turn's reward and how it goes on."""

    reward: float
    #: the episode ends here (the env said done, or the turn budget or context ran out)
    ended: bool
    #: "done", "max_turns", "context"; "" while it goes on
    end_reason: str
    #: the observation's exact ids, appended after the turn (empty when it ended)
    observation: tuple[int, ...]
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepCall:
    """One env call as the runner hands it to the recorder."""

    key: StepKey
    action: Action
    #: fingerprint of the request (context and action): a replay must ask the same
    request: str
    #: make the call (the recorder calls it at most once, when nothing is recorded)
    run: Callable[[], StepOutcome]
    #: told of a recorded outcome it serves instead (the runner rebuilds the env's state)
    replayed: Callable[[StepOutcome], None] = lambda outcome: None


class ReplayMismatchError(RuntimeError):
    """A recorded key was asked again with a different request (non-deterministic agent)."""


class TurnRecorder(Protocol):
    """Records, and on replay serves, an episode's model turns and env steps."""

    def model_turns(
        self,
        requests: Sequence[TurnRequest],
        generate: Callable[[Sequence[TurnRequest]], list[ModelTurn]],
    ) -> list[ModelTurn]:
        """One turn per request; ``generate`` is called once, with the unrecorded ones."""
        ...

    def env_reset(self, key: StepKey, reset: Callable[[], Observation]) -> Observation: ...

    def env_steps(self, calls: Sequence[StepCall]) -> list[StepOutcome]:
        """One outcome per call: recorded ones are served (``replayed``), others run."""
        ...

    def env_requested(self, calls: Sequence[StepCall]) -> list[StepOutcome | None]:
        """Record the calls' intent (write-ahead: before anything acts on them); per
        call its recorded outcome (served: ``replayed`` is told), or None where the
        call is to be made and its result handed to :meth:`env_completed`."""
        ...

    def env_completed(self, results: Sequence[tuple[StepKey, StepOutcome]]) -> None:
        """Record the results of calls made outside the recorder; a result the record
        already holds must be the same (else :class:`ReplayMismatchError`)."""
        ...


def _agent_made(key: StepKey) -> StepOutcome:
    raise RuntimeError(f"call {key} is made by the agent, not by the recorder")


def external_call(key: StepKey, action: Action, request: str) -> StepCall:
    """A call whose result comes from outside the recorder (an agent's tools): it is
    recorded with :meth:`TurnRecorder.env_requested` and ``env_completed``, never run."""
    return StepCall(key, action, request, run=lambda: _agent_made(key))


def same_result(key: StepKey, recorded: StepOutcome, now: StepOutcome) -> None:
    """A result completed again must be the recorded one: the replayed agent sent back
    other messages (another observation), or returned another reward, than it did."""
    if (recorded.reward, recorded.ended, recorded.end_reason, tuple(recorded.observation),
            dict(recorded.info)) == (now.reward, now.ended, now.end_reason,
                                     tuple(now.observation), dict(now.info)):
        return
    what = ("the episode's end" if recorded.ended or now.ended else
            f"{len(now.observation)} observation ids")
    raise ReplayMismatchError(
        f"turn {key}: the replayed agent answered it otherwise than the recorded result "
        f"({what}, reward {now.reward}; the log has "
        f"{'the end' if recorded.ended else f'{len(recorded.observation)} observation ids'}, "
        f"reward {recorded.reward}, info {dict(recorded.info)} against {dict(now.info)}): "
        "agent code must send the same messages when it is replayed"
    )


def digest(*parts: object) -> str:
    """A short, stable fingerprint of a request (what replay compares)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\x00")
    return h.hexdigest()[:16]


@dataclass
class InMemoryTurnRecorder:
    """The non-durable recorder: a record per key, kept for the recorder's lifetime.

    ``calls`` counts what was actually executed (model turns generated, env resets and
    steps run): a replay through the same recorder leaves it unchanged.
    """

    turns: dict[StepKey, tuple[str, ModelTurn]] = field(default_factory=dict)
    resets: dict[StepKey, Observation] = field(default_factory=dict)
    #: each call's request fingerprint (its intent) and, once made, its outcome
    requests: dict[StepKey, str] = field(default_factory=dict)
    steps: dict[StepKey, StepOutcome] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=lambda: {"model": 0, "reset": 0, "step": 0})

    def model_turns(
        self,
        requests: Sequence[TurnRequest],
        generate: Callable[[Sequence[TurnRequest]], list[ModelTurn]],
    ) -> list[ModelTurn]:
        fresh = [r for r in requests if self._recorded_turn(r) is None]
        if fresh:
            made = generate(fresh)
            if len(made) != len(fresh):
                raise RuntimeError(f"sampler returned {len(made)} turns for {len(fresh)} requests")
            self.calls["model"] += len(fresh)
            for request, turn in zip(fresh, made):
                self.turns[request.key] = (digest(request.context, request.max_new_tokens), turn)
        out = []
        for r in requests:
            turn = self._recorded_turn(r)
            assert turn is not None
            out.append(turn)
        return out

    def _recorded_turn(self, request: TurnRequest) -> ModelTurn | None:
        record = self.turns.get(request.key)
        if record is None:
            return None
        if record[0] != digest(request.context, request.max_new_tokens):
            raise ReplayMismatchError(
                f"model turn {request.key}: the agent asked for a different turn than the "
                f"recorded one (context of {len(request.context)} ids differs)"
            )
        return record[1]

    def env_reset(self, key: StepKey, reset: Callable[[], Observation]) -> Observation:
        """Always runs: a reset builds the fresh instance's state (``workers.envs.base``);
        on replay it must show the recorded first observation again."""
        obs = reset()
        self.calls["reset"] += 1
        if self.resets.setdefault(key, obs) != obs:
            raise ReplayMismatchError(
                f"env reset {key}: the first observation differs from the recorded one "
                "(reset must be deterministic given the example)"
            )
        return obs

    def env_steps(self, calls: Sequence[StepCall]) -> list[StepOutcome]:
        out = []
        for call, served in zip(calls, self.env_requested(calls)):
            if served is None:
                served = call.run()
                self.calls["step"] += 1
                self.env_completed([(call.key, served)])
            out.append(served)
        return out

    def env_requested(self, calls: Sequence[StepCall]) -> list[StepOutcome | None]:
        out: list[StepOutcome | None] = []
        for call in calls:
            request = self.requests.setdefault(call.key, call.request)
            if request != call.request:
                raise ReplayMismatchError(
                    f"env step {call.key}: the agent sent a different request than the "
                    "recorded one"
                )
            outcome = self.steps.get(call.key)
            if outcome is not None:
                call.replayed(outcome)
            out.append(outcome)
        return out

    def forget(self, episode: StepKey) -> None:
        """Drop every record of ``episode``'s turns (its run, group and sample): an
        episode that can no longer be replayed through this recorder (its session ended)."""
        same = (episode.run, episode.group, episode.sample, episode.restart)
        for table in (self.turns, self.resets, self.steps):
            for key in [k for k in table if (k.run, k.group, k.sample, k.restart) == same]:
                del table[key]

    def env_completed(self, results: Sequence[tuple[StepKey, StepOutcome]]) -> None:
        for key, outcome in results:
            recorded = self.steps.setdefault(key, outcome)
            same_result(key, recorded, outcome)
