"""A pause folded in one pass (``reducer_pauses.fold_pause``, the fold's path) ends in exactly
the state, and raises exactly the problem, of folding the events it stands for one by one
(``reducer.apply_parts``, the observed fold's path).

Generated episodes (seeded): every pause of each, valid, then each pause bent into each
kind of bad one on a copy of the state before it -- wrong env or flush index, wrong
attempt, unknown group, samples outside the group or twice, results nobody asked for or
for the wrong turn, rewards that are not finite, observation tokens that cannot be,
calls out of turn order or after the end, re-issues the env or the attempt forbids,
token ranges with gaps or overlaps, versions newer than the trainer, empty parts --
folded both ways: same state (snapshot bytes) and same violation text, or the test
fails. A later part's violation leaves the earlier parts applied, both ways."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from controller.core.errors import InvariantViolation
from controller.core.fold import fold
from controller.core.reducer import apply_event, apply_parts
from controller.core.state import RunState, encode_state
from events import schema as ev
from tests.unit.log_builder import LogBuilder

N = 4  # samples per group
_replace = msgspec.structs.replace


def _pauses(rng: random.Random, gid: str, turns: int, dedupes: bool = True) -> list[ev.EpisodeTurnsRecorded]:
    """The valid pauses of one group's episodes, from the first model turn to the end."""
    recorded, live = [0] * N, list(range(N))
    seg_index = env_index = 0
    asked: list[int] = []
    out = []
    for t in range(1, turns + 2):
        results, obs = [], []
        for i in asked:
            ended = t > turns or rng.random() < 0.2
            n_obs = 0 if ended else rng.randint(0, 3)
            results.append(ev.EnvResult(sample=i, turn=t - 1, reward=rng.choice([0.0, 0.5, 1.0, -0.25, 1e-3]),
                                        ended=ended, observation_tokens=n_obs))
            if n_obs:
                obs.append(ev.Segment(sample=i, start=recorded[i], length=n_obs, key=f"{gid}/o{i}.{t}", turn=t - 1))
                recorded[i] += n_obs
            if ended:
                live.remove(i)
        model = []
        for i in live:
            length = rng.randint(1, 5)
            model.append(ev.Segment(sample=i, start=recorded[i], length=length, key=f"{gid}/m{i}.{t}", turn=t))
            recorded[i] += length
        more = []  # a long turn flushes twice: the turn's first token is in the first
        for i in live if rng.random() < 0.5 else []:
            more.append(ev.Segment(sample=i, start=recorded[i], length=2, key=f"{gid}/n{i}.{t}", turn=t))
            recorded[i] += 2
        flushes = ([ev.SegmentFlush(kind="observation", weight_version=None, segments=obs)] if obs else []) + [
            ev.SegmentFlush(kind="model", weight_version=0, segments=segs) for segs in (model, more) if segs]
        calls = [ev.EnvCall(sample=i, turn=t, request=f"r{i}.{t}") for i in live]
        out.append(ev.EpisodeTurnsRecorded(
            event_id=ev.episode_turns_event_id(gid, 1, seg_index, env_index), epoch=1, ts=float(t),
            group_id=gid, attempt=1, segment_index=seg_index, env_index=env_index,
            results=results, flushes=flushes, env="calc", dedupes_by_key=dedupes, calls=calls))
        seg_index += len(flushes)
        env_index += bool(results) + bool(calls)
        asked = [c.sample for c in calls]
        if not live:
            break
    return out


def _first(items: list[Any], **changes: Any) -> list[Any]:
    return [_replace(items[0], **changes)] + items[1:] if items else items


def _flush(p: ev.EpisodeTurnsRecorded, k: int, **changes: Any) -> list[ev.SegmentFlush]:
    fl = list(p.flushes)
    if 0 <= k < len(fl):
        fl[k] = _replace(fl[k], **changes)
    return fl


def _segs(p: ev.EpisodeTurnsRecorded, k: int, change: Callable[[list[ev.Segment]], list[ev.Segment]]) -> list[ev.SegmentFlush]:
    return _flush(p, k, segments=change(list(p.flushes[k].segments))) if 0 <= k < len(p.flushes) else list(p.flushes)


