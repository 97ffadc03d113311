"""One event per episode pause (``EpisodeTurnsRecorded``): it stands for exactly the
events an older log holds for the same pause, for the reducer and for every reader.

Each test builds the two-turn group of the reducer's tests event by event (the old
shape: up to four events per pause), merges each pause's run of events into one
``EpisodeTurnsRecorded`` as the writer now appends it, and checks that both logs read
the same."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from cli.tail_cmd import _TailPrinter
from controller.core.errors import InvariantViolation
from controller.core.fold import apply_raw, fold
from controller.core.state import initial_state
from controller.core.turns import expand, expanded, expanded_at
from controller.projector import Projection
from events import codec
from events import schema as ev
from replay.audit import build_report
from replay.episode import episode_view, render_episode
from replay.staleness import Trace, analyze
from tests.unit.log_builder import LogBuilder
from tests.unit.test_episode_views import _log

_PARTS = (ev.EnvStepsCompleted, ev.SegmentsRecorded, ev.EnvStepsRequested)


def _pause(run: list[Any]) -> ev.EpisodeTurnsRecorded:
    first = run[0]
    segs = [e for e in run if type(e) is ev.SegmentsRecorded]
    done = [e for e in run if type(e) is ev.EnvStepsCompleted]
    asked = [e for e in run if type(e) is ev.EnvStepsRequested]
    env_index = (done or asked)[0].index if done or asked else 0
    seg_index = segs[0].index if segs else 0
    return ev.EpisodeTurnsRecorded(
        event_id=ev.episode_turns_event_id(first.group_id, first.attempt, seg_index, env_index),
        epoch=first.epoch, ts=first.ts, group_id=first.group_id, attempt=first.attempt,
        segment_index=seg_index, env_index=env_index,
        results=done[0].results if done else [],
        flushes=[ev.SegmentFlush(kind=s.kind, weight_version=s.weight_version, segments=s.segments)
                 for s in segs],
        env=asked[0].env if asked else "", dedupes_by_key=asked[0].dedupes_by_key if asked else False,
        calls=asked[0].calls if asked else [])


def _runs(events: list[Any]) -> list[list[Any]]:
    """The events split into pauses (results?, segments*, intent?) and other events."""
    out: list[list[Any]] = []
    for e in events:
        last = out[-1] if out else None
        joins = (last is not None and type(e) in _PARTS and type(last[0]) in _PARTS
                 and (last[0].group_id, last[0].attempt) == (e.group_id, e.attempt)
                 and type(last[-1]) is not ev.EnvStepsRequested
                 and type(e) is not ev.EnvStepsCompleted)
        if joins:
            last.append(e)
        else:
            out.append([e])
    return out


def _paused(b: LogBuilder) -> list[ev.StoredEvent]:
    """``b``'s log as the writer appends it now: one event per pause of several events."""
    runs = _runs([s.event for s in b.build()])
    merged = [_pause(r) if len(r) > 1 else r[0] for r in runs]
    return [ev.StoredEvent(position=i, event=e) for i, e in enumerate(merged, start=1)]


def test_a_pause_stands_for_its_results_segments_and_intent_in_order():
    old = [s.event for s in _log().build()]
    new = [s.event for s in _paused(_log())]
    assert any(type(e) is ev.EpisodeTurnsRecorded for e in new)
    assert len(new) < len(old)
    # ids, indices and epochs included; a pause's parts share its one ts (the builder
    # gave each old event its own)
    untimed = lambda events: [msgspec.structs.replace(e, ts=0.0) for e in events]  # noqa: E731
    assert untimed(expanded(new)) == untimed(old)


def test_a_pause_expands_to_the_ids_and_indices_of_its_parts():
    pause = ev.EpisodeTurnsRecorded(
        event_id="p", epoch=2, ts=5.0, group_id="g", attempt=3, segment_index=4, env_index=6,
        results=[ev.EnvResult(sample=0, turn=1, reward=0.5, ended=False, observation_tokens=2)],
        flushes=[ev.SegmentFlush(kind="observation", weight_version=None, segments=[]),
                 ev.SegmentFlush(kind="model", weight_version=1, segments=[])],
        env="calc", dedupes_by_key=True, calls=[ev.EnvCall(sample=0, turn=2, request="x")])
    parts = expand(pause)
    assert [(type(p).__name__, p.index, p.event_id) for p in parts] == [
        ("EnvStepsCompleted", 6, "group:g:env:completed:a3:k6"),
        ("SegmentsRecorded", 4, "group:g:segments:a3:k4"),
        ("SegmentsRecorded", 5, "group:g:segments:a3:k5"),
        ("EnvStepsRequested", 7, "group:g:env:requested:a3:k7"),
    ]
    assert all((p.epoch, p.ts, p.group_id, p.attempt) == (2, 5.0, "g", 3) for p in parts)


def test_old_and_new_logs_fold_audit_and_count_turns_alike():
    old, new = _log().fold(), fold(_paused(_log()))
    assert new.episodes == old.episodes and new.inflight == old.inflight
    assert new.groups["g1"].episode == old.groups["g1"].episode
    reports = [build_report(Projection(state=s, problem=None, log_end=s.position, last_ts=0.0))
               for s in (old, new)]
    assert reports[0].summary["episodes"] == reports[1].summary["episodes"]
    assert reports[1].ok
    assert [r.turns for r in analyze(new, Trace()).steps] == [3]


