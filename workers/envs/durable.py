"""The durable turn recorder: an episode's model turns and env calls kept in the event log.

Durable execution (as Temporal and Restate do it for workflows) applied to rollouts.
The episode runner asks this recorder for every model turn and every env call; the
recorder answers from what the log recorded, or makes the call -- and makes it durable
before anything depends on it::

    model turns      sampled; their segment rows put (held back, see below)
    env calls        PAUSE 1: the turns' SegmentsRecorded + EnvStepsRequested (the
                     intent: each call keyed run/group/sample/turn) are appended
                     the calls run
                     PAUSE 2: EnvStepsCompleted (each turn's reward) + the observations'
                     SegmentsRecorded (kind "observation") are appended

A pause hands an ``EpisodeFlush`` to the sink and blocks until the controller appended
it (``workers.generator.episodes`` returns it from the generator call; the controller's
next call lets the episode go on). So each turn costs two round trips to the log, and a
crash loses at most the turn in progress.

An environment that deduplicates by key (``dedupes_by_key``) skips PAUSE 2: its results
and observations are held and ride with the next turn's PAUSE 1 (results first, as the
log wants them), and the episode's last results with one final pause (:meth:`finish`)
before its rows are committed. Half the round trips; the price is that a crash after
the calls ran re-issues them with their keys, which such an env answers from its own
record (the side effect still happens once). An env that cannot deduplicate keeps both
pauses, so its calls' results are in the log before anything else happens.

A resumed attempt starts from the log (:func:`read_episode_log`):

* a recorded model turn is served from its segment rows (ids, logprobs, versions) and
  never sampled again;
* a recorded result is served and the call is not made again (the runner brings the
  fresh env instance to the state after it);
* a call with an intent but no result is made again with the same key -- the
  controller restarted that episode instead when its env cannot deduplicate, so here
  it always may;
* a call that differs from the recorded one (another context, another action) is a
  ``ReplayMismatchError`` naming its key: agent code replayed must make the same calls.

Reset is not a recorded call: it runs again on every resume (``workers.envs.base``).

An agent episode (``workers.envs.agent``) goes through the same pauses: its calls are
made by the agent's own code, so the endpoint records each in two steps --
``env_requested`` (the intent, PAUSE 1, before the completion is returned) and
``env_completed`` (the result, once the agent's next request or reward says what it
was; PAUSE 2, or held for the next PAUSE 1 when the agent deduplicates by key).
``env_steps`` is those two around the call. A result completed again on a resumed
attempt is checked against the recorded one instead of recorded twice.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from events.schema import EnvCall, EnvResult, Segment, SegmentKind
from workers.api import EpisodeFlush, EpisodeResume, SegmentFlush
from workers.dataplane.api import DataPlane
from workers.envs.base import Observation, StepKey
from workers.envs.recorder import (
    ModelTurn,
    ReplayMismatchError,
    StepCall,
    StepOutcome,
    TurnRequest,
    same_result,
)
from workers.generator.segments import SEGMENT_FIELDS, segment_key


class FlushSink(Protocol):
    """Where the recorder's pauses go; ``post`` returns once the log has the flush."""

    def post(self, flush: EpisodeFlush) -> None: ...


@dataclass
class RecordedTurn:
    """One turn of one episode as the log has it."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    call: EnvCall | None = None
    result: EnvResult | None = None
    observation: list[int] = field(default_factory=list)


@dataclass
class EpisodeLog:
    """What the log holds of one group's episodes, read back for a resumed attempt."""

    #: (sample, turn) -> what that turn recorded
    turns: dict[tuple[int, int], RecordedTurn]
    #: per sample, times its episode was started over
    restarts: list[int]
    #: per sample, completion tokens recorded (where its next segment starts)
    recorded: list[int]


