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
  restore truncates ``flushes``, sets the counters back, and folds the flushes left
  again into the four lists (the same list objects: they are a fold of the flushes, so
  the mark copies none);
* on an ``InflightEpisodes`` (``episodes.record_completed`` / ``record_requested``): add
  to ``attempt_events``, set a sample's last call's ``call_result`` (its pending call)
  and its ``ended``, change its last call's ``call_attempt`` (a re-issued call), or
  append a row to the five ``call_*`` columns and point the sample's ``last`` at it:
  restore sets the counter back, truncates the columns to their marked length, sets
  each marked last call's ``call_result`` and ``call_attempt`` back, and derives
  ``last`` and ``ended`` from the rows again (into the same list objects: the mark
  copies neither, a restore is rare).

Nothing else of theirs changes under a pause (``attempt``, ``env``, ``dedupes_by_key``,
a sample's ``restarts`` entry, a row below the marked length but a last call's). Every record object stays the one the
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

from controller.core.episodes import InflightEpisodes
from controller.core.segments import InflightSegments, record_flush
from controller.core.state import RunState
from events.schema import EnvResult, EpisodeTurnsRecorded, SegmentsRecorded

#: each sample's last call at the mark: (its row, its result, its attempt)
_LastMark = tuple[int, EnvResult | None, int]

_COLUMNS = ("call_sample", "call_turn", "call_request", "call_attempt", "call_result")


class GroupMark:
    """What one group's in-flight records were at :func:`mark_group` (opaque)."""

    __slots__ = ("group_id", "segments", "seg_counts", "episodes", "events", "rows",
                 "turns", "pause", "reissued")

    def __init__(self, group_id: str) -> None:
        self.group_id = group_id
        #: the segment record at the mark (None: none existed)
        self.segments: InflightSegments | None = None
        #: len(flushes), attempt_flushes, version_token_sum, model_tokens
        self.seg_counts: tuple[int, int, int, int] = (0, 0, 0, 0)
        #: the episode record at the mark (None: none existed)
        self.episodes: InflightEpisodes | None = None
        #: its attempt_events and its rows
        self.events = 0
        self.rows = 0
        #: :func:`mark_group`: each sample's last call, as ``_LastMark`` says
        self.turns: list[_LastMark] = []
        #: :func:`mark_pause`: the one pause marked for, and the old ``call_attempt`` of
        #: each row whose call it would re-issue (None: a :func:`mark_group` mark)
        self.pause: EpisodeTurnsRecorded | SegmentsRecorded | None = None
        self.reissued: dict[int, int] = {}


def _mark_segments(state: RunState, mark: GroupMark) -> InflightEpisodes | None:
    seg = state.inflight.get(mark.group_id)
    if seg is not None:
        mark.segments = seg
        mark.seg_counts = (len(seg.flushes), seg.attempt_flushes, seg.version_token_sum, seg.model_tokens)
    rec = state.episodes.get(mark.group_id)
    if rec is not None:
        mark.episodes = rec
        mark.events, mark.rows = rec.attempt_events, len(rec.call_sample)
    return rec


def mark_pause(state: RunState, pause: EpisodeTurnsRecorded | SegmentsRecorded) -> GroupMark:
    """:func:`mark_group` for exactly one pause of its group, reading only what that
    pause can change. Its results and calls say which rows it touches: a result sets
    its sample's pending call's ``call_result`` (undone by setting it back to None); a
    call appends a row (undone by truncating the columns) unless its sample's last call
    is pending, when it re-issues that call (``episodes.record_requested``) and only its
    ``call_attempt`` is noted -- which can be the case only for a sample without a
    result in the same pause. So the mark reads no row but those, where
    :func:`mark_group` reads every sample's last call: in a live run those are cold in
    the cache (~9 us a pause for 16 samples when they were objects)."""
    mark = GroupMark(pause.group_id)
    mark.pause = pause
    rec = _mark_segments(state, mark)
    if rec is None or type(pause) is not EpisodeTurnsRecorded or not pause.calls:
        return mark
    answered = {r.sample for r in pause.results}
    last_row, c_result, c_attempt, n = rec.last, rec.call_result, rec.call_attempt, len(rec.last)
    for call in pause.calls:
        i = call.sample
        if i in answered or not 0 <= i < n:
            continue
        j = last_row[i]
        if j >= 0 and c_result[j] is None:
            mark.reissued[j] = c_attempt[j]
    return mark


