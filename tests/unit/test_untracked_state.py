"""What an episode run's state holds for the cyclic garbage collector.

A full collection walks every object the collector tracks. An episode run's state holds
tens of thousands of small values -- each in-flight turn's call and result, each flush's
segments, each committed group's per-turn summary -- and before these types were kept
out of the collector's sight every full collection walked them all again
(``bench/bench_episode_ab.py``: 20 full collections a run instead of 5, about 0.25 ms
per group of the controller's CPU at 1024 generators). None of them can be part of a
reference cycle: they hold numbers, strings and lists of one another, never a
reference back. These tests fail if one of them becomes tracked again.
"""

from __future__ import annotations

import gc
import random

import msgspec
import pytest

from controller.core.episodes import InflightEpisodes, SampleEpisode, TurnRecord
from controller.core.fold import fold
from controller.core.state import decode_state, encode_state
from events import schema as ev
from events.codec import decode, encode
from tests.unit.log_builder import LogBuilder
from tests.unit.test_pause_fold import N, _first_starts, _pauses

_VALUES = [
    ev.Segment(sample=0, start=3, length=2, key="g1/m0.1", turn=1),
    ev.EnvCall(sample=0, turn=1, request="r0.1"),
    ev.EnvResult(sample=0, turn=1, reward=0.5, ended=False, observation_tokens=2, info={"why": "ok"}),
    ev.SegmentFlush(kind="model", weight_version=0, segments=[ev.Segment(sample=0, start=0, length=1, key="k")]),
    TurnRecord(turn=1, request="r0.1", attempt=1),
    SampleEpisode(turns=[TurnRecord(turn=1, request="r0.1", attempt=1)]),
    InflightEpisodes.empty(2, 1, "calc", True),
]


@pytest.mark.parametrize("value", _VALUES, ids=lambda v: type(v).__name__)
def test_the_values_an_episode_state_holds_are_not_tracked(value: object):
    assert not gc.is_tracked(value)
    # decoded (a snapshot, a log read) as built
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=type(value))
    assert again == value and not gc.is_tracked(again)


def test_events_are_not_tracked_built_or_decoded():
    pause = _pauses(random.Random(7), "g1", turns=3)[1]
    assert not gc.is_tracked(pause)
    decoded = decode(encode(pause))
    assert decoded == pause and not gc.is_tracked(decoded)
    assert not any(gc.is_tracked(x) for x in (*decoded.results, *decoded.calls, *decoded.flushes))


def test_a_committed_groups_summary_is_untracked_once_the_collector_saw_it():
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=N).start()
    b.admit("g1")
    for pause in _pauses(random.Random(3), "g1", turns=4):
        b.append(pause)
    state = fold(b.build())
    starts, rewards = _first_starts(state, "g1")
    b.commit("g1", rewards=[sum(r) for r in rewards], lengths=list(state.inflight["g1"].recorded))
    for summary in (fold(b.build()).groups["g1"].episode,
                    decode_state(encode_state(fold(b.build()))).groups["g1"].episode):
        assert summary is not None and (summary.starts, summary.rewards) == (starts, rewards)
        # a collection untracks a tuple whose items are all untracked: the inner tuples
        # of numbers at the first, the outer ones (their items untracked by then) at the next
        gc.collect()
        gc.collect()
        nested = [summary.starts, summary.rewards, *summary.starts, *summary.rewards]
        assert not gc.is_tracked(summary)
        assert [x for x in nested if gc.is_tracked(x)] == []