def read_episode_log(
    plane: DataPlane, partition: str, flushes: Sequence[SegmentFlush],
    resume: EpisodeResume | None, n: int,
) -> EpisodeLog:
    """Each recorded turn's ids (from the segment rows) and calls, checked against the
    log: a missing or short row is an error naming its key, never a shorter episode."""
    log = EpisodeLog({}, list(resume.restarts) if resume else [0] * n, [0] * n)
    segs = [(f.kind, f.weight_version, s) for f in flushes for s in f.segments]
    rows = plane.get(partition, [s.key for _, _, s in segs], list(SEGMENT_FIELDS)) if segs else []
    for (kind, version, seg), row in zip(segs, rows):
        got = int(row["tokens"].shape[0])
        if not 0 <= seg.sample < n or seg.start != log.recorded[seg.sample] or got != seg.length:
            raise ValueError(
                f"segment {seg.key}: the log recorded {seg.length} tokens at {seg.start} of "
                f"sample {seg.sample}; the row has {got}, the sample "
                f"{log.recorded[seg.sample] if 0 <= seg.sample < n else '?'} before it"
            )
        log.recorded[seg.sample] += got
        turn = log.turns.setdefault((seg.sample, seg.turn), RecordedTurn())
        ids = row["tokens"].tolist()
        if kind == "observation":
            turn.observation += ids
        else:
            turn.tokens += ids
            turn.logprobs += row["logprobs"].tolist()
            turn.versions += [int(version or 0)] * got
    for rec in resume.calls if resume else []:
        turn = log.turns.setdefault((rec.call.sample, rec.call.turn), RecordedTurn())
        turn.call, turn.result = rec.call, rec.result
        if rec.result is not None and rec.result.observation_tokens != len(turn.observation):
            raise ValueError(
                f"sample {rec.call.sample} turn {rec.call.turn}: the result recorded "
                f"{rec.result.observation_tokens} observation tokens, the rows hold "
                f"{len(turn.observation)}"
            )
    return log


@dataclass
class SegmentWriter:
    """Writes one flush's segment rows (one put) and returns the flush to record."""

    plane: DataPlane
    run_id: str
    group_id: str
    attempt: int
    #: per sample, tokens recorded so far (where the next segment starts)
    recorded: list[int]
    #: this attempt's SegmentsRecorded so far (the next one's index)
    index: int = 0

    def write(
        self, kind: SegmentKind, version: int | None,
        parts: Mapping[tuple[int, int], tuple[Sequence[int], Sequence[float]]],
    ) -> SegmentFlush:
        """``parts``: (sample, turn) -> (ids, logprobs), at most one per sample."""
        keys, rows, tags, segments = [], [], [], []
        for (sample, turn), (ids, logprobs) in parts.items():
            key = segment_key(self.run_id, self.group_id, self.attempt, sample, self.index)
            keys.append(key)
            rows.append({"tokens": torch.tensor(list(ids), dtype=torch.int64),
                         "logprobs": torch.tensor(list(logprobs), dtype=torch.float32)})
            tags.append({"group": self.group_id, "attempt": self.attempt, "sample": sample,
                         "index": self.index, "kind": kind, "turn": turn,
                         "version": -1 if version is None else version})
            segments.append(Segment(sample=sample, start=self.recorded[sample], length=len(ids),
                                    key=key, turn=turn))
            self.recorded[sample] += len(ids)
        self.plane.put(self.run_id, keys, rows, tags)
        self.index += 1
        return SegmentFlush(kind=kind, weight_version=version, segments=segments)


def _short(info: Mapping[str, Any]) -> dict[str, Any]:
    """An env's details as the log keeps them: a few short JSON scalars."""
    out: dict[str, Any] = {}
    for k, v in list(info.items())[:16]:
        keep = isinstance(v, (bool, int, str, type(None))) or (isinstance(v, float) and math.isfinite(v))
        out[str(k)[:64]] = v if keep and not isinstance(v, str) else str(v)[:200]
    return out


