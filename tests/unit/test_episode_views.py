"""The read-only views of episodes: ``replay --episode``, ``tail``, ``audit``, ``staleness``
-- from a log built event by event (the same two-turn group as the reducer's tests)."""

from __future__ import annotations

import pytest
import torch

from cli import render
from controller.projector import Projection
from replay.audit import build_report
from replay.episode import EpisodeNotFound, episode_view, fill_ids, render_episode
from replay.staleness import Trace, analyze
from tests.unit.log_builder import LogBuilder
from workers.dataplane import MemoryDataPlane


def _log() -> LogBuilder:
    """Sample 0 plays two turns (3 + 2 model tokens, 4 observation tokens between);
    sample 1 ends after its first turn (5 tokens); the group commits and is trained."""
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=2).start()
    b.admit("g1").flush("g1", {0: (0, 3), 1: (0, 5)}, turn=1)
    b.request("g1", {0: (1, "a"), 1: (1, "b")})
    b.complete("g1", {0: (1, 0.25, False, 4), 1: (1, 0.5, True, 0)})
    b.flush("g1", {0: (3, 4)}, kind="observation", version=None, turn=1)
    b.flush("g1", {0: (7, 2)}, turn=2).request("g1", {0: (2, "c")})
    b.complete("g1", {0: (2, 0.5, True, 0)})
    return b.commit("g1", rewards=[0.75, 0.5], lengths=[9, 5]).train_step(["g1"])


def _events(b: LogBuilder) -> list:
    return [e.event for e in b.build()]


def test_an_episode_is_shown_turn_by_turn_with_the_committed_rows_ids():
    b = _log()
    events = _events(b)
    view = episode_view("r1", events, "g1", 0)
    assert view.committed_by == 1 and view.reward == 0.75
    one, two = view.turns[1], view.turns[2]
    assert [(p.kind, p.start, p.length) for p in one.pieces] == [("model", 0, 3), ("observation", 3, 4)]
    assert (one.request, one.reward, one.ended) == ("a", 0.25, False)
    assert (two.request, two.reward, two.ended) == ("c", 0.5, True)
    key = next(e for e in events if type(e).__name__ == "GroupCommitted").payload_keys[0]
    plane = MemoryDataPlane()
    ids = [7, 8] + list(range(100, 109))  # a 2-token prompt, then 9 completion tokens
    plane.put("r1", [key], [{"input_ids": torch.tensor(ids), "prompt_len": torch.tensor(2)}])
    assert fill_ids(view, plane, key)
    assert view.prompt_ids == [7, 8]
    assert [p.ids for p in one.pieces + two.pieces] == [[100, 101, 102], [103, 104, 105, 106], [107, 108]]
    text = "\n".join(render_episode(view))
    assert "committed by attempt 1, return 0.7500" in text
    assert "r1/g1/s0/t2 request c, attempt 1: reward 0.5000, ended" in text
    assert "[103, 104, 105, 106]" in text


def test_without_rows_the_episode_is_shown_without_ids():
    view = episode_view("r1", _events(_log()), "g1", 1)
    assert not fill_ids(view, MemoryDataPlane(), "absent")
    assert [p.ids for t in view.turns.values() for p in t.pieces] == [None]
    assert view.turns[1].reward == 0.5 and view.turns[1].ended


def test_a_restart_drops_the_turns_before_it_and_says_why():
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=2).start()
    b.admit("g1").flush("g1", {0: (0, 3), 1: (0, 5)}, turn=1)
    b.request("g1", {0: (1, "a"), 1: (1, "b")}, dedupes=False).fail("g1")
    b.restart_episodes("g1", [0, 1]).admit("g1")
    view = episode_view("r1", _events(b), "g1", 0)
    assert view.restart == 1 and view.turns == {} and view.attempts == 2
    assert view.restarts == ["after attempt 1: test"]


def test_a_call_re_issued_by_a_later_attempt_says_so():
    """A deduplicating env's call whose result never came is re-issued with the same key
    by the next attempt; the view named only the first intent's attempt, so the second
    issue of the key (and where its result came from) was nowhere in the output."""
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=2).start()
    b.admit("g1").flush("g1", {0: (0, 3), 1: (0, 5)}, turn=1)
    b.request("g1", {0: (1, "a"), 1: (1, "b")}).fail("g1").admit("g1")
    b.request("g1", {0: (1, "a"), 1: (1, "b")})
    b.complete("g1", {0: (1, 0.5, True, 0), 1: (1, 0.25, True, 0)})
    view = episode_view("r1", _events(b.commit("g1", rewards=[0.5, 0.25], lengths=[3, 5])), "g1", 0)
    one = view.turns[1]
    assert (one.request, one.requested_by, one.reissued_by, one.reward) == ("a", 1, [2], 0.5)
    assert "r1/g1/s0/t1 request a, attempt 1, re-issued by 2: reward 0.5000, ended" in \
        "\n".join(render_episode(view))
    assert b.fold().groups["g1"].consumed_step is None  # a valid log: the fold accepts it