#: each kind of bad pause, made from a valid one
BENDS: dict[str, Callable[[ev.EpisodeTurnsRecorded], dict[str, Any]]] = {
    "env index ahead": lambda p: {"env_index": p.env_index + 1},
    "env index behind": lambda p: {"env_index": p.env_index - 1},
    "flush index ahead": lambda p: {"segment_index": p.segment_index + 1},
    "wrong attempt": lambda p: {"attempt": p.attempt + 1},
    "older attempt": lambda p: {"attempt": p.attempt - 1},
    "unknown group": lambda p: {"group_id": "nobody"},
    "empty": lambda p: {"results": [], "flushes": [], "calls": []},
    "result of a sample outside": lambda p: {"results": _first(p.results, sample=N)},
    "result twice": lambda p: {"results": p.results + p.results[:1]},
    "result for the wrong turn": lambda p: {"results": _first(p.results, turn=p.results[0].turn + 1 if p.results else 0)},
    "result without intent": lambda p: {"results": [ev.EnvResult(sample=0, turn=9, reward=0.0, ended=True)]},
    "reward nan": lambda p: {"results": _first(p.results, reward=float("nan"))},
    "reward inf": lambda p: {"results": _first(p.results, reward=float("inf"))},
    "negative observation": lambda p: {"results": _first(p.results, observation_tokens=-1)},
    "observation after the end": lambda p: {"results": _first(p.results, ended=True, observation_tokens=2)},
    "result with another restart": lambda p: {"results": _first(p.results, restart=1)},
    "call twice": lambda p: {"calls": p.calls + p.calls[:1]},
    "call of a sample outside": lambda p: {"calls": _first(p.calls, sample=-1)},
    "call skips a turn": lambda p: {"calls": _first(p.calls, turn=p.calls[0].turn + 1 if p.calls else 0)},
    "call with another restart": lambda p: {"calls": _first(p.calls, restart=2)},
    "call to another env": lambda p: {"env": "other"},
    "env that changes its declaration": lambda p: {"dedupes_by_key": not p.dedupes_by_key},
    "empty calls after results": lambda p: {"calls": [], "flushes": []},
    "call for every sample": lambda p: {"calls": [ev.EnvCall(sample=i, turn=1, request="x") for i in range(N)]},
    "token range gap": lambda p: {"flushes": _segs(p, len(p.flushes) - 1, lambda s: _first(s, start=s[0].start + 1))},
    "token range overlap": lambda p: {"flushes": _segs(p, 0, lambda s: _first(s, start=s[0].start - 1))},
    "version newer than the trainer": lambda p: {"flushes": _flush(p, len(p.flushes) - 1, weight_version=5)},
    "model flush without version": lambda p: {"flushes": _flush(p, len(p.flushes) - 1, weight_version=None)},
    "observation with a version": lambda p: {"flushes": _flush(p, 0, kind="observation", weight_version=0)},
    "flush of no segments": lambda p: {"flushes": _segs(p, 0, lambda s: [])},
    "segment of no tokens": lambda p: {"flushes": _segs(p, 0, lambda s: _first(s, length=0))},
    "segment without key": lambda p: {"flushes": _segs(p, 0, lambda s: _first(s, key=""))},
    "segment twice": lambda p: {"flushes": _segs(p, 0, lambda s: s + s[:1])},
    "segment of a stopped sample": lambda p: {"flushes": _segs(p, 0, lambda s: _first(s, stopped=True) + s[:1])},
}


def _both_ways(state: RunState, pause: ev.EpisodeTurnsRecorded, pos: int) -> tuple[RunState, str]:
    """The pause folded in one pass and part by part, each on its own copy of ``state``:
    asserts the same violation text (or none) and the same state; returns (state, text)."""
    fast, slow = state.copy(), state.copy()
    seen: list[str] = []
    for s, apply in ((fast, lambda s: apply_event(s, pause, pos)),
                     (slow, lambda s: apply_parts(s, pause, pos, lambda part: None))):
        try:
            apply(s)
            seen.append("")
        except InvariantViolation as err:
            seen.append(str(err))
    assert seen[0] == seen[1], pause
    assert encode_state(fast) == encode_state(slow), (seen[0], pause)
    return fast, seen[0]


