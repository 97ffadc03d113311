"""Simulated generators running multi-turn episodes: calls that return at every pause.

The same contract as ``workers.generator.episodes`` (``docs/agents.md``), in virtual
time, without a model or an environment. A group's generation time T (the timings'
draw) is spread over its ``turns`` turns; each turn spends ``1 - env_share`` of its time
sampling and ``env_share`` in the env call. The pauses are the durable recorder's:

* an env that cannot deduplicate (``dedupes_by_key=False``) pauses twice a turn: once
  the model turn is written (its segments, one per sample, at the version in force when
  the turn began, and the intent of its calls, ``EnvStepsRequested``), and once the
  calls returned (their results, ``EnvStepsCompleted``, and the observation segments
  that follow them; none after the last turn, which ends the episode);
* one that deduplicates (the default) pauses once a turn: turn t's results and
  observations ride with turn t + 1's model segments and intent, and the last results
  take one final pause.

Either way a 10-turn group appends 40 episode events besides its admission and commit:
the log a real run of the same shape writes. Every sample plays every turn with the same
lengths (``model_tokens``, ``observation_tokens``); its per-turn reward is its group
reward over ``turns``, and the committed reward is their sum in turn order (the core
checks it exactly). A re-admitted attempt resumes from what the log recorded
(``GenerationRequest.episode`` and ``resume``): with a deduplicating env its pending
calls are asked again first, with the same keys, then the turns go on.
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
    #: pauses taken (of ``SimEpisodeGenerator.plan``); when the next one comes (None: not
    #: resumed yet)
    pauses: int = 0
    due: float | None = None
    #: the oldest and newest model token versions
    oldest: int | None = None
    newest: int = 0
    #: a resumed attempt's calls asked for and never answered: asked again first
    reissue: list[EnvCall] | None = None


class SimEpisodeGenerator:
    """A generator whose calls end at their groups' next pause (see the module docstring)."""

    def __init__(self, name: str, fleet: Fleet, turns: int, *, model_tokens: int = 32,
                 observation_tokens: int = 16, env_share: float = 0.2,
                 dedupes_by_key: bool = True) -> None:
        if turns < 1 or not 0.0 < env_share < 1.0:
            raise ValueError(f"sim episodes: turns {turns} must be >= 1, env_share "
                             f"{env_share} in (0, 1)")
        self.name, self.fleet, self.turns = name, fleet, turns
        self.model_tokens, self.observation_tokens, self.env_share = model_tokens, observation_tokens, env_share
        self.dedupes_by_key = dedupes_by_key
        #: an episode's pauses in order: (share of a turn's time before it, the turn whose
        #: results it records (0: none), the model turn it records (0: none))
        s = env_share
        if dedupes_by_key:
            self.plan = ([(1.0 - s, 0, 1)] + [(1.0, t - 1, t) for t in range(2, turns + 1)]
                         + [(s, turns, 0)])
        else:
            self.plan = [p for t in range(1, turns + 1) for p in ((1.0 - s, 0, t), (s, t, 0))]
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
        loop.call_uncharged_later((ep.due or 0.0) - loop.time(), self._resolve, fut, reqs, outs)

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
            self._resume(ep, req)
        if ep.due is None:  # it goes on once its last pause is recorded: now
            # after the last pause the episode has ended: the call commits it
            share = self.plan[ep.pauses][0] if ep.pauses < len(self.plan) else 0.0
            ep.due = fleet.loop.time() + ep.turn_s * share
        return ep

    def _resume(self, ep: _Episode, req: GenerationRequest) -> None:
        """A re-admitted attempt goes on from what the log recorded, as the real runner
        does with a deduplicating env: its calls asked for and never answered are asked
        again at once, with the same keys, then the turns go on. (An env that cannot
        deduplicate has its episodes started over by the core: from the first pause.)"""
        rec = req.episode
        if rec is None or not rec.calls or not self.dedupes_by_key or any(rec.restarts):
            return
        versions = [f.weight_version for f in req.resume if f.kind == "model" and f.weight_version is not None]
        if versions:
            ep.oldest, ep.newest = min(versions), max(versions)
        # every sample plays the same turns: the first one's count stands for all
        asked = [c for c in rec.calls if c.call.sample == 0]
        answered = sum(c.result is not None for c in asked)
        ep.due = self.fleet.loop.time()
        if answered == len(asked):  # the last results are recorded: it has ended
            ep.pauses = len(self.plan)
            return
        ep.pauses = len(asked)  # the pause with the pending turn's results comes next
        ep.reissue = [c.call for c in rec.calls if c.result is None]

    def _pause(self, req: GenerationRequest, ep: _Episode) -> GenerationOutcome:
        if ep.pauses == len(self.plan):
            return self._done(req, ep)
        if ep.reissue:  # a resumed attempt asks again first (nothing else in that pause)
            calls, ep.reissue, ep.due = ep.reissue, None, None
            flush = EpisodeFlush(env=ENV, dedupes_by_key=self.dedupes_by_key, completed=[],
                                 segments=[], requested=calls)
            return GenerationOutcome(payload_keys=[], rewards=[], lengths=[], weight_version_start=0,
                                     weight_version_end=0, status="flushed", episode=flush)
        _, results_turn, model_turn = self.plan[ep.pauses]
        ep.pauses, ep.due = ep.pauses + 1, None
        results, segments, calls = [], [], []
        if results_turn:  # the calls returned (and, unless the episode ended, their observations)
            results, obs = self._results(req, ep, results_turn)
            segments += obs
        if model_turn:  # the model turn, and the intent of its calls
            v = self.fleet.weight_version
            ep.oldest, ep.newest = (v if ep.oldest is None else ep.oldest), v
            start = (model_turn - 1) * (self.model_tokens + self.observation_tokens)
            segments.append(SegmentFlush(kind="model", weight_version=v, segments=[
                Segment(sample=i, start=start, length=self.model_tokens, turn=model_turn,
                        stopped=model_turn == self.turns,
                        key=f"seg:{req.group_id}/a{req.attempt}/s{i}/t{model_turn}")
                for i in range(len(ep.rewards))]))
            calls = [EnvCall(sample=i, turn=model_turn, request=f"{req.group_id}/{i}/{model_turn}")
                     for i in range(len(ep.rewards))]
        flush = EpisodeFlush(env=ENV, dedupes_by_key=self.dedupes_by_key, completed=results,
                             segments=segments, requested=calls)
        return GenerationOutcome(payload_keys=[], rewards=[], lengths=[], weight_version_start=0,
                                 weight_version_end=0, status="flushed", episode=flush)

    def _results(self, req: GenerationRequest, ep: _Episode, turn: int) -> tuple[list[EnvResult], list[SegmentFlush]]:
        """Turn ``turn``'s results, and the observation segments after them."""
        last, n = turn == self.turns, len(ep.rewards)
        results = [EnvResult(sample=i, turn=turn, reward=ep.rewards[i] / self.turns, ended=last,
                             end_reason="done" if last else "",
                             observation_tokens=0 if last else self.observation_tokens)
                   for i in range(n)]
        if last:
            return results, []
        start = (turn - 1) * (self.model_tokens + self.observation_tokens) + self.model_tokens
        return results, [SegmentFlush(kind="observation", weight_version=None, segments=[
            Segment(sample=i, start=start, length=self.observation_tokens, turn=turn,
                    key=f"obs:{req.group_id}/a{req.attempt}/s{i}/t{turn}") for i in range(n)])]

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
