"""Episodes in the folded state: what an in-flight group's environment calls recorded.

A multi-turn sample is an episode (``docs/agents.md``): model turns, recorded as
``SegmentsRecorded`` (``controller.core.segments``), alternating with environment or
tool calls, recorded write-ahead -- ``EnvStepsRequested`` (the intent, with each call's
idempotency key) before the calls run, ``EnvStepsCompleted`` (the results, with each
turn's reward) after. The state keeps, per group that recorded any call and is not
committed, an :class:`InflightEpisodes`: its calls as rows of flat columns (sample,
turn, the request fingerprint, which attempt asked last, the result once it came), and
per sample its restart count, its last call's row and whether its episode ended.

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
    """One call of one episode, as :attr:`InflightEpisodes.samples` shows it (a view
    built on demand: the record keeps its calls in columns)."""

    turn: int
    #: the request fingerprint the intent recorded (a replay must ask the same)
    request: str
    #: the attempt whose intent is the latest for this call
    attempt: int
    result: EnvResult | None = None


class SampleEpisode(msgspec.Struct, kw_only=True, gc=False):
    """One sample's episode as the log has it (a view, as :class:`TurnRecord`)."""

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
    """What an uncommitted group's environment calls recorded, over all its attempts.

    Columnar: every call of the group is one row of five flat lists (``call_*``), in the
    order the log recorded them, and each sample has an entry in three per-sample lists.
    With ~1000 groups in flight a pause's first touch of its group's record is a cache
    miss per object read; an object per turn (and a list of them per sample) made a
    pause's check read ~4 cold objects per sample, where the columns are a few cache
    lines per group (``docs/episode-cost.md``, "Eleventh pass")."""

    #: the task that made the environment, and its declaration
    env: str
    dedupes_by_key: bool
    #: per sample: times it was started again from the prompt (part of its calls' keys)
    restarts: list[int]
    #: per sample: the row of its last call (-1: none since its last restart)
    last: list[int]
    #: per sample: its last call's result ended the episode
    ended: list[bool]
    #: per call (one row each, log order): its sample, turn, request fingerprint (a
    #: replay must ask the same), the attempt whose intent is the latest for it, and its
    #: result once it came
    call_sample: list[int] = []
    call_turn: list[int] = []
    call_request: list[str] = []
    call_attempt: list[int] = []
    call_result: list[EnvResult | None] = []
    #: the attempt now admitted, and its env events so far (the next one's index)
    attempt: int
    attempt_events: int = 0

    @classmethod
    def empty(cls, n_samples: int, attempt: int, env: str, dedupes_by_key: bool) -> InflightEpisodes:
        return cls(env=env, dedupes_by_key=dedupes_by_key, attempt=attempt,
                   restarts=[0] * n_samples, last=[-1] * n_samples, ended=[False] * n_samples)

    @property
    def samples(self) -> list[SampleEpisode]:
        """Per sample its episode (restart count and turns), built from the columns: for
        readers off the fold's path (resume, tests), never for the fold itself."""
        out = [SampleEpisode(restart=r, turns=[]) for r in self.restarts]
        for i, turn, request, attempt, result in zip(
                self.call_sample, self.call_turn, self.call_request, self.call_attempt,
                self.call_result):
            out[i].turns.append(TurnRecord(turn=turn, request=request, attempt=attempt, result=result))
        return out

    def pending(self, i: int) -> int:
        """The row of sample ``i``'s call asked for whose result never came (-1: none)."""
        j = self.last[i]
        return j if j >= 0 and self.call_result[j] is None else -1


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
    (``controller.core.reducer_pauses``) check with it: one copy of each rule. It reads
    the record's columns only (a sample's last row, and whether its result came: an
    identity test), never a recorded result or request, unless a call is re-issued."""
    if index != rec.attempt_events:
        return f"env event index {index}, expected {rec.attempt_events} for attempt {attempt}"
    if not items:
        kind = "EnvStepsCompleted" if completed else "EnvStepsRequested"
        return f"a {kind} with no calls"
    restarts, last_row = rec.restarts, rec.last
    c_result, c_turn, c_attempt = rec.call_result, rec.call_turn, rec.call_attempt
    n = len(restarts)
    # a list of bools, not a bytearray: 3.11 specialises list[int] loads and stores and
    # tests a bool by identity, where a bytearray takes the generic paths (-5.5 % of the
    # fold's instructions, ``docs/episode-cost.md``, "Eighth pass")
    seen = [False] * n
    for item in items:
        i = item.sample
        if not 0 <= i < n or seen[i]:
            return f"sample {i} is outside the group of {n} or twice in one event"
        seen[i] = True
        if item.restart != restarts[i]:
            return (f"sample {i}: restart {item.restart} in the key, but the episode is at "
                    f"restart {restarts[i]}")
        j = last_row[i]
        if completed:
            if j < 0 or c_result[j] is not None or c_turn[j] != item.turn or c_attempt[j] != attempt:
                return f"sample {i} turn {item.turn}: a result for a call attempt {attempt} did not request"
            if not math.isfinite(item.reward):  # type: ignore[union-attr]
                return f"sample {i} turn {item.turn}: reward {item.reward} is not finite"  # type: ignore[union-attr]
            obs, ended = item.observation_tokens, item.ended  # type: ignore[union-attr]
            if obs < 0 or (ended and obs):
                return (f"sample {i} turn {item.turn}: {obs} observation tokens"
                        + (" after the episode ended" if ended else ""))
        elif j < 0 or c_result[j] is not None:  # no pending call: a new turn
            if j >= 0 and rec.ended[i]:
                return f"sample {i} turn {item.turn}: the episode already ended"
            want = c_turn[j] + 1 if j >= 0 else 1
            if item.turn != want:
                return f"sample {i} turn {item.turn}: the next call of this episode is turn {want}"
        elif (problem := _reissue_problem(rec, j, item, attempt)):  # type: ignore[arg-type]
            return f"sample {i} turn {item.turn}: {problem}"
    return ""


def _reissue_problem(rec: InflightEpisodes, j: int, call: EnvCall, attempt: int) -> str:
    """Why ``call`` may not ask again for the pending call of row ``j`` (a resumed
    attempt only)."""
    turn, asked_by = rec.call_turn[j], rec.call_attempt[j]
    if call.turn != turn:
        return f"turn {turn} was requested and has no result yet"
    if not rec.dedupes_by_key:
        return (f"asked again with the same key, but env {rec.env!r} cannot "
                "deduplicate (a second call could repeat its side effect)")
    if asked_by >= attempt:
        return f"already requested by attempt {asked_by}"
    if call.request != rec.call_request[j]:
        return (f"re-issued with request {call.request}, but the log recorded "
                f"{rec.call_request[j]} (a replayed agent must make the same call)")
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
    last_row, c_result, c_attempt = rec.last, rec.call_result, rec.call_attempt
    c_sample, c_turn, c_request = rec.call_sample, rec.call_turn, rec.call_request
    for call in calls:
        i = call.sample
        j = last_row[i]
        if j >= 0 and c_result[j] is None:  # re-issued with the same key
            c_attempt[j] = attempt
        else:
            last_row[i] = len(c_sample)
            c_sample.append(i)
            c_turn.append(call.turn)
            c_request.append(call.request)
            c_attempt.append(attempt)
            c_result.append(None)


def completed_problem(rec: InflightEpisodes, ev: EnvStepsCompleted) -> str:
    """Why ``ev`` cannot follow what ``rec`` holds ("" when it can)."""
    return env_items_problem(rec, ev.index, ev.attempt, ev.results, completed=True)


def record_completed(rec: InflightEpisodes, results: Sequence[EnvResult]) -> None:
    """Fold checked results into ``rec``."""
    rec.attempt_events += 1
    last_row, c_result, ended = rec.last, rec.call_result, rec.ended
    for result in results:
        i = result.sample
        c_result[last_row[i]] = result  # its pending call: checked
        ended[i] = result.ended


def unresolved(rec: InflightEpisodes) -> list[int]:
    """Samples with a call that was asked for and has no result."""
    c_result = rec.call_result
    return [i for i, j in enumerate(rec.last) if j >= 0 and c_result[j] is None]


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
    keep = [j for j, i in enumerate(rec.call_sample) if i not in drop]
    for name in ("call_sample", "call_turn", "call_request", "call_attempt", "call_result"):
        column = getattr(rec, name)
        column[:] = [column[j] for j in keep]
    rows = {j: k for k, j in enumerate(keep)}
    rec.last[:] = [-1 if i in drop or j < 0 else rows[j] for i, j in enumerate(rec.last)]
    for i in drop:
        rec.restarts[i] += 1
        rec.ended[i] = False
    if segments is None:
        return None
    kept = InflightSegments.empty(len(segments.recorded), segments.attempt)
    for flush in segments.flushes:
        left = [s for s in flush.segments if s.sample not in drop]
        if left:
            record_flush(kept, msgspec.structs.replace(flush, segments=left))
    kept.attempt_flushes = segments.attempt_flushes  # the flush index runs on
    return kept


def _by_sample(rec: InflightEpisodes) -> tuple[list[list[int]], list[list[float]]]:
    """Per sample, the turn and the reward of each call with a result, in the log's order
    (a sample's calls come in turn order)."""
    turns: list[list[int]] = [[] for _ in rec.restarts]
    rewards: list[list[float]] = [[] for _ in rec.restarts]
    for i, turn, result in zip(rec.call_sample, rec.call_turn, rec.call_result):
        if result is not None:
            turns[i].append(turn)
            rewards[i].append(result.reward)
    return turns, rewards


def commit_problem(rec: InflightEpisodes, rewards: Sequence[float]) -> str:
    """Why a commit with these rewards disagrees with the recorded calls."""
    if len(rewards) != len(rec.restarts):
        return f"{len(rewards)} samples committed, {len(rec.restarts)} have episodes"
    ended = rec.ended
    for i, (reward, played) in enumerate(zip(rewards, _by_sample(rec)[1])):
        if not ended[i]:
            return (f"sample {i}: its episode has not ended "
                    f"(turn {rec.call_sample.count(i)} recorded)")
        # ``sum`` as the workers add the turns up (compensated from Python 3.12 on)
        total = sum(played)
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
    turns, rewards = _by_sample(rec)
    get = first.get
    starts: list[tuple[int, ...]] = []
    for i, sample_turns in enumerate(turns):
        sample_starts = [get((i, turn)) for turn in sample_turns]
        if None in sample_starts:
            return None  # a turn without its tokens: no per-turn credit, the return stands
        starts.append(tuple(sample_starts))  # type: ignore[arg-type]
    return EpisodeSummary(starts=tuple(starts), rewards=tuple(map(tuple, rewards)))


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