def _check_group(b: LogBuilder, pauses: list[ev.EpisodeTurnsRecorded]) -> set[str]:
    """Every pause both ways, and every bend of it; the problems seen."""
    state = fold(b.build())
    problems = set()
    for pause in pauses:
        pos = state.position + 1
        for name, bend in BENDS.items():
            _, problem = _both_ways(state, _replace(pause, **bend(pause)), pos)
            problems.add(problem.split(": ", 1)[-1])
        state, problem = _both_ways(state, pause, pos)
        assert problem == "", problem
    assert not state.episodes[pauses[0].group_id].samples[0].pending()
    return problems


@pytest.mark.parametrize("seed", range(6))
def test_generated_pauses_and_every_bend_fold_alike_both_ways(seed: int):
    rng = random.Random(seed)
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=N).start()
    b.admit("g1")
    problems = _check_group(b, _pauses(rng, "g1", turns=rng.randint(1, 5), dedupes=seed % 2 == 0))
    assert len(problems) > 20  # the bends break many different rules, not one


@pytest.mark.parametrize("dedupes", [True, False])
def test_a_resumed_attempt_reissues_and_its_bends_fold_alike_both_ways(dedupes: bool):
    rng = random.Random(7)
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=N).start()
    first = _pauses(rng, "g1", turns=4, dedupes=dedupes)
    b.admit("g1")
    for p in first[:2]:
        b.append(p)
    b.fail("g1")
    failed = fold(b.build())  # the failed attempt's answers come too late: refused
    assert "not admitted" in _both_ways(failed, first[2], failed.position + 1)[1]
    b.admit("g1")
    # attempt 2 asks again for the calls attempt 1 made and never saw answered
    asked = first[1].calls
    again = ev.EpisodeTurnsRecorded(
        event_id="again", epoch=1, ts=9.0, group_id="g1", attempt=2, segment_index=0, env_index=0,
        results=[], flushes=[], env="calc", dedupes_by_key=dedupes, calls=asked)
    state = fold(b.build())
    texts = {name: _both_ways(state, _replace(again, **bend(again)), state.position + 1)[1]
             for name, bend in {**BENDS, "request changed": lambda p: {"calls": _first(p.calls, request="z")},
                                "same attempt again": lambda p: {}}.items()}
    if not dedupes:  # an env that cannot deduplicate is never asked twice
        assert "cannot deduplicate" in texts["same attempt again"]
        return
    assert "re-issued with request z" in texts["request changed"]
    assert texts["same attempt again"] == ""
    state, _ = _both_ways(state, again, state.position + 1)
    twice = _both_ways(state, _replace(again, env_index=1), state.position + 1)[1]
    assert "already requested by attempt 2" in twice


Summary = tuple[tuple[tuple[int, ...], ...], tuple[tuple[float, ...], ...]]


def _first_starts(state: RunState, gid: str) -> Summary:
    """The summary by its definition: per sample, each answered turn's first model token
    (the lowest start among the turn's model segments) and its reward."""
    segs = [s for f in state.inflight[gid].flushes if f.kind == "model" for s in f.segments]
    starts, rewards = [], []
    for i, episode in enumerate(state.episodes[gid].samples):
        answered = [t for t in episode.turns if t.result is not None]
        starts.append(tuple(min(s.start for s in segs if (s.sample, s.turn) == (i, t.turn)) for t in answered))
        rewards.append(tuple(t.result.reward for t in answered))  # type: ignore[union-attr]
    return tuple(starts), tuple(rewards)


@pytest.mark.parametrize("seed", range(4))
def test_a_committed_group_keeps_each_turns_first_token_and_reward(seed: int):
    rng = random.Random(100 + seed)
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=N).start()
    b.admit("g1")
    for pause in _pauses(rng, "g1", turns=rng.randint(1, 6)):
        b.append(pause)
    state = fold(b.build())
    starts, rewards = _first_starts(state, "g1")
    lengths = list(state.inflight["g1"].recorded)
    b.commit("g1", rewards=[sum(r) for r in rewards], lengths=lengths)
    summary = fold(b.build()).groups["g1"].episode
    assert summary is not None and (summary.starts, summary.rewards) == (starts, rewards)
