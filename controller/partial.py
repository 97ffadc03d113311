"""The controller's side of partial rollouts (``docs/segments.md``).

A generator call with ``rollout.partial`` on returns at every flush point; the admission
side records each flush as a ``SegmentsRecorded`` event (built here) before the call
that lets the paused group go on, and a re-admitted group's first call carries what its
earlier attempts recorded (:func:`resume_flushes`), read from the folded state. A resume
that finds recorded rows gone from the data plane fails its attempt, and
:meth:`PartialRecorder.dropped` names the lost rows so that the next attempt restarts those
samples from the prompt instead of failing the same way until the group is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import structlog

from controller.core.prefold import RejectedFact
from controller.core.segments import InflightSegments, lost_samples, segment_keys
from controller.core.state import RunState
from controller import episodes
from controller.crashpoints import crash_point
from controller.journal import Journal
from controller.pausing import PausingCall
from events import schema as ev
from workers.api import FINISHED, GenerationOutcome, GenerationRequest, PayloadStore, SegmentFlush, error_line

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
        for req, out in zip(reqs, outs) if out.status not in FINISHED
    ]


#: a call waiting for the shared append: (call, outcomes, commits, when it paused)
_Waiting = tuple[PausingCall, list[GenerationOutcome], list[ev.GroupCommitted], float]
#: commits riding with it: (commits, who hears if the append fails, who hears (group id,
#: why) if the log refuses one of them before it is written)
_Rider = tuple[list[ev.GroupCommitted], Callable[[BaseException], None], Callable[[str, RejectedFact], None]]


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class PartialRecorder:
    """Records calls' flushes, and deletes the segment rows of committed groups.

    Flushes can come in bursts: with ``flush_on_refit`` a refit lands on every generator
    at once and each of their calls returns its groups' flushes (by default a refit
    flushes nothing, and full windows come apart). The calls that return in the same
    turn of the event loop are recorded in ONE append (one store round trip and one fsync for all of
    them, as ``AdmissionSide`` does for commits), and every paused group goes on as soon
    as that append landed: the append issues each acknowledged call's next call
    (``controller.pausing``; no task step or future per pause). The events are exactly those
    one append per call would write, in the order the calls returned.

    Every pause of a durable episode is a flush too, and a large fleet's pauses come a
    few hundred microseconds apart, not in one turn: with ``linger_s`` the first call
    waits that long (``linger_max`` times that once another joined within it), and
    every call returning meanwhile shares its append. The wait
    ends early once every generator call in flight (``in_flight``) is waiting here:
    no other call can join, and a paused group's generator would only idle (a lone
    flush paid the whole linger before: 5 of its ~6 ms pause in ``bench_async``); and
    there is no wait while fewer than ``siblings`` other calls are in flight.
    """

    #: segment rows deleted together (one data-plane call, not one per commit: deletes
    #: go through the trainer worker's fence and would queue between its microbatches)
    DELETE_BATCH = 512

    def __init__(
        self, journal: Journal, payloads: PayloadStore | None, *, linger_s: float = 0.0,
        in_flight: Callable[[], int] | None = None, siblings: int = 0, linger_max: int = 4,
    ) -> None:
        self.journal = journal
        #: how long the first waiting call holds the append for others (0: this turn only)
        self.linger_s = linger_s
        #: a lingering append that others joined waits this many ``linger_s`` in all (see
        #: ``_linger_due``): a large fleet's pauses share fewer appends (each a store round
        #: trip), and a lone pause still waits one ``linger_s``
        self.linger_max = linger_max
        #: generator calls in flight, waiting here included (None: always the full linger)
        self.in_flight = in_flight
        #: linger only while at least this many other calls are in flight (0: always)
        self.siblings = siblings
        #: resolved when the last call in flight joins a lingering append
        self._all_joined: asyncio.Future | None = None
        #: the lingering append's timer, and the loop time its wait began
        self._timer: asyncio.TimerHandle | None = None
        self._linger_start = 0.0
        #: where segment rows are deleted (None: left to recovery's orphan sweep)
        self.payloads = payloads
        self.deletes: set[asyncio.Task] = set()
        self._scratch: list[str] = []
        #: calls waiting for the shared append: (call, outcomes, commits, when it paused)
        self._waiting: list[_Waiting] = []
        self._appending: set[asyncio.Task] = set()
        #: commits riding with the gathering append, and who hears if it fails
        self._riders: list[_Rider] = []
        #: appends made, calls they recorded (``bench_scale`` prints the ratio)
        self.appends = 0
        self.calls = 0
        #: seconds the recorded calls' groups paused for their flushes (``bench_async``)
        self.paused_s = 0.0

    def hold(self, call: PausingCall, outs: list[GenerationOutcome],
             commits: list[ev.GroupCommitted]) -> None:
        """Queue a pause of ``call`` for the shared append: a SegmentsRecorded (or an
        episode's events) per flushed group and the ``commits`` of the finished ones,
        appended with the other calls of this turn; the append then resumes the call
        (``PausingCall.resume``) with the requests that let the paused groups go on."""
        if not any(out.status == "flushed" for out in outs):
            raise RuntimeError("a generator call returned unfinished groups without a flush")
        self._waiting.append((call, outs, commits, self.journal.clock()))
        self.recheck()
        self._gather()

    def _gather(self) -> None:
        """Start an append gathering what comes within the linger, unless one is: one
        gathers from the first pause or commit queued (just now, if it is the only one)
        until it takes them all."""
        if len(self._waiting) + len(self._riders) > 1:
            return
        # a task's first step runs like ``call_soon``: after every call of this turn
        task = asyncio.get_running_loop().create_task(self._append_waiting())
        self._appending.add(task)  # a reference until it is done
        task.add_done_callback(self._appending.discard)

    def join(self, commits: list[ev.GroupCommitted], on_error: Callable[[BaseException], None],
             on_refused: Callable[[str, RejectedFact], None]) -> None:
        """Finished groups' commits, appended with the pauses that come within the
        linger: a group's last call ends right after its last pause is recorded, and
        with a large fleet other pauses follow within a few milliseconds -- one append
        for both instead of two. ``on_error`` hears if the append fails; ``on_refused``
        (group id, why) if the log refuses one of the commits before it is written (the
        others are appended)."""
        self._riders.append((commits, on_error, on_refused))
        self._gather()

    async def settle(self, timeout_s: float) -> None:
        """Wait for the appends gathering or in flight (the commits riding with them)."""
        if self._appending:
            await asyncio.wait(self._appending, timeout=timeout_s)

    def recheck(self) -> None:
        """End a lingering append's wait once every call in flight waits for it: asked
        when a call joins it, and when one ends elsewhere (committed or failed) -- the
        calls left may all be waiting then, and none other can join."""
        if self._all_joined is not None and self._nobody_else():
            _resolve(self._all_joined)

    def _nobody_else(self) -> bool:
        """Every generator call in flight is waiting for this append."""
        return self.in_flight is not None and len(self._waiting) >= self.in_flight()

    def _too_few_others(self) -> bool:
        """Fewer than ``siblings`` other calls in flight: none is likely to join within
        the linger, so waiting would only idle the paused groups."""
        return (self.siblings > 0 and self.in_flight is not None
                and self.in_flight() - len(self._waiting) < self.siblings)

    async def _linger(self) -> None:
        """``linger_s`` for other calls to join -- ``linger_max`` of them in all once one
        did -- less once no other can."""
        if self.linger_s <= 0 or self._nobody_else() or self._too_few_others():
            return
        # a future and a timer, not ``wait_for`` on an Event: that wraps the wait in a
        # task of its own, a task step more per append (~5 appends per episode group)
        loop = asyncio.get_running_loop()
        joined = self._all_joined = loop.create_future()
        self._linger_start = loop.time()
        self._timer = loop.call_later(self.linger_s, self._linger_due, joined, False)
        try:
            await joined
        finally:
            self._timer.cancel()
            self._all_joined = None

    def _linger_due(self, joined: asyncio.Future, extended: bool) -> None:
        """The linger's timer. A pause that joined within the first linger says pauses
        come faster than that (a large fleet's come a few ms apart): the append waits
        ``linger_max`` lingers in all, sharing one round trip among more of them. A lone
        pause (a small fleet's) goes on after one, as it always did."""
        if not extended and self.linger_max > 1 and len(self._waiting) > 1:
            due = self._linger_start + self.linger_s * self.linger_max
            self._timer = asyncio.get_running_loop().call_at(due, self._linger_due, joined, True)
        else:
            _resolve(joined)

    async def _append_waiting(self) -> None:
        try:
            await self._linger()
        except asyncio.CancelledError:  # the run stopped: no waiting call goes on
            waiting, self._waiting, self._riders = self._waiting, [], []
            for call, *_ in waiting:
                call.cancel()
            raise
        waiting, self._waiting = self._waiting, []
        riders, self._riders = self._riders, []
        journal = self.journal
        try:
            events, owners, finished = self._batch(waiting, riders)
            # the rows of committed groups: read before their commits fold the records away
            rows = {gid: segment_keys(journal.state.inflight, [gid]) for gid in finished}
            refused = await self._append_refusing(events, owners, waiting, riders)
        except BaseException as err:
            for call, *_ in waiting:
                call.fail(err)
            for _, on_error, _ in riders:
                on_error(err)
            if not isinstance(err, Exception):
                raise
            return
        self.calls += sum(1 for w in range(len(waiting)) if w not in refused)
        self.drop([key for gid in finished if gid not in refused for key in rows[gid]])
        now, state = journal.clock(), journal.state
        for w, (call, outs, _, paused) in enumerate(waiting):  # every acknowledged call goes on
            if w not in refused:
                self.paused_s += now - paused
                call.resume(next_requests(state, call.reqs, outs))

    def _batch(self, waiting: list[_Waiting], riders: list[_Rider]) -> tuple[list[ev.Event], list[int | str], list[str]]:
        """The waiting calls' events, then the riders' commits; per event its owner (the
        call's index, or a rider commit's group); the groups committed."""
        journal = self.journal
        events: list[ev.Event] = []
        owners: list[int | str] = []
        finished: list[str] = []
        for w, (call, outs, commits, _) in enumerate(waiting):
            flushed = [(r, o) for r, o in zip(call.reqs, outs) if o.status == "flushed"]
            for req, out in flushed:
                crash_point("before_segments_recorded", req.group_id)
                if out.episode is not None and out.episode.completed:  # ran, unrecorded
                    crash_point("before_env_steps_completed", req.group_id)
            for c in commits:
                crash_point("before_group_committed", c.group_id)
            # built in turn: a group is in one call only, so indices never collide
            mine = [e for req, out in flushed for e in (
                episodes.flush_events(journal, req, out.episode) if out.episode is not None
                else [segments_event(journal, req, out)])] + list(commits)
            events += mine
            owners += [w] * len(mine)
            finished += [c.group_id for c in commits]
        for commits, _, _ in riders:
            for c in commits:
                crash_point("before_group_committed", c.group_id)
            events += commits
            owners += [c.group_id for c in commits]
            finished += [c.group_id for c in commits]
        return events, owners, finished

    async def _append_refusing(self, events: list[ev.Event], owners: list[int | str],
                               waiting: list[_Waiting], riders: list[_Rider]) -> dict[int | str, RejectedFact]:
        """Append ``events``, less what the log refuses before it is written
        (``controller.core.prefold``): a refused pause or commit of a waiting call fails
        that call as its worker's failure (every event of it is left out); a refused rider
        commit goes to its rider's ``on_refused``. The rest is appended; at most one try
        per event. Returns what was refused: call indices and group ids."""
        refused: dict[int | str, RejectedFact] = {}
        while events:
            try:
                # the writer fires after_segments_recorded / after_group_committed once acknowledged
                await self.journal.append(*events)
                self.appends += 1
                break
            except RejectedFact as err:
                owner = owners[err.index]
                refused[owner] = err
                keep = [k for k, o in enumerate(owners) if o != owner]
                events, owners = [events[k] for k in keep], [owners[k] for k in keep]
                if isinstance(owner, int):
                    call = waiting[owner][0]
                    refused.update({c.group_id: err for c in waiting[owner][2]})
                    call.refuse(err)
                else:
                    next(r for r in riders if any(c.group_id == owner for c in r[0]))[2](owner, err)
        return refused

    def dropped(
        self, reqs: list[GenerationRequest], err: BaseException | None
    ) -> dict[str, list[ev.SegmentsDropped]]:
        """Per group of a failed call: the ``SegmentsDropped`` its missing rows call for
        (none, or one).

        Only an attempt's first call (it carries ``resume``) reads recorded rows back;
        when the data plane says some are missing, each group whose recorded segments
        name a missing key drops them (appended right after its ``GroupFailed``). The
        dropped samples' rows that are still there are deleted with the next batch of
        scratch rows: deleting one before the event lands costs at most a second drop."""
        # imported here: the data plane's API pulls torch and tensordict, which commands
        # that only read the log (runs, tail, audit) must not pay for at start-up
        from workers.dataplane.api import MissingPayloadError

        if not isinstance(err, MissingPayloadError) or not err.keys:
            return {}
        journal, missing = self.journal, set(err.keys)
        out: dict[str, list[ev.SegmentsDropped]] = {}
        for req in reqs:
            rec = journal.state.inflight.get(req.group_id) if req.resume else None
            if rec is None:
                continue
            keys = [seg.key for f in rec.flushes for seg in f.segments if seg.key in missing]
            if not keys:
                continue
            out[req.group_id] = [journal.make(
                ev.SegmentsDropped,
                event_id=ev.segments_dropped_id(req.group_id, req.attempt),
                group_id=req.group_id, attempt=req.attempt, keys=keys,
                reason=(f"{len(keys)} recorded segment row(s) gone from the data plane, "
                        f"first {keys[0]}; those samples restart from the prompt "
                        f"({error_line(err, 200)})"),
            )]
            samples, _ = lost_samples(rec, keys)
            self.drop([seg.key for f in rec.flushes for seg in f.segments
                       if seg.sample in samples and seg.key not in missing])
        return out

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