def test_the_raw_fold_and_its_observers_see_a_pauses_parts_at_its_position():
    paused = _paused(_log())
    seen: list[tuple[str, int]] = []
    watches = {cls: (lambda e, pos, state: seen.append((type(e).__name__, pos))) for cls in _PARTS}
    state = initial_state()
    apply_raw(state, [(s.position, codec.encode(s.event)) for s in paused], watches)
    expected = [(type(e).__name__, pos) for pos, e in expanded_at((s.position, s.event) for s in paused)
                if type(e) in _PARTS]
    assert seen == expected and len({pos for _, pos in seen}) < len(seen)
    assert state.episodes == _log().fold().episodes


def test_replay_episode_and_tail_show_the_same_turns():
    old = episode_view("r1", [s.event for s in _log().build()], "g1", 0)
    new = episode_view("r1", [s.event for s in _paused(_log())], "g1", 0)
    assert render_episode(new) == render_episode(old)


def test_tail_prints_a_pause_as_the_lines_of_its_parts(capsys: pytest.CaptureFixture[str]):
    printer = _TailPrinter(as_json=False)
    for s in _paused(_log()):
        printer.emit(s.position, s.event)
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[3] for line in lines]
    assert names == [type(s.event).__name__ for s in _log().build()]
    assert any("calls=[s0/t2]" in line for line in lines)


def _bad_pause(b: LogBuilder, **fields: Any) -> list[ev.StoredEvent]:
    base = dict(event_id="bad", epoch=b.epoch, ts=b.ts(), group_id="g1", attempt=1,
                segment_index=1, env_index=0, results=[], flushes=[], env="calc",
                dedupes_by_key=True, calls=[])
    return b.build() + [ev.StoredEvent(position=b.last_position + 1,
                                       event=ev.EpisodeTurnsRecorded(**{**base, **fields}))]


@pytest.mark.parametrize("fields, message", [
    pytest.param({"results": [ev.EnvResult(sample=0, turn=1, reward=1.0, ended=True)]},
                 "no call was requested", id="results-for-calls-never-asked"),
    pytest.param({"calls": [ev.EnvCall(sample=0, turn=2, request="a")]},
                 "the next call of this episode is turn 1", id="turns-out-of-order"),
    pytest.param({"segment_index": 5, "flushes": [ev.SegmentFlush(weight_version=0, segments=[])]},
                 "index", id="segment-index-gap"),
    pytest.param({}, "a pause with no results, segments or calls", id="empty"),
    pytest.param({"flushes": [ev.SegmentFlush(weight_version=0, segments=[ev.Segment(
                     sample=0, start=3, length=2, key="k", turn=1)])],
                  "calls": [ev.EnvCall(sample=0, turn=2, request="a")]},
                 "the next call of this episode is turn 1", id="a-later-part-breaks-a-rule"),
])
def test_a_pause_is_held_to_the_rules_of_its_parts(fields: dict[str, Any], message: str):
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=2).start()
    b.admit("g1").flush("g1", {0: (0, 3), 1: (0, 5)}, turn=1)
    events = _bad_pause(b, **fields)
    with pytest.raises(InvariantViolation, match=message) as info:
        fold(events)
    assert info.value.position == events[-1].position
    # the raw fold with observers (audit, staleness) stops at the same place
    state, raw = initial_state(), [(s.position, codec.encode(s.event)) for s in events]
    with pytest.raises(InvariantViolation, match=message):
        apply_raw(state, raw, {ev.SegmentsRecorded: lambda e, pos, st: None})
    assert state.position == events[-2].position


def test_the_dashboards_history_finds_a_pauses_parts_by_their_type():
    from events.memory_store import MemoryEventStore
    from views.dashboard.history import EventQuery, find_events, tail_rows

    store = MemoryEventStore()
    for s in _paused(_log()):
        store.append_raw("r1", codec.encode(s.event), event_type=type(s.event).__name__)
    old = [s.event for s in _log().build()]
    asked = find_events(store, "r1", EventQuery(type="EnvStepsRequested"))["events"]
    assert len(asked) == sum(type(e) is ev.EnvStepsRequested for e in old) == 2
    assert {r["type"] for r in asked} == {"EnvStepsRequested"}
    rows = tail_rows(store, "r1", store.last_position("r1"))
    assert [r["type"] for r in rows] == [type(e).__name__ for e in old]  # the log is short


def test_a_snapshot_taken_mid_episode_resumes_over_pauses_as_the_full_fold():
    from controller.core.state import decode_state, encode_state
    from controller.projector import Projector
    from events.memory_store import MemoryEventStore

    paused = _paused(_log())
    store = MemoryEventStore()
    for s in paused:
        store.append_raw("r1", codec.encode(s.event), event_type=type(s.event).__name__)
    full = Projector(store).get("r1", snapshot=False).require()
    assert full.episodes == _log().fold().episodes
    pauses = [s.position for s in paused if type(s.event) is ev.EpisodeTurnsRecorded]
    # right after the first pause: the group is mid-episode, more pauses in the tail
    at = pauses[0]
    assert pauses[-1] > at
    half = Projector(store).get("r1", until=at).require()
    assert "g1" in half.inflight and decode_state(encode_state(half)) == half
    store.save_snapshot("r1", at, encode_state(half))
    assert Projector(store).get("r1").require() == full


def test_the_dashboard_refuses_to_search_for_pauses_by_their_own_type():
    # a pause never shows as a row of its own (its parts do): a search for its type
    # would scan the whole log and find nothing, with no word why
    from views.dashboard.history import EventQuery

    with pytest.raises(ValueError, match="EnvStepsCompleted, EnvStepsRequested, SegmentsRecorded"):
        EventQuery.from_params({"type": "EpisodeTurnsRecorded"})