def test_lost_segment_rows_restart_an_episode_that_made_calls():
    """SegmentsDropped: every sample with a lost row loses all its recorded segments
    (``docs/segments.md``, recovery rule 6) and records them again from the prompt; one
    that had made calls begins its episode again (new keys), as the fold restarts it.
    The view must not show the lost pieces or calls beside the new ones, while the
    other sample is left as it is."""
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=2).start()
    b.admit("g1").flush("g1", {0: (0, 3), 1: (0, 5)}, turn=1)
    b.request("g1", {0: (1, "a"), 1: (1, "b")}).fail("g1")
    b.drop_segments("g1", ["g1/a1/s0/k0"]).admit("g1").flush("g1", {0: (0, 3)}, turn=1)
    view = episode_view("r1", _events(b), "g1", 0)
    assert [(p.attempt, p.start, p.length) for p in view.turns[1].pieces] == [(2, 0, 3)]
    assert view.turns[1].request is None and view.restart == 1  # its calls begin again
    assert view.restarts == ["after attempt 1: its segments were dropped (missing ['g1/a1/s0/k0']); "
                             "its episode begins again"]
    other = episode_view("r1", _events(b), "g1", 1)
    assert [(p.attempt, p.length) for p in other.turns[1].pieces] == [(1, 5)] and not other.restarts
    assert other.turns[1].request == "b" and other.restart == 0
    state = b.fold()
    played = state.episodes["g1"].samples
    assert (played[0].restart, played[0].turns, played[1].restart) == (1, [], 0)
    assert [t.request for t in played[1].turns] == ["b"]


@pytest.mark.parametrize("group, sample, why", [
    ("g9", 0, "never admitted"), ("g1", 2, "has samples 0..1"),
])
def test_an_unknown_episode_is_named(group, sample, why):
    with pytest.raises(EpisodeNotFound, match=why):
        episode_view("r1", _events(_log()), group, sample)


def test_a_single_turn_group_is_not_an_episode():
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1).start().group("g1")
    with pytest.raises(EpisodeNotFound, match="no episode records"):
        episode_view("r1", _events(b), "g1", 0)


def test_tail_shows_an_episodes_calls_and_results_as_turns():
    lines = {type(e.event).__name__: render.event_line(e.position, e.event) for e in _log().build()}
    assert "calls=[s0/t2]" in lines["EnvStepsRequested"]
    assert "results=[s0/t2=0.5!]" in lines["EnvStepsCompleted"]
    assert "segments=[s0/t2:2]" in lines["SegmentsRecorded"]


def test_audit_and_staleness_count_the_turns_consumed():
    b = _log()
    state = b.fold()
    report = build_report(Projection(state=state, problem=None, log_end=len(b), last_ts=0.0))
    assert report.summary["episodes"] == {"groups": 1, "episodes": 2, "turns": 3, "turns_max": 2,
                                          "groups_in_flight": 0, "groups_failed": 0}
    staleness = analyze(state, Trace())
    assert [r.turns for r in staleness.steps] == [3] and staleness.summary["turns"] == 3


def test_audit_tells_a_failed_episode_group_from_one_in_flight():
    """A failed group keeps its episodes' calls for its next attempt, and one that ran
    out of attempts keeps them for good (no event says it was given up); counted as "in
    flight", a finished run whose groups failed read as one with episodes still playing."""
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=2).start()
    b.admit("g1").flush("g1", {0: (0, 3), 1: (0, 5)}, turn=1)
    b.request("g1", {0: (1, "a"), 1: (1, "b")}).fail("g1")
    b.admit("g2").flush("g2", {0: (0, 3), 1: (0, 5)}, turn=1).request("g2", {0: (1, "a"), 1: (1, "b")})
    state = b.fold()
    report = build_report(Projection(state=state, problem=None, log_end=len(b), last_ts=0.0))
    counts = report.summary["episodes"]
    assert (counts["groups_in_flight"], counts["groups_failed"]) == (1, 1)
    lines = [str(t) for t in render.audit_tables(report.to_dict(), 10) if "episodes:" in str(t)]
    assert lines and lines[0].endswith("1 groups in flight, 1 failed (calls kept for a retry)")
