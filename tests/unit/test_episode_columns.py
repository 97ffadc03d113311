"""An in-flight group's episode record keeps its calls in columns, and reads as before.

``InflightEpisodes`` holds one row per call in five flat lists and three per-sample
lists (``docs/episode-cost.md``, "Eleventh pass"), where it held an object per turn in a
list per sample. These check what the columns hold against the pauses folded into them
(one row per call, a re-issue changes its row, a restart drops its sample's rows and
re-points the others'), and that a snapshot of the format before them (6) is refused and
the log folded again to the same state."""

from __future__ import annotations

import random

import msgspec
import pytest

from controller.core.errors import SnapshotDecodeError
from controller.core.fold import fold, fold_raw
from controller.core.state import RunState, decode_state, encode_state
from controller.projector import Projector
from events import schema as ev
from events.codec import encode
from events.memory_store import MemoryEventStore
from tests.unit.log_builder import LogBuilder
from tests.unit.test_pause_fold import N, _pauses


def _played(pauses: list[ev.EpisodeTurnsRecorded]) -> list[list[tuple[int, str, int, ev.EnvResult | None]]]:
    """Per sample, (turn, request, attempt, result) of each call, from the pauses alone."""
    out: list[list[list]] = [[] for _ in range(N)]  # type: ignore[type-arg]
    for p in pauses:
        for r in p.results:
            out[r.sample][-1][3] = r
        for c in p.calls:
            out[c.sample].append([c.turn, c.request, p.attempt, None])
    return [[tuple(t) for t in sample] for sample in out]  # type: ignore[misc]


def _check_rows(state: RunState, gid: str) -> None:
    rec = state.episodes[gid]
    rows = len(rec.call_sample)
    assert [len(c) for c in (rec.call_turn, rec.call_request, rec.call_attempt, rec.call_result)] == [rows] * 4
    for i in range(N):
        mine = [j for j in range(rows) if rec.call_sample[j] == i]
        assert rec.last[i] == (mine[-1] if mine else -1)
        assert rec.ended[i] == bool(mine and rec.call_result[mine[-1]] is not None
                                    and rec.call_result[mine[-1]].ended)  # type: ignore[union-attr]


@pytest.mark.parametrize("seed", range(6))
def test_the_columns_hold_one_row_per_call_as_the_pauses_recorded_them(seed: int):
    pauses = _pauses(random.Random(seed), "g1", turns=5)
    for k in range(1, len(pauses) + 1):
        b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=N).start()
        b.admit("g1")
        for p in pauses[:k]:
            b.append(p)
        state = fold(b.build())
        rec = state.episodes["g1"]
        want = _played(pauses[:k])
        assert len(rec.call_sample) == sum(map(len, want))
        assert [[(t.turn, t.request, t.attempt, t.result) for t in e.turns] for e in rec.samples] == want
        assert {type(r) for r in rec.call_result} <= {ev.EnvResult, type(None)}
        _check_rows(state, "g1")
        assert decode_state(encode_state(state)) == state


def test_a_restart_drops_its_samples_rows_and_repoints_the_others():
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=2).start()
    b.admit("g1").flush("g1", {0: (0, 3), 1: (0, 2)}, turn=1)
    b.request("g1", {0: (1, "a"), 1: (1, "b")}, dedupes=False)
    b.complete("g1", {1: (1, 0.5, False, 2)}, restart=0)
    b.flush("g1", {1: (2, 2)}, kind="observation", version=None, turn=1)
    b.flush("g1", {1: (4, 1)}, turn=2).request("g1", {1: (2, "c")}, dedupes=False)
    b.fail("g1")
    b.append(ev.EpisodesRestarted(event_id="group:g1:restarted:a1", epoch=1, ts=1.0, group_id="g1",
                                  attempt=1, samples=[0], reason="test"))
    state = b.fold()
    rec = state.episodes["g1"]
    assert (rec.restarts, rec.call_sample, rec.call_turn, rec.call_request) == ([1, 0], [1, 1], [1, 2], ["b", "c"])
    assert rec.last == [-1, 1] and rec.ended == [False, False]


def _format_6(state: RunState) -> dict:  # type: ignore[type-arg]
    """``state`` as a format-6 snapshot held it: per sample a list of turn objects."""
    old = msgspec.to_builtins(state, builtin_types=(bytes,))
    old["state_format"] = 6
    for gid, rec in old["episodes"].items():
        samples = state.episodes[gid].samples
        rec["samples"] = [msgspec.to_builtins(e) for e in samples]
        for name in ("restarts", "last", "ended", "call_sample", "call_turn", "call_request",
                     "call_attempt", "call_result"):
            rec.pop(name, None)
    return old


def test_a_format_6_snapshot_is_refused_and_the_log_folded_again():
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=N).start()
    b.admit("g1")
    for p in _pauses(random.Random(11), "g1", turns=4)[:3]:
        b.append(p)
    store = MemoryEventStore()
    for stored in b.build():
        store.append_raw("r1", encode(stored.event), event_type=type(stored.event).__name__)
    full = fold_raw(b.encoded())
    assert full.episodes["g1"].call_sample
    store.save_snapshot("r1", full.position, msgspec.msgpack.encode(_format_6(full)))
    # refused: its episode records lack the columns (and it says format 6)
    with pytest.raises(SnapshotDecodeError):
        decode_state(store.load_snapshot("r1")[1])  # type: ignore[index]
    assert encode_state(Projector(store).get("r1").require()) == encode_state(full)
