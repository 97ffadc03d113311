"""An undo mark (``controller.core.group_marks``) puts a group's in-flight records back
exactly: mark, apply a pause -- valid, or bent into each kind of bad one that raises
part-way -- restore, and the state's snapshot bytes are those before the pause, with the
same record objects in the state (a holder of one sees it restored).

The pauses are ``test_pause_fold``'s generated ones and its bends; the first pause of a
group (which creates the records), a resumed attempt's re-issued calls (which change the
last turn's attempt), single ``SegmentsRecorded`` events, and several pauses under one
mark are each covered."""

from __future__ import annotations

import random

import msgspec
import pytest

from controller.core.errors import InvariantViolation
from controller.core.fold import fold
from controller.core.group_marks import mark_group, mark_pause, restore_group
from controller.core.reducer import apply_event
from controller.core.state import RunState, encode_state
from events import schema as ev
from tests.unit.log_builder import LogBuilder
from tests.unit.test_pause_fold import BENDS, N, _pauses

_replace = msgspec.structs.replace


def _records(state: RunState, gid: str) -> tuple[object, object]:
    return state.inflight.get(gid), state.episodes.get(gid)


def _round_trip(state: RunState, event: ev.Event, gid: str) -> tuple[bool, bool]:
    """Mark ``gid`` (with :func:`mark_group`, then again with :func:`mark_pause` for the
    event), apply ``event`` at the next position, restore; asserts the state and the
    records held before are exactly as they were, both ways. Returns (raised, changed):
    whether applying raised, and whether it had changed the state before the restore."""
    first = _round_trip_with(state, event, gid, lambda: mark_group(state, gid))
    assert _round_trip_with(state, event, gid, lambda: mark_pause(state, event)) == first
    return first


def _round_trip_with(state: RunState, event: ev.Event, gid: str, marker) -> tuple[bool, bool]:  # type: ignore[no-untyped-def]
    pos = state.position + 1
    before = encode_state(state)
    held = _records(state, gid)
    held_bytes = [msgspec.msgpack.encode(r) for r in held]
    mark = marker()
    try:
        apply_event(state, event, pos)
        raised = False
    except InvariantViolation:
        raised = True
    state.position = pos - 1  # the position is the caller's, not the mark's
    changed = encode_state(state) != before
    restore_group(state, mark)
    assert encode_state(state) == before, (raised, event)
    after = _records(state, gid)
    assert all(a is h for a, h in zip(after, held)), "a record was replaced"
    assert [msgspec.msgpack.encode(r) for r in held] == held_bytes
    return raised, changed


def _check_pauses(state: RunState, pauses: list[ev.EpisodeTurnsRecorded]) -> tuple[int, int]:
    """Every pause and every bend of it round-trips; then the pause is applied for real.
    Returns (bends that raised after changing the state, bends that raised)."""
    partial = raised_count = 0
    for pause in pauses:
        gid = pause.group_id
        for bend in BENDS.values():
            raised, changed = _round_trip(state, _replace(pause, **bend(pause)), gid)
            raised_count += raised
            partial += raised and changed
        assert _round_trip(state, pause, gid) == (False, True)
        apply_event(state, pause, state.position + 1)
    return partial, raised_count


def _admitted(*gids: str, trainer_version: int = 0) -> LogBuilder:
    """A run whose trainer has made ``trainer_version`` versions, with ``gids`` admitted."""
    b = LogBuilder(run_id="r1", window=2, groups_per_step=1, samples_per_group=N).start()
    for v in range(trainer_version):
        b.group(f"w{v}").train_step([f"w{v}"]).publish()
    for gid in gids:
        b.admit(gid)
    return b


def _versioned(rng: random.Random, pauses: list[ev.EpisodeTurnsRecorded]) -> list[ev.EpisodeTurnsRecorded]:
    """The pauses with their model tokens sampled by versions rising from 0 to 2, not all
    by 0: the records' version fields and sums then change from pause to pause."""
    out, version = [], 0
    for p in pauses:
        flushes = []
        for f in p.flushes:
            if f.weight_version is not None:
                version = min(2, version + rng.randint(0, 1))
                f = _replace(f, weight_version=version)
            flushes.append(f)
        out.append(_replace(p, flushes=flushes))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_every_pause_and_every_bend_is_undone_exactly(seed: int):
    rng = random.Random(seed)
    # a second group in flight beside: its records must not move, nor the dicts' order
    b = _admitted("g0", "g1", trainer_version=2)
    b.append(_versioned(rng, _pauses(rng, "g0", turns=2))[0])
    state = fold(b.build())
    pauses = _versioned(rng, _pauses(rng, "g1", turns=rng.randint(1, 6), dedupes=seed % 2 == 0))
    partial, raised = _check_pauses(state, pauses)
    assert raised > len(BENDS) * len(pauses) // 2  # most bends break a rule
    assert partial > 0  # some broke one after earlier parts were recorded: restore undid them
    assert list(state.inflight) == ["g0", "g1"] and list(state.episodes) == ["g0", "g1"]