class DurableTurnRecorder:
    """A ``TurnRecorder`` whose record is the event log (see the module docstring)."""

    def __init__(
        self, log: EpisodeLog, sink: FlushSink, writer: SegmentWriter, *, env: str,
        dedupes_by_key: bool, eos_id: int, on_generated: Callable[[StepKey, int], None] | None = None,
        agent: bool = False,
    ) -> None:
        self.log, self.sink, self.writer = log, sink, writer
        self.env, self.dedupes_by_key, self.eos_id = env, dedupes_by_key, eos_id
        #: the calls are an agent's (its code replays them on a resume)
        self.agent = agent
        #: told of every model turn actually sampled (key, tokens): the chaos tests' ledger
        self.on_generated = on_generated
        #: model turns sampled / served from the log; calls made / served / made again
        self.counts = {"generated": 0, "served": 0, "made": 0, "replayed": 0, "reissued": 0}
        #: rows written but not recorded yet: model turns (they go with the next intent)
        #: and, for an env that deduplicates, observations after the held results
        self._held: list[SegmentFlush] = []
        #: results not recorded yet (an env that deduplicates: they go with the next pause)
        self._results: list[EnvResult] = []

    def env_reset(self, key: StepKey, reset: Callable[[], Observation]) -> Observation:
        return reset()

    def model_turns(
        self, requests: Sequence[TurnRequest],
        generate: Callable[[Sequence[TurnRequest]], list[ModelTurn]],
    ) -> list[ModelTurn]:
        out = [self._served(r.key) for r in requests]
        fresh = [r for r, t in zip(requests, out) if t is None]
        if fresh:
            made = generate(fresh)
            if len(made) != len(fresh):
                raise RuntimeError(f"sampler returned {len(made)} turns for {len(fresh)} requests")
            self._held += self._write_turns(fresh, made)
            it = iter(made)
            out = [t if t is not None else next(it) for t in out]
        return out  # type: ignore[return-value]

    def _served(self, key: StepKey) -> ModelTurn | None:
        rec = self.log.turns.get((key.sample, key.turn))
        if rec is None or not rec.tokens:
            return None
        self.counts["served"] += 1
        return ModelTurn(tuple(rec.tokens), tuple(rec.logprobs), rec.tokens[-1] == self.eos_id,
                         min(rec.versions), max(rec.versions), tuple(rec.versions))

    def _write_turns(self, requests: Sequence[TurnRequest], turns: Sequence[ModelTurn]) -> list[SegmentFlush]:
        """The turns' rows, one flush per weight version (a refit may land mid-turn)."""
        by_version: dict[int, dict[tuple[int, int], tuple[list[int], list[float]]]] = {}
        for request, turn in zip(requests, turns):
            key = request.key
            self.counts["generated"] += 1
            if self.on_generated is not None:
                self.on_generated(key, len(turn.tokens))
            for tok, lp, v in zip(turn.tokens, turn.logprobs, turn.token_versions()):
                ids, lps = by_version.setdefault(v, {}).setdefault((key.sample, key.turn), ([], []))
                ids.append(tok)
                lps.append(lp)
        return [self.writer.write("model", v, by_version[v]) for v in sorted(by_version)]

    def env_steps(self, calls: Sequence[StepCall]) -> list[StepOutcome]:
        outcomes = self.env_requested(calls)
        made = []
        for i, call in enumerate(calls):
            if outcomes[i] is None:
                outcomes[i] = call.run()
                self.counts["made"] += 1
                made.append((call.key, outcomes[i]))
        self._record_results(made)
        return outcomes  # type: ignore[return-value]

    def env_requested(self, calls: Sequence[StepCall]) -> list[StepOutcome | None]:
        outcomes: list[StepOutcome | None] = []
        intents = []
        for call in calls:
            served = self._recorded_outcome(call)
            if served is not None:
                call.replayed(served)
            else:
                intents.append(EnvCall(sample=call.key.sample, turn=call.key.turn,
                                       request=call.request, restart=call.key.restart))
            outcomes.append(served)
        if self._held or intents or self._results:  # write-ahead: no call runs before its intent
            self._post(completed=self._results, segments=self._held, requested=intents)
            self._held, self._results = [], []
        return outcomes

    def env_completed(self, results: Sequence[tuple[StepKey, StepOutcome]]) -> None:
        fresh = []
        for key, outcome in results:
            rec = self.log.turns.get((key.sample, key.turn))
            if rec is not None and rec.result is not None:  # replayed: it must be the same
                same_result(key, StepOutcome(
                    rec.result.reward, rec.result.ended, rec.result.end_reason,
                    tuple(rec.observation), dict(rec.result.info)),
                    StepOutcome(outcome.reward, outcome.ended, outcome.end_reason,
                                tuple(outcome.observation), _short(outcome.info)))
                self.counts["replayed"] += 1
            else:
                fresh.append((key, outcome))
        self._record_results(fresh)

    def _record_results(self, made: Sequence[tuple[StepKey, StepOutcome]]) -> None:
        """Results of calls just made: recorded now, or, for an env that deduplicates,
        held for the next pause (see the module docstring)."""
        results, observations = [], {}
        for key, outcome in made:
            results.append(EnvResult(
                sample=key.sample, turn=key.turn, reward=outcome.reward, ended=outcome.ended,
                end_reason=outcome.end_reason, observation_tokens=len(outcome.observation),
                info=_short(outcome.info), restart=key.restart))
            # kept as the log's: an agent's request retried after a fault brings the same
            # result again, which is checked against this one, not recorded twice
            rec = self.log.turns.setdefault((key.sample, key.turn), RecordedTurn())
            rec.result, rec.observation = results[-1], list(outcome.observation)
            if outcome.observation:
                observations[(key.sample, key.turn)] = (outcome.observation, [0.0] * len(outcome.observation))
        if results:
            segments = [self.writer.write("observation", None, observations)] if observations else []
            if self.dedupes_by_key:  # they ride with the next pause (see the module docstring)
                self._results, self._held = self._results + results, self._held + segments
            else:
                self._post(completed=results, segments=segments)

    def finish(self) -> None:
        """Record what is held (the episodes' last results) before the group's rows are
        committed: the commit must find every episode ended in the log."""
        if self._results or self._held:
            self._post(completed=self._results, segments=self._held)
            self._held, self._results = [], []

    def _recorded_outcome(self, call: StepCall) -> StepOutcome | None:
        """The call's recorded outcome; None when it must be made (new, or re-issued)."""
        rec = self.log.turns.get((call.key.sample, call.key.turn))
        if rec is None or rec.call is None:
            return None
        if rec.call.request != call.request:
            raise ReplayMismatchError(
                f"env call {call.key}: the replayed agent made a different call than the "
                f"recorded one (request {call.request}, the log has {rec.call.request}): "
                "agent code must make the same calls when it is replayed"
            )
        result = rec.result
        if result is None:
            self.counts["reissued"] += 1  # same key: the env declared it deduplicates
            return None
        self.counts["replayed"] += 1
        return StepOutcome(result.reward, result.ended, result.end_reason,
                           tuple(rec.observation), dict(result.info))

    def _post(self, **records: Any) -> None:
        self.sink.post(EpisodeFlush(env=self.env, dedupes_by_key=self.dedupes_by_key,
                                    agent=self.agent, **records))


def token_ledger(group_id: str, attempt: int) -> Callable[[StepKey, int], None] | None:
    """``RLC_TOKEN_LEDGER=path`` (a test hook, off by default): one line per sampled model
    turn, ``E group attempt sample turn tokens``, written before the turn can be recorded,
    so chaos tests can count what a killed process sampled."""
    path = os.environ.get("RLC_TOKEN_LEDGER")
    if not path:
        return None

    def write(key: StepKey, tokens: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, f"E {group_id} {attempt} {key.sample}.{key.restart} {key.turn} {tokens}\n".encode())
        finally:
            os.close(fd)

    return write
