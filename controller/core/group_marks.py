"""Undo marks for one group's in-flight records: put back what a pause recorded.

The log writer folds a worker's pause into the live state *before* the store write, so
that a bad flush (a segment off by one token, a result nobody asked for) is refused
instead of written: a written one would raise on every later fold and brick the run.
Folding a pause may raise part-way -- its results recorded, then its second flush
refused (``controller.core.reducer_pauses``) -- and a pause folded ahead of a store
write that then fails must be taken back too. :func:`mark_group` notes what the pause
handlers can change; :func:`restore_group` puts it back.

Covered: applying any number of pause events of the group -- ``EpisodeTurnsRecorded``
(``reducer_pauses.fold_pause``) and ``SegmentsRecorded``
(``reducer_groups._on_segments_recorded``) -- completed or stopped by an
``InvariantViolation`` part-way. Those handlers only ever

* create the group's ``InflightSegments`` / ``InflightEpisodes`` when it had none
  (``.empty``): restore removes them from ``state.inflight`` / ``state.episodes``;
* on an ``InflightSegments`` (``segments.record_flush``): append to ``flushes``, add to
  ``attempt_flushes``, ``version_token_sum`` and ``model_tokens``, and write items of the
  four per-sample lists ``recorded``, ``stopped``, ``first_version``, ``last_version``:
  restore truncates ``flushes``, sets the counters back, and writes the saved copies of
  the four lists back into the same list objects;
* on an ``InflightEpisodes`` (``episodes.record_completed`` / ``record_requested``): add
  to ``attempt_events``, set the last ``TurnRecord``'s ``result`` (its pending call),
  change the last ``TurnRecord``'s ``attempt`` (a re-issued call) or append a
  ``TurnRecord`` to a sample's ``turns``: restore sets the counter back, truncates each
  ``turns`` list to its marked length, and sets each sample's marked last
  ``TurnRecord``'s ``result`` and ``attempt`` back.

Nothing else of theirs changes under a pause (``attempt``, ``env``, ``dedupes_by_key``,
the ``samples`` list, a sample's ``restart``). Every record object stays the one the
state held at the mark (a holder of a reference sees it restored); nothing is
deep-copied. NOT covered: restarts, drops, admissions, commits, failures -- they
replace records (``episodes.restart``, ``segments.without_samples``) or change fields
a mark does not note; they are the controller's own decisions, or a commit, which
``reducer_groups.check_committed`` checks without applying. ``state.position`` is the
caller's.

Cost (``bench/bench_group_marks.py``: one 16-sample group with 10 recorded turns, its
segments and episodes; best of 5 x 2000, CPython 3.11 on a shared 2-core host): mark
1.6 us, mark + restore 3.3 us, against 16.6 us for mark + the next pause's fold +
restore. A pause that is written pays the mark only: ~12 pauses per group, ~20 us of
the controller's ~1 ms per group; the restore runs only for a refused pause or a
failed write.

:func:`mark_pause` marks for one known pause and reads only the turns it can change
(none but a re-issued call's); the log writer uses it: in a live run :func:`mark_group`
cost ~9 us a pause (the samples' last turns are cold in the cache), ~0.1 ms per group.

Pure: no I/O, no clock, no randomness, no logging.
"""

from __future__ import annotations

from controller.core.episodes import InflightEpisodes, TurnRecord
from controller.core.segments import InflightSegments
from controller.core.state import RunState
from events.schema import EnvResult, EpisodeTurnsRecorded, SegmentsRecorded

#: a sample's turns at the mark: (len(turns), last TurnRecord, its result, its attempt);
#: None for a sample with no turn yet
_TurnsMark = tuple[int, TurnRecord, EnvResult | None, int] | None


class GroupMark:
    """What one group's in-flight records were at :func:`mark_group` (opaque)."""

    __slots__ = ("group_id", "segments", "seg_lists", "seg_counts", "episodes", "events", "turns",
                 "pause", "reissued")

    def __init__(self, group_id: str) -> None:
        self.group_id = group_id
        #: the segment record at the mark (None: none existed)
        self.segments: InflightSegments | None = None
        #: copies of recorded, stopped, first_version, last_version
        self.seg_lists: tuple[list[int], list[bool], list[int], list[int]] | None = None
        #: len(flushes), attempt_flushes, version_token_sum, model_tokens
        self.seg_counts: tuple[int, int, int, int] = (0, 0, 0, 0)
        #: the episode record at the mark (None: none existed)
        self.episodes: InflightEpisodes | None = None
        #: its attempt_events, and per sample what ``_TurnsMark`` says
        self.events = 0
        self.turns: list[_TurnsMark] = []
        #: :func:`mark_pause`: the one pause marked for, and the old ``attempt`` of each
        #: sample whose call it would re-issue (None: a :func:`mark_group` mark)
        self.pause: EpisodeTurnsRecorded | SegmentsRecorded | None = None
        self.reissued: dict[int, int] = {}


