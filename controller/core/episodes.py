"""Episodes in the folded state: what an in-flight group's environment calls recorded.

A multi-turn sample is an episode (``docs/agents.md``): model turns, recorded as
``SegmentsRecorded`` (``controller.core.segments``), alternating with environment or
tool calls, recorded write-ahead -- ``EnvStepsRequested`` (the intent, with each call's
idempotency key) before the calls run, ``EnvStepsCompleted`` (the results, with each
turn's reward) after. The state keeps, per group that recorded any call and is not
committed, an :class:`InflightEpisodes`: per sample its turns (the request
fingerprint, which attempt asked last, the result once it came) and its restart count.

The rules the reducer enforces with it:

* a sample's calls come in turn order, one at a time: turn ``t + 1`` only once turn
  ``t`` has a result, nothing after the result that ended the episode;
* a call without a result may be requested again only by a later attempt, with the
  same request, and only for an environment that deduplicates by key -- one that
  cannot is never asked twice (``EpisodesRestarted`` starts that episode over instead,
  with new keys);
* a result answers the call its attempt requested;
* at the commit every episode has ended, and each sample's committed reward is the sum
  of its turns' rewards.

At the commit the record becomes an :class:`EpisodeSummary` on the group (each turn's
first completion token and its reward): enough for per-token advantages
(:func:`turn_advantages`) and for ``replay --episode``.

Pure: no I/O, no clock, no randomness, no logging.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from controller.core.segments import InflightSegments, record_flush
from events.schema import (
    EnvCall,
    EnvResult,
    EnvStepsCompleted,
    EnvStepsRequested,
    EpisodesRestarted,
)


class TurnRecord(msgspec.Struct, kw_only=True, gc=False):
    """One call of one episode: its intent, and its result once it came."""

    turn: int
    #: the request fingerprint the intent recorded (a replay must ask the same)
    request: str
    #: the attempt whose intent is the latest for this call
    attempt: int
    result: EnvResult | None = None


class SampleEpisode(msgspec.Struct, kw_only=True, gc=False):
    """One sample's episode as the log has it."""

    #: times it was started again from the prompt (part of its calls' keys)
    restart: int = 0
    turns: list[TurnRecord] = []

    @property
    def ended(self) -> bool:
        last = self.turns[-1] if self.turns else None
        return last is not None and last.result is not None and last.result.ended

    def pending(self) -> TurnRecord | None:
        """The call asked for whose result never came (None when there is none)."""
        last = self.turns[-1] if self.turns else None
        return last if last is not None and last.result is None else None


class InflightEpisodes(msgspec.Struct, kw_only=True, gc=False):
    """What an uncommitted group's environment calls recorded, over all its attempts."""

    #: the task that made the environment, and its declaration
    env: str
    dedupes_by_key: bool
    samples: list[SampleEpisode]
    #: the attempt now admitted, and its env events so far (the next one's index)
    attempt: int
    attempt_events: int = 0

    @classmethod
    def empty(cls, n_samples: int, attempt: int, env: str, dedupes_by_key: bool) -> InflightEpisodes:
        return cls(env=env, dedupes_by_key=dedupes_by_key, attempt=attempt,
                   samples=[SampleEpisode() for _ in range(n_samples)])


class EpisodeSummary(msgspec.Struct, kw_only=True, gc=False):
    """A committed group's turns: per sample, each turn's first completion token (its
    offset after the prompt) and its reward, in turn order.

    Tuples, not lists (the same arrays on the wire and in snapshots): a committed
    group's summary stays in the state for the rest of the run, and the collector stops
    tracking a tuple of numbers the first time it looks at it, where every list would be
    walked again by every full collection -- 34 of them per 16-sample group, the bulk of
    what a long episode run's state held for the collector
    (``tests/unit/test_untracked_state.py``)."""

    starts: tuple[tuple[int, ...], ...]
    rewards: tuple[tuple[float, ...], ...]


