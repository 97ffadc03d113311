"""The controller's side of durable episodes (``docs/agents.md``).

An episode group's generator call returns at every record point with an
``EpisodeFlush``; the admission side appends it (:func:`flush_events`, through
``controller.partial.PartialRecorder``) before the call that lets the group go on, as
ONE event (``EpisodeTurnsRecorded``) standing for the results, then the segments
(observations, or model turns), then the intent of the calls about to be made -- so in
the log every call's intent follows the model turn it answers and precedes its result. A re-admitted group's first call carries what its
earlier attempts recorded (:func:`episode_resume`); before that admission the core may
decide to restart episodes whose env cannot deduplicate (``decisions.episodes_restarted``).
"""

from __future__ import annotations

from controller.core import decisions
from controller.core.state import RunState
from controller.journal import Journal
from events import schema as ev
from workers.api import EpisodeFlush, EpisodeResume, GenerationRequest, RecordedCall


def segment_index(state: RunState, group_id: str) -> int:
    """The next ``SegmentsRecorded`` index of the group's current attempt."""
    rec = state.inflight.get(group_id) if state.inflight else None
    return 0 if rec is None else rec.attempt_flushes


def env_index(state: RunState, group_id: str) -> int:
    """The next env event index of the group's current attempt."""
    rec = state.episodes.get(group_id) if state.episodes else None
    return 0 if rec is None else rec.attempt_events


def flush_events(journal: Journal, req: GenerationRequest, flush: EpisodeFlush) -> list[ev.Event]:
    """The events recording one pause of ``req``'s group: one ``EpisodeTurnsRecorded``
    standing for its results, segments and intent (``controller.core.turns``), or the
    pause's one event itself when it has a single part (a flush of model tokens only)."""
    state, gid, attempt = journal.state, req.group_id, req.attempt
    seg, env = segment_index(state, gid), env_index(state, gid)
    if flush.events == 1 and flush.segments:
        f = flush.segments[0]
        return [journal.make(
            ev.SegmentsRecorded, event_id=ev.segments_event_id(gid, attempt, seg), group_id=gid,
            attempt=attempt, index=seg, kind=f.kind, weight_version=f.weight_version,
            segments=list(f.segments))]
    if flush.events == 0:
        return []
    return [journal.make(
        ev.EpisodeTurnsRecorded, event_id=ev.episode_turns_event_id(gid, attempt, seg, env),
        group_id=gid, attempt=attempt, segment_index=seg, env_index=env,
        results=list(flush.completed), flushes=list(flush.segments), env=flush.env,
        dedupes_by_key=flush.dedupes_by_key, calls=list(flush.requested))]


def episode_resume(state: RunState, group_id: str) -> EpisodeResume | None:
    """What the log holds of a group's env calls, as a resumed attempt's worker reads it."""
    rec = state.episodes.get(group_id) if state.episodes else None
    if rec is None:
        return None
    return EpisodeResume(
        restarts=[e.restart for e in rec.samples],
        calls=[
            RecordedCall(call=ev.EnvCall(sample=i, turn=t.turn, request=t.request,
                                         restart=e.restart), result=t.result)
            for i, e in enumerate(rec.samples) for t in e.turns
        ],
    )


def restarts_before(journal: Journal, batch: list[ev.RolloutAdmitted]) -> list[ev.EpisodesRestarted]:
    """The core's restarts of episodes of the retried groups of ``batch`` (appended just
    before their admissions)."""
    state = journal.state
    if not state.episodes:
        return []
    stamp = journal.stamp()
    made = (decisions.episodes_restarted(state, a.group_id, stamp) for a in batch if a.attempt > 1)
    return [e for e in made if e is not None]
