"""What one ``EpisodeTurnsRecorded`` stands for: the events a pause used to append.

A pause of a group's episodes records its results, its observation and model segments
and the intent of its next calls in one event (one append, one hash link, one fold
step, where it took four). Every reader -- the reducer, the fold's observers, replay,
``tail``, the dashboard, the trace, the what-if -- goes through :func:`expand`, so each
sees exactly the ``EnvStepsCompleted``, ``SegmentsRecorded`` and ``EnvStepsRequested``
events an older log holds for the same pause, with the same ids, indices and order, and
the core's order checks run on them unchanged. Logs written before the event existed
hold those events themselves and read as they always did. One exception, for speed: the
fold itself checks and records a pause's results and calls straight from the pause
(``controller.core.reducer_pauses``), with the parts' own rule functions, to exactly
the state and violations that folding :func:`expand`'s parts gives.

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from events.schema import (
    AnyEvent,
    EnvStepsCompleted,
    EnvStepsRequested,
    EpisodeTurnsRecorded,
    SegmentFlush,
    SegmentsRecorded,
    env_steps_event_id,
    segments_event_id,
)

#: the events a pause's parts are: what a reader may see instead of the pause
PART_TYPES = (EnvStepsCompleted, SegmentsRecorded, EnvStepsRequested)


def expand(e: EpisodeTurnsRecorded) -> list[AnyEvent]:
    """The events ``e`` stands for, in the order the pause would have appended them;
    each carries ``e``'s epoch, ts and schema version."""
    gid, attempt, env = e.group_id, e.attempt, e.env_index
    common = {"epoch": e.epoch, "ts": e.ts, "schema_version": e.schema_version,
              "group_id": gid, "attempt": attempt}
    out: list[AnyEvent] = []
    if e.results:
        out.append(EnvStepsCompleted(
            event_id=env_steps_event_id(gid, "completed", attempt, env), index=env,
            results=e.results, **common))
        env += 1
    for k, f in enumerate(e.flushes, start=e.segment_index):
        out.append(flush_part(e, k, f))
    if e.calls:
        out.append(EnvStepsRequested(
            event_id=env_steps_event_id(gid, "requested", attempt, env), index=env,
            env=e.env, dedupes_by_key=e.dedupes_by_key, calls=e.calls, agent=e.agent, **common))
    return out


def flush_part(e: EpisodeTurnsRecorded, index: int, flush: SegmentFlush) -> SegmentsRecorded:
    """The ``SegmentsRecorded`` a pause's ``flush`` stands for, at flush ``index``: what the
    state keeps of it (a resumed attempt is handed the group's flushes as events)."""
    return SegmentsRecorded(
        event_id=segments_event_id(e.group_id, e.attempt, index), epoch=e.epoch, ts=e.ts,
        schema_version=e.schema_version, group_id=e.group_id, attempt=e.attempt, index=index,
        kind=flush.kind, weight_version=flush.weight_version, segments=flush.segments)


def parts(event: AnyEvent) -> list[AnyEvent]:
    """``event`` as readers see it: a pause's parts, or the event itself."""
    return expand(event) if type(event) is EpisodeTurnsRecorded else [event]


def expanded(events: Iterable[AnyEvent]) -> Iterator[AnyEvent]:
    """``events`` with every pause replaced by its parts."""
    for event in events:
        if type(event) is EpisodeTurnsRecorded:
            yield from expand(event)
        else:
            yield event


def expanded_at(entries: Iterable[tuple[int, AnyEvent]]) -> Iterator[tuple[int, AnyEvent]]:
    """(position, event) pairs with every pause replaced by its parts, each at the
    pause's position (one append, one position)."""
    for position, event in entries:
        if type(event) is EpisodeTurnsRecorded:
            for part in expand(event):
                yield position, part
        else:
            yield position, event