def env_items_problem(rec: InflightEpisodes, index: int, attempt: int,
                      items: Sequence[EnvCall] | Sequence[EnvResult], completed: bool) -> str:
    """Why an env event's items cannot follow what ``rec`` holds ("" when they can): the
    results of an ``EnvStepsCompleted`` (``completed``) or the calls of an
    ``EnvStepsRequested``, at env event ``index`` of ``attempt``.

    This loop runs once per call of every env event and of every pause -- the bulk of an
    episode run's fold -- so each rule is inline (no call per item) and the messages are
    built only on failure. Both the separate events' handlers and a pause's one-pass fold
    (``controller.core.reducer_pauses``) check with it: one copy of each rule."""
    if index != rec.attempt_events:
        return f"env event index {index}, expected {rec.attempt_events} for attempt {attempt}"
    if not items:
        kind = "EnvStepsCompleted" if completed else "EnvStepsRequested"
        return f"a {kind} with no calls"
    samples, dedupes = rec.samples, rec.dedupes_by_key
    n = len(samples)
    # a list of bools, not a bytearray: 3.11 specialises list[int] loads and stores and
    # tests a bool by identity, where a bytearray takes the generic paths (-5.5 % of the
    # fold's instructions, ``docs/episode-cost.md``, "Eighth pass")
    seen = [False] * n
    for item in items:
        i = item.sample
        if not 0 <= i < n or seen[i]:
            return f"sample {i} is outside the group of {n} or twice in one event"
        seen[i] = True
        episode = samples[i]
        if item.restart != episode.restart:
            return (f"sample {i}: restart {item.restart} in the key, but the episode is at "
                    f"restart {episode.restart}")
        turns = episode.turns  # the last turn once, inline
        last = turns[-1] if turns else None
        if completed:
            if (last is None or last.result is not None or last.turn != item.turn
                    or last.attempt != attempt):
                return f"sample {i} turn {item.turn}: a result for a call attempt {attempt} did not request"
            if not math.isfinite(item.reward):  # type: ignore[union-attr]
                return f"sample {i} turn {item.turn}: reward {item.reward} is not finite"  # type: ignore[union-attr]
            obs, ended = item.observation_tokens, item.ended  # type: ignore[union-attr]
            if obs < 0 or (ended and obs):
                return (f"sample {i} turn {item.turn}: {obs} observation tokens"
                        + (" after the episode ended" if ended else ""))
        elif last is None or last.result is not None:  # no pending call: a new turn
            if last is not None and last.result.ended:  # type: ignore[union-attr]
                return f"sample {i} turn {item.turn}: the episode already ended"
            want = last.turn + 1 if last is not None else 1
            if item.turn != want:
                return f"sample {i} turn {item.turn}: the next call of this episode is turn {want}"
        elif (problem := _reissue_problem(rec, last, item, attempt, dedupes)):  # type: ignore[arg-type]
            return f"sample {i} turn {item.turn}: {problem}"
    return ""


def _reissue_problem(rec: InflightEpisodes, pending: TurnRecord, call: EnvCall, attempt: int,
                     dedupes: bool) -> str:
    """Why ``call`` may not ask again for the ``pending`` call (a resumed attempt only)."""
    if call.turn != pending.turn:
        return f"turn {pending.turn} was requested and has no result yet"
    if not dedupes:
        return (f"asked again with the same key, but env {rec.env!r} cannot "
                "deduplicate (a second call could repeat its side effect)")
    if pending.attempt >= attempt:
        return f"already requested by attempt {pending.attempt}"
    if call.request != pending.request:
        return (f"re-issued with request {call.request}, but the log recorded "
                f"{pending.request} (a replayed agent must make the same call)")
    return ""


def env_problem(rec: InflightEpisodes, env: str, dedupes_by_key: bool) -> str:
    """Why calls to ``env`` cannot follow the calls ``rec`` holds ("" when they can)."""
    if (env, dedupes_by_key) != (rec.env, rec.dedupes_by_key):
        return (f"env {env!r} (dedupes_by_key={dedupes_by_key}) after calls to "
                f"{rec.env!r} (dedupes_by_key={rec.dedupes_by_key})")
    return ""


def requested_problem(rec: InflightEpisodes, ev: EnvStepsRequested) -> str:
    """Why ``ev`` cannot follow what ``rec`` holds ("" when it can)."""
    return (env_problem(rec, ev.env, ev.dedupes_by_key)
            or env_items_problem(rec, ev.index, ev.attempt, ev.calls, completed=False))


def record_requested(rec: InflightEpisodes, attempt: int, calls: Sequence[EnvCall]) -> None:
    """Fold a checked intent (its ``attempt``'s ``calls``) into ``rec``."""
    rec.attempt_events += 1
    samples = rec.samples
    for call in calls:
        turns = samples[call.sample].turns
        last = turns[-1] if turns else None
        if last is not None and last.result is None:  # re-issued with the same key
            last.attempt = attempt
        else:
            turns.append(TurnRecord(turn=call.turn, request=call.request, attempt=attempt))


def completed_problem(rec: InflightEpisodes, ev: EnvStepsCompleted) -> str:
    """Why ``ev`` cannot follow what ``rec`` holds ("" when it can)."""
    return env_items_problem(rec, ev.index, ev.attempt, ev.results, completed=True)


def record_completed(rec: InflightEpisodes, results: Sequence[EnvResult]) -> None:
    """Fold checked results into ``rec``."""
    rec.attempt_events += 1
    samples = rec.samples
    for result in results:
        samples[result.sample].turns[-1].result = result  # its pending call: checked


def unresolved(rec: InflightEpisodes) -> list[int]:
    """Samples with a call that was asked for and has no result."""
    return [i for i, e in enumerate(rec.samples) if e.pending() is not None]