def mark_group(state: RunState, group_id: str) -> GroupMark:
    """Note what a pause of ``group_id`` may change in ``state.inflight`` and ``state.episodes``."""
    mark = GroupMark(group_id)
    rec = _mark_segments(state, mark)
    if rec is not None:
        c_result, c_attempt = rec.call_result, rec.call_attempt
        mark.turns = [(j, c_result[j], c_attempt[j]) for j in rec.last if j >= 0]
    return mark


def restore_group(state: RunState, mark: GroupMark) -> None:
    """Put ``state.inflight`` and ``state.episodes`` back as they were for the marked group."""
    gid = mark.group_id
    seg = mark.segments  # a pause never replaces a record it found: no dict write back
    if seg is None:
        state.inflight.pop(gid, None)  # a pause that made the record takes it with it
    else:
        n_flushes, attempt_flushes = mark.seg_counts[:2]
        if len(seg.flushes) > n_flushes:
            # the per-sample lists and sums are a fold of the flushes: folded again from
            # those left, into the same list objects (the mark copies none; rare)
            del seg.flushes[n_flushes:]
            again = InflightSegments.empty(len(seg.recorded), seg.attempt)
            for flush in seg.flushes:
                record_flush(again, flush)
            seg.recorded[:], seg.stopped[:] = again.recorded, again.stopped
            seg.first_version[:], seg.last_version[:] = again.first_version, again.last_version
        seg.attempt_flushes, seg.version_token_sum, seg.model_tokens = mark.seg_counts[1:]
    rec = mark.episodes
    if rec is None:
        state.episodes.pop(gid, None)
        return
    if mark.pause is not None:
        _restore_pause(rec, mark)
        return
    rec.attempt_events = mark.events
    _truncate(rec, mark.rows)
    c_result, c_attempt = rec.call_result, rec.call_attempt
    for j, result, attempt in mark.turns:
        c_result[j], c_attempt[j] = result, attempt
    _relink(rec)


def _truncate(rec: InflightEpisodes, rows: int) -> None:
    """The call columns back to ``rows`` rows."""
    if len(rec.call_sample) > rows:
        for name in _COLUMNS:
            del getattr(rec, name)[rows:]


def _relink(rec: InflightEpisodes) -> None:
    """Each sample's ``last`` and ``ended`` as its rows say (written into the same lists):
    a restore's, so the marks copy neither."""
    last, c_result = [-1] * len(rec.last), rec.call_result
    for j, i in enumerate(rec.call_sample):
        last[i] = j
    rec.last[:] = last
    rec.ended[:] = [j >= 0 and c_result[j] is not None and c_result[j].ended for j in last]  # type: ignore[union-attr]


def _restore_pause(rec: InflightEpisodes, mark: GroupMark) -> None:
    """Undo what :func:`mark_pause`'s one pause recorded in ``rec``: its results are
    recorded before its calls, each part whole or not at all (checked, then recorded),
    and each adds one to ``attempt_events`` -- so the count says which parts went in."""
    pause = mark.pause
    applied, rec.attempt_events = rec.attempt_events - mark.events, mark.events
    if type(pause) is not EpisodeTurnsRecorded or not applied:
        return
    if pause.calls and applied == 1 + bool(pause.results):  # the calls went in: undo them first
        c_attempt = rec.call_attempt
        for j, attempt in mark.reissued.items():
            c_attempt[j] = attempt
        _truncate(rec, mark.rows)
        _relink(rec)  # each sample's last row as marked
    if pause.results:  # recorded first: in whenever anything is
        last_row, c_result = rec.last, rec.call_result
        for result in pause.results:
            c_result[last_row[result.sample]] = None
        _relink(rec)  # the answered samples had not ended
