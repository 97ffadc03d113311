"""Simulated generators running multi-turn episodes: calls that return at every pause.

The same contract as ``workers.generator.episodes`` (``docs/agents.md``), in virtual
time, without a model or an environment. A group's generation time T (the timings'
draw) is spread over its ``turns`` turns; each turn spends ``1 - env_share`` of its time
sampling and ``env_share`` in the env call. Every turn pauses twice, as the durable
recorder does:

* the model turn is written: its segments (one per sample, at the version in force when
  the turn began) and the intent of its calls (``EnvStepsRequested``);
* the calls returned: their results (``EnvStepsCompleted``) and the observation
  segments that follow them (none after the last turn, which ends the episode).

So a 10-turn group appends 40 episode events besides its admission and commit: the
log a real run of the same shape writes. Every sample plays every turn with the same
lengths (``model_tokens``, ``observation_tokens``); its per-turn reward is its group
reward over ``turns``, and the committed reward is their sum in turn order (the core
checks it exactly).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from events.schema import EnvCall, EnvResult, Segment
from sim.workers import Fleet
from workers.api import EpisodeFlush, GenerationOutcome, GenerationRequest, SegmentFlush

ENV = "sim-episodes"


@dataclass
class _Episode:
    attempt: int
    rewards: list[float]
    #: virtual seconds of one turn
    turn_s: float
    #: pauses taken (2 per turn); when the next one comes (None: not resumed yet)
    pauses: int = 0
    due: float | None = None
    #: the oldest and newest model token versions
    oldest: int | None = None
    newest: int = 0


class SimEpisodeGenerator:
    """A generator whose calls end at their groups' next pause (see the module docstring)."""

    def __init__(self, name: str, fleet: Fleet, turns: int, *, model_tokens: int = 32,
                 observation_tokens: int = 16, env_share: float = 0.2) -> None:
        if turns < 1 or not 0.0 < env_share < 1.0:
            raise ValueError(f"sim episodes: turns {turns} must be >= 1, env_share "
                             f"{env_share} in (0, 1)")
        self.name, self.fleet, self.turns = name, fleet, turns
        self.model_tokens, self.observation_tokens, self.env_share = model_tokens, observation_tokens, env_share
        self.held: dict[str, _Episode] = {}

    def generate(self, requests: list[GenerationRequest]) -> asyncio.Future:
        with self.fleet.loop.uncharged():
            fut = self.fleet.loop.create_future()
            self.fleet.calls += 1
            for r in requests:
                self._hold(r)
            self._wait(fut, requests, [])
        return fut

    def _wait(self, fut: asyncio.Future, reqs: list[GenerationRequest], outs: list[GenerationOutcome]) -> None:
        """As the real worker's call: the groups in order, each up to its next pause (the
        later ones go on in virtual time meanwhile); a finished group lets the call go
        on to the next, a pause ends it and the rest come back pending."""
        loop, ep = self.fleet.loop, self.held[reqs[len(outs)].group_id]
        loop.call_later(max(0.0, (ep.due or 0.0) - loop.time()), self._resolve, fut, reqs, outs)

    def _resolve(self, fut: asyncio.Future, reqs: list[GenerationRequest], outs: list[GenerationOutcome]) -> None:
        if fut.done():
            return  # cancelled (the run stopped)
        with self.fleet.loop.uncharged():
            req = reqs[len(outs)]
            outs.append(self._pause(req, self.held[req.group_id]))
            if outs[-1].status == "done" and len(outs) < len(reqs):
                self._wait(fut, reqs, outs)
                return
            pending = GenerationOutcome(payload_keys=[], rewards=[], lengths=[], weight_version_start=0,
                                        weight_version_end=0, status="pending")
            fut.set_result(outs + [pending] * (len(reqs) - len(outs)))

    def _hold(self, req: GenerationRequest) -> _Episode:
        ep = self.held.get(req.group_id)
        fleet = self.fleet
        if ep is None or ep.attempt != req.attempt:  # a new group, or a new attempt
            duration = fleet.timings.generation_s(req.group_id, req.attempt)
            fleet.generator_busy_s += duration
            fleet.groups += 1
            rewards = fleet.timings.group_rewards(req.group_id, req.n_samples)
            ep = self.held[req.group_id] = _Episode(req.attempt, rewards, duration / self.turns)
        if ep.due is None:  # it goes on once its last pause is recorded: now
            if ep.pauses == 2 * self.turns:
                share = 0.0  # the episode ended with its last results: the call commits it
            else:
                share = self.env_share if ep.pauses % 2 else 1.0 - self.env_share
            ep.due = fleet.loop.time() + ep.turn_s * share
        return ep

    def _pause(self, req: GenerationRequest, ep: _Episode) -> GenerationOutcome:
        if ep.pauses == 2 * self.turns:
            return self._done(req, ep)
        turn, n = ep.pauses // 2 + 1, len(ep.rewards)
        start = (turn - 1) * (self.model_tokens + self.observation_tokens)
        last = turn == self.turns
        ep.pauses, ep.due = ep.pauses + 1, None
        if ep.pauses % 2:  # the model turn, and the intent of its calls
            v = self.fleet.weight_version
            ep.oldest, ep.newest = (v if ep.oldest is None else ep.oldest), v
            segs = [Segment(sample=i, start=start, length=self.model_tokens, turn=turn, stopped=last,
                            key=f"seg:{req.group_id}/a{req.attempt}/s{i}/t{turn}") for i in range(n)]
            calls = [EnvCall(sample=i, turn=turn, request=f"{req.group_id}/{i}/{turn}") for i in range(n)]
            flush = EpisodeFlush(env=ENV, dedupes_by_key=True, segments=[SegmentFlush(
                kind="model", weight_version=v, segments=segs)], requested=calls)
        else:  # the calls returned (and, unless the episode ended, their observations)
            results = [EnvResult(sample=i, turn=turn, reward=ep.rewards[i] / self.turns, ended=last,
                                 end_reason="done" if last else "",
                                 observation_tokens=0 if last else self.observation_tokens)
                       for i in range(n)]
            obs = [] if last else [SegmentFlush(kind="observation", weight_version=None, segments=[
                Segment(sample=i, start=start + self.model_tokens, length=self.observation_tokens,
                        turn=turn, key=f"obs:{req.group_id}/a{req.attempt}/s{i}/t{turn}")
                for i in range(n)])]
            flush = EpisodeFlush(env=ENV, dedupes_by_key=True, completed=results, segments=obs)
        return GenerationOutcome(payload_keys=[], rewards=[], lengths=[], weight_version_start=0,
                                 weight_version_end=0, status="flushed", episode=flush)

    def _done(self, req: GenerationRequest, ep: _Episode) -> GenerationOutcome:
        del self.held[req.group_id]
        n, t = len(ep.rewards), self.turns
        length = t * self.model_tokens + (t - 1) * self.observation_tokens
        return GenerationOutcome(
            payload_keys=[f"{req.group_id}/{req.attempt}/{i}" for i in range(n)],
            # the sum of the turns' rewards, in turn order, as the core adds them up
            rewards=[sum([r / t] * t) for r in ep.rewards], lengths=[length] * n,
            weight_version_start=ep.oldest or 0, weight_version_end=ep.newest,
        )