def _mark_segments(state: RunState, mark: GroupMark) -> InflightEpisodes | None:
    seg = state.inflight.get(mark.group_id)
    if seg is not None:
        mark.segments = seg
        mark.seg_lists = (seg.recorded[:], seg.stopped[:], seg.first_version[:], seg.last_version[:])
        mark.seg_counts = (len(seg.flushes), seg.attempt_flushes, seg.version_token_sum, seg.model_tokens)
    rec = state.episodes.get(mark.group_id)
    if rec is not None:
        mark.episodes = rec
        mark.events = rec.attempt_events
    return rec


def mark_pause(state: RunState, pause: EpisodeTurnsRecorded | SegmentsRecorded) -> GroupMark:
    """:func:`mark_group` for exactly one pause of its group, reading only what that
    pause can change. Its results and calls say which turns it touches: a result sets
    its sample's pending call's ``result`` (undone by setting it back to None); a call
    appends a turn (undone by removing it) unless its sample's last call is pending,
    when it re-issues that call (``episodes.record_requested``) and only its
    ``attempt`` is noted -- which can be the case only for a sample without a result in
    the same pause. So the mark reads no sample's turns but those, where
    :func:`mark_group` reads every sample's last turn: in a live run those are cold in
    the cache, ~9 us a pause for 16 samples."""
    mark = GroupMark(pause.group_id)
    mark.pause = pause
    rec = _mark_segments(state, mark)
    if rec is None or type(pause) is not EpisodeTurnsRecorded or not pause.calls:
        return mark
    answered = {r.sample for r in pause.results}
    samples, n = rec.samples, len(rec.samples)
    for call in pause.calls:
        i = call.sample
        if i in answered or not 0 <= i < n:
            continue
        turns = samples[i].turns
        if turns and turns[-1].result is None:
            mark.reissued[i] = turns[-1].attempt
    return mark


def mark_group(state: RunState, group_id: str) -> GroupMark:
    """Note what a pause of ``group_id`` may change in ``state.inflight`` and ``state.episodes``."""
    mark = GroupMark(group_id)
    rec = _mark_segments(state, mark)
    if rec is not None:
        turns_marks: list[_TurnsMark] = []
        append = turns_marks.append  # once per sample per pause: an inline loop, no calls
        for episode in rec.samples:
            turns = episode.turns
            if turns:
                last = turns[-1]
                append((len(turns), last, last.result, last.attempt))
            else:
                append(None)
        mark.turns = turns_marks
    return mark


def restore_group(state: RunState, mark: GroupMark) -> None:
    """Put ``state.inflight`` and ``state.episodes`` back as they were for the marked group."""
    gid = mark.group_id
    seg = mark.segments  # a pause never replaces a record it found: no dict write back
    if seg is None:
        state.inflight.pop(gid, None)  # a pause that made the record takes it with it
    else:
        n_flushes, seg.attempt_flushes, seg.version_token_sum, seg.model_tokens = mark.seg_counts
        del seg.flushes[n_flushes:]
        recorded, stopped, first, last = mark.seg_lists  # type: ignore[misc]
        seg.recorded[:], seg.stopped[:] = recorded, stopped  # the same list objects
        seg.first_version[:], seg.last_version[:] = first, last
    rec = mark.episodes
    if rec is None:
        state.episodes.pop(gid, None)
        return
    if mark.pause is not None:
        _restore_pause(rec, mark)
        return
    rec.attempt_events = mark.events
    for episode, turns_mark in zip(rec.samples, mark.turns):
        if turns_mark is None:
            episode.turns.clear()
        else:
            n, last, last.result, last.attempt = turns_mark
            del episode.turns[n:]


def _restore_pause(rec: InflightEpisodes, mark: GroupMark) -> None:
    """Undo what :func:`mark_pause`'s one pause recorded in ``rec``: its results are
    recorded before its calls, each part whole or not at all (checked, then recorded),
    and each adds one to ``attempt_events`` -- so the count says which parts went in."""
    pause = mark.pause
    applied, rec.attempt_events = rec.attempt_events - mark.events, mark.events
    if type(pause) is not EpisodeTurnsRecorded or not applied:
        return
    samples = rec.samples
    if pause.calls and applied == 1 + bool(pause.results):  # the calls went in: undo them first
        reissued = mark.reissued
        for call in pause.calls:
            turns = samples[call.sample].turns
            if call.sample in reissued:
                turns[-1].attempt = reissued[call.sample]
            else:
                turns.pop()
    if pause.results:  # recorded first: in whenever anything is
        for result in pause.results:
            samples[result.sample].turns[-1].result = None