def restart_problem(rec: InflightEpisodes | None, ev: EpisodesRestarted) -> str:
    if rec is None:
        return "no environment call was recorded"
    if not ev.samples or len(set(ev.samples)) != len(ev.samples):
        return f"samples {ev.samples} must be distinct and not empty"
    stuck = set(unresolved(rec))
    extra = [i for i in ev.samples if i not in stuck]
    if extra:
        return f"samples {extra} have no call without a result: nothing to restart"
    return ""


def restart(
    rec: InflightEpisodes, segments: InflightSegments | None, samples: Sequence[int]
) -> InflightSegments | None:
    """Start ``samples`` over: their calls and recorded tokens are dropped, their restart
    count goes up. Returns the group's segment record without their segments (folded
    again from the flushes that are left, so every count and version sum is exact)."""
    drop = set(samples)
    for i in drop:
        rec.samples[i] = SampleEpisode(restart=rec.samples[i].restart + 1)
    if segments is None:
        return None
    kept = InflightSegments.empty(len(segments.recorded), segments.attempt)
    for flush in segments.flushes:
        left = [s for s in flush.segments if s.sample not in drop]
        if left:
            record_flush(kept, msgspec.structs.replace(flush, segments=left))
    kept.attempt_flushes = segments.attempt_flushes  # the flush index runs on
    return kept


def commit_problem(rec: InflightEpisodes, rewards: Sequence[float]) -> str:
    """Why a commit with these rewards disagrees with the recorded calls."""
    if len(rewards) != len(rec.samples):
        return f"{len(rewards)} samples committed, {len(rec.samples)} have episodes"
    for i, (reward, episode) in enumerate(zip(rewards, rec.samples)):
        if not episode.ended:
            return f"sample {i}: its episode has not ended (turn {len(episode.turns)} recorded)"
        # ``sum`` as the workers add the turns up (compensated from Python 3.12 on)
        total = sum([t.result.reward for t in episode.turns if t.result is not None])
        if total != reward:
            return f"sample {i}: reward {reward} committed, its turns' rewards sum to {total}"
    return ""


def summarize(rec: InflightEpisodes, segments: InflightSegments | None) -> EpisodeSummary | None:
    """Each turn's first model token and reward; None without the turns' segments."""
    if segments is None:
        return None
    # a sample's segments start where its recorded tokens end (``segments_problem``), so
    # in flush order the first segment of a turn is its lowest start
    first: dict[tuple[int, int], int] = {}
    setdefault = first.setdefault
    for flush in segments.flushes:
        if flush.kind == "model":
            for seg in flush.segments:
                setdefault((seg.sample, seg.turn), seg.start)
    starts: list[tuple[int, ...]] = []
    rewards: list[tuple[float, ...]] = []
    for i, episode in enumerate(rec.samples):
        sample_starts, sample_rewards = [], []
        for t in episode.turns:
            if t.result is None:
                continue
            start = first.get((i, t.turn))
            if start is None:
                return None  # a turn without its tokens: no per-turn credit, the return stands
            sample_starts.append(start)
            sample_rewards.append(t.result.reward)
        starts.append(tuple(sample_starts))
        rewards.append(tuple(sample_rewards))
    return EpisodeSummary(starts=tuple(starts), rewards=tuple(rewards))


def turn_advantages(summary: EpisodeSummary, eps: float = 1e-6) -> tuple[list[list[float]], bool]:
    """Per-token GRPO advantages of one group, one value per turn; (runs, zero_variance).

    Each sample's run is flat ``[start_1, a_1, start_2, a_2, ...]``: the completion's
    tokens from ``start_j`` up to ``start_{j+1}`` (the turn's model tokens; the
    observation after it is loss-masked) get ``a_j`` = (reward-to-go from turn j -
    the group's mean return) / (its std + eps). Exactly
    ``workers.envs.trajectory.per_token_advantages`` on the model tokens, in the same
    float64 operations in the same order; all returns equal gives exactly 0.
    """
    returns = [sum(r) for r in summary.rewards]
    n = len(returns)
    if n == 0:
        raise ValueError("a group needs at least one sample")
    mean = sum(returns) / n
    std = (sum((g - mean) ** 2 for g in returns) / n) ** 0.5
    spread = std >= eps  # not ``not std < eps``: a NaN std gives zeros, as it always did
    scale = std + eps  # the same float64 sum per turn as per_token_advantages computes
    runs: list[list[float]] = []
    for starts, rewards in zip(summary.starts, summary.rewards):
        k = len(rewards)
        run = [0.0] * (2 * k)
        run[0::2] = map(float, starts)
        if spread:
            to_go = 0.0
            for j in range(k - 1, -1, -1):
                to_go += rewards[j]
                run[2 * j + 1] = (to_go - mean) / scale
        runs.append(run)
    return runs, std < eps