def test_the_first_pause_creates_the_records_and_restore_removes_them():
    state = fold(_admitted("g1").build())
    first = _pauses(random.Random(3), "g1", turns=3)[0]
    assert _round_trip(state, first, "g1") == (False, True)
    assert "g1" not in state.inflight and "g1" not in state.episodes
    # its flush recorded, then its calls refused: the record the flush made goes too
    bad_calls = _replace(first, calls=first.calls + first.calls[:1])
    assert _round_trip(state, bad_calls, "g1") == (True, True)
    assert "g1" not in state.inflight and "g1" not in state.episodes


def test_a_samples_first_call_after_another_samples_is_undone():
    """Sample 1 asks for its first turn after sample 0 asked for its own: its turns list
    was empty at the mark."""
    b = _admitted("g1").flush("g1", {0: (0, 3)}, turn=1).request("g1", {0: (1, "a")})
    state = fold(b.build())
    later = ev.EpisodeTurnsRecorded(
        event_id="later", epoch=1, ts=9.0, group_id="g1", attempt=1, segment_index=1, env_index=1,
        results=[], env="calc", dedupes_by_key=True,
        flushes=[ev.SegmentFlush(kind="model", weight_version=0, segments=[
            ev.Segment(sample=1, start=0, length=2, key="g1/m1.1", turn=1)])],
        calls=[ev.EnvCall(sample=1, turn=1, request="b")])
    assert _round_trip(state, later, "g1") == (False, True)
    assert state.episodes["g1"].samples[1].turns == []


def test_several_pauses_under_one_mark_and_nested_marks_are_undone():
    state = fold(_admitted("g1").build())
    pauses = _pauses(random.Random(5), "g1", turns=4)
    apply_event(state, pauses[0], state.position + 1)
    before, pos = encode_state(state), state.position
    outer = mark_group(state, "g1")
    inner = None
    for k, pause in enumerate(pauses[1:]):
        if k == 1:
            inner = mark_group(state, "g1")
            mid = encode_state(state)
        apply_event(state, pause, state.position + 1)
    assert inner is not None
    restore_group(state, inner)
    state.position = pos + 1
    assert encode_state(state) == mid
    restore_group(state, outer)
    state.position = pos
    assert encode_state(state) == before


@pytest.mark.parametrize("dedupes", [True, False])
def test_a_resumed_attempts_reissue_is_undone(dedupes: bool):
    rng = random.Random(7)
    b = _admitted()
    first = _pauses(rng, "g1", turns=4, dedupes=dedupes)
    b.admit("g1")
    for p in first[:2]:
        b.append(p)
    b.fail("g1").admit("g1")
    state = fold(b.build())
    again = ev.EpisodeTurnsRecorded(
        event_id="again", epoch=1, ts=9.0, group_id="g1", attempt=2, segment_index=0, env_index=0,
        results=[], flushes=[], env="calc", dedupes_by_key=dedupes, calls=first[1].calls)
    held = [e.turns[-1] for e in state.episodes["g1"].samples if e.turns]
    assert held and all(t.attempt == 1 for t in held)
    raised, changed = _round_trip(state, again, "g1")
    assert (raised, changed) == ((False, True) if dedupes else (True, False))
    assert all(t.attempt == 1 for t in held)  # the re-issue set 2 on these very records
    for bend in BENDS.values():
        _round_trip(state, _replace(again, **bend(again)), "g1")


def test_single_segment_flushes_are_undone():
    b = _admitted("g1").flush("g1", {0: (0, 3), 1: (0, 2)})
    b.flush("g1", {0: (3, 4, True), 1: (2, 1)})
    b.flush("g1", {1: (2, 1)}, index=1, version=5)  # weights the trainer never made
    b.flush("g1", {1: (3, 2)}, index=1)  # off by one token
    first, second, too_new, off = (s.event for s in b.build()[-4:])
    state = fold(b.build()[:-4])
    assert _round_trip(state, first, "g1") == (False, True)
    assert "g1" not in state.inflight
    apply_event(state, first, state.position + 1)
    seg = state.inflight["g1"]
    lists = (seg.recorded, seg.stopped, seg.first_version, seg.last_version, seg.flushes)
    assert _round_trip(state, second, "g1") == (False, True)
    assert all(a is b for a, b in zip(lists, (seg.recorded, seg.stopped, seg.first_version,
                                              seg.last_version, seg.flushes)))
    assert seg.recorded == [3, 2, 0, 0] and seg.stopped == [False] * N
    assert len(seg.flushes) == 1 and seg.attempt_flushes == 1 and seg.model_tokens == 5
    assert _round_trip(state, too_new, "g1") == (True, False)
    assert _round_trip(state, off, "g1") == (True, False)
