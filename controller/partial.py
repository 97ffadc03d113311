"""The controller's side of partial rollouts (``docs/segments.md``).

A generator call with ``rollout.partial`` on returns at every flush point; the admission
side records each flush as a ``SegmentsRecorded`` event (built here) before the call
that lets the paused group go on, and a re-admitted group's first call carries what its
earlier attempts recorded (:func:`resume_flushes`), read from the folded state.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec
import structlog

from controller.core.segments import InflightSegments, segment_keys
from controller.core.state import RunState
from controller import episodes
from controller.crashpoints import crash_point
from controller.journal import Journal
from events import schema as ev
from workers.api import GenerationOutcome, GenerationRequest, PayloadStore, SegmentFlush

log = structlog.get_logger("rl_controller.loop")


def resume_flushes(rec: InflightSegments | None) -> list[SegmentFlush]:
    """What a group recorded, as a generator resumes from it (``workers.api``)."""
    if rec is None:
        return []
    return [
        SegmentFlush(kind=f.kind, weight_version=f.weight_version, segments=list(f.segments))
        for f in rec.flushes
    ]


def attempt_flushes(state: RunState, group_id: str) -> int:
    """Flushes the group's current attempt has recorded (for an episode group, its env
    events too: what ``GenerationRequest.flushes`` counts)."""
    return episodes.segment_index(state, group_id) + episodes.env_index(state, group_id)


def segments_event(journal: Journal, req: GenerationRequest, out: GenerationOutcome) -> ev.SegmentsRecorded:
    """The event recording a generator's flush of ``req``'s group."""
    flush = out.flush
    assert flush is not None, "a flushed outcome carries its flush"
    index = episodes.segment_index(journal.state, req.group_id)
    return journal.make(
        ev.SegmentsRecorded,
        event_id=ev.segments_event_id(req.group_id, req.attempt, index),
        group_id=req.group_id,
        attempt=req.attempt,
        index=index,
        kind=flush.kind,
        weight_version=flush.weight_version,
        segments=list(flush.segments),
    )


def next_requests(
    state: RunState, reqs: list[GenerationRequest], outs: list[GenerationOutcome]
) -> list[GenerationRequest]:
    """The requests that let a call's unfinished groups go on, once its flushes are in
    the log. A flushed group's worker holds what it resumed from; a pending one may not
    have started yet (a call runs its groups in order, up to the first flush), so it
    keeps its ``resume``: without it a re-admitted group would start over from nothing
    and sample again what the log holds."""
    return [
        msgspec.structs.replace(req, resume=req.resume if out.status == "pending" else [],
                                flushes=attempt_flushes(state, req.group_id))
        for req, out in zip(reqs, outs) if out.status != "done"
    ]


@dataclass
class _Call:
    """One returned generator call waiting for the shared append of its flushes."""

    reqs: list[GenerationRequest]
    outs: list[GenerationOutcome]
    commits: list[ev.GroupCommitted]
    done: asyncio.Future


class PartialRecorder:
    """Records calls' flushes, and deletes the segment rows of committed groups."""

    #: segment rows deleted together (one data-plane call, not one per commit: deletes
    #: go through the trainer worker's fence and would queue between its microbatches)
    DELETE_BATCH = 512

    def __init__(self, journal: Journal, payloads: PayloadStore | None, *, linger_s: float = 0.0,
                 tasks: set[asyncio.Task] | None = None) -> None:
        self.journal = journal
        #: where the shared appends' tasks are held (the owner drains or cancels them)
        self.tasks: set[asyncio.Task] = set() if tasks is None else tasks
        #: where segment rows are deleted (None: left to recovery's orphan sweep)
        self.payloads = payloads
        #: how long the first flush waits for others to share its append (0: only the
        #: calls that returned in the same turn of the loop share it)
        self.linger_s = linger_s
        self.deletes: set[asyncio.Task] = set()
        self._scratch: list[str] = []
        self._queued: list[_Call] = []
        #: appends made / calls they recorded (what the batching buys)
        self.appends = self.calls = 0

    async def record(
        self,
        reqs: list[GenerationRequest],
        outs: list[GenerationOutcome],
        commits: list[ev.GroupCommitted],
    ) -> list[GenerationRequest]:
        """Record a call's flushes and the ``commits`` of its finished groups; returns the
        requests that let its paused groups go on, once the log has them.

        Group commit: every pause of an episode is one flush, and a fleet's calls return
        a few hundred microseconds apart, so the calls queued until the append runs
        (``linger_s`` after the first, or the next turn of the loop) share it -- one
        store round trip and one fold instead of one per call. Each call still waits
        for the append holding its flush before its groups go on (write-ahead)."""
        if not any(out.status == "flushed" for out in outs):
            raise RuntimeError("a generator call returned unfinished groups without a flush")
        call = _Call(reqs, outs, commits, asyncio.get_running_loop().create_future())
        self._queued.append(call)
        if len(self._queued) == 1:
            task = asyncio.get_running_loop().create_task(self._append_queued())
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return await call.done

    async def _append_queued(self) -> None:
        calls: list[_Call] = []
        try:
            if self.linger_s > 0:
                await asyncio.sleep(self.linger_s)
            calls, self._queued = self._queued, []
            await self._append(calls)
        except asyncio.CancelledError:
            calls, self._queued = calls + self._queued, []  # the run stopped (fenced, drained): no call goes on
            for c in calls:
                c.done.cancel()
            raise
        except Exception as err:  # each waiting call fails as its own append would have
            for c in calls:
                if not c.done.done():
                    c.done.set_exception(err)
            return
        state = self.journal.state
        for c in calls:
            if not c.done.done():  # a call cancelled meanwhile (the run stopped) is not resumed
                c.done.set_result(next_requests(state, c.reqs, c.outs))

    async def _append(self, calls: list[_Call]) -> None:
        """One append: a flush's events per flushed group, then the finished groups'
        commits, of every call in ``calls``."""
        state, journal = self.journal.state, self.journal
        flushed = [(r, o) for c in calls for r, o in zip(c.reqs, c.outs) if o.status == "flushed"]
        commits = [e for c in calls for e in c.commits]
        for req, out in flushed:
            crash_point("before_segments_recorded", req.group_id)
            if out.episode is not None and out.episode.completed:  # the calls ran, unrecorded
                crash_point("before_env_steps_completed", req.group_id)
        for e in commits:
            crash_point("before_group_committed", e.group_id)
        scratch = segment_keys(state.inflight, [e.group_id for e in commits])
        # the writer fires after_segments_recorded / after_group_committed once acknowledged
        made = [e for req, out in flushed for e in (
            episodes.flush_events(journal, req, out.episode) if out.episode is not None
            else [segments_event(journal, req, out)])]
        await journal.append(*made, *commits)
        self.appends, self.calls = self.appends + 1, self.calls + len(calls)
        self.drop(scratch)

    def drop(self, keys: list[str], *, now: bool = False) -> None:
        """Segment rows of committed groups are scratch (their final rows hold every
        token): deleted in the background, a batch at a time; a crash first leaves
        orphans that recovery deletes."""
        if self.payloads is None:
            return
        self._scratch += keys
        if not self._scratch or (len(self._scratch) < self.DELETE_BATCH and not now):
            return
        keys, self._scratch = self._scratch, []
        task = asyncio.create_task(self._delete(self.payloads, keys))
        self.deletes.add(task)
        task.add_done_callback(self.deletes.discard)

    async def _delete(self, payloads: PayloadStore, keys: list[str]) -> None:
        try:
            await payloads.delete(keys)
        except Exception as err:  # not fatal: recovery's orphan sweep gets them
            log.warning("segment_rows_not_deleted", rows=len(keys), reason=str(err)[:300])
