"""The what-if simulation: recorded group events in, the policies' decisions out.

Part of ``replay.whatif`` (see its docstring for the assumptions). The simulated state
is a real ``RunState`` that changes only through the reducer: recorded group events
are applied as they were written (re-stamped with the simulation's epoch, weight
versions adjusted by assumption 2), and every decision -- evict, claim a microbatch,
finish or abort a step -- is an event the simulation makes and the reducer applies,
so every invariant of the real run (lag within [0, window], one open step, ...) holds
in the what-if too. What to evict and claim is ``policies.plan_microbatch``, the same
call the controller's train side makes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from controller.core import decisions, policies
from controller.core.reducer import apply_event
from controller.core.segments import InflightSegments
from controller.core.state import GroupStatus, RunState, initial_state
from events.schema import (
    AnyEvent,
    Event,
    GroupCommitted,
    GroupFailed,
    MicrobatchTrained,
    RolloutAdmitted,
    SegmentsDropped,
    SegmentsRecorded,
    RunRewound,
    RunStarted,
    StepAborted,
    StepBegun,
    StepFinished,
    microbatch_event_id,
    run_started_id,
    step_event_id,
)

if TYPE_CHECKING:
    from replay.whatif import WhatIfSettings

#: the simulation's own epoch: every event it applies carries it
_EPOCH = 1


@dataclass
class SimStep:
    step: int
    status: str
    base_trainer_version: int
    microbatches: list[list[str]]
    lags: list[int]
    ended_ts: float

    @property
    def group_ids(self) -> list[str]:
        return [g for mb in self.microbatches for g in mb]


@dataclass
class SimResult:
    settings: "WhatIfSettings"
    steps: list[SimStep]
    evicted: list[tuple[str, int]]
    lateness_s: float
    stopped: str
    recorded_steps_seen: int
    lengths: dict[str, int] = field(default_factory=dict)

    def finished(self) -> list[SimStep]:
        return [s for s in self.steps if s.status == "finished"]


_GROUP_EVENTS = (
    RolloutAdmitted, GroupCommitted, GroupFailed, SegmentsRecorded, SegmentsDropped,
)
_TRAINER_EVENTS = (StepBegun, MicrobatchTrained, StepFinished, StepAborted)
#: every event type :meth:`Simulation.feed` acts on
FED_EVENTS = (*_GROUP_EVENTS, *_TRAINER_EVENTS, RunRewound)


class Simulation:
    """Replays group events into ``self.state``; drives the policies on the trainer schedule."""

    def __init__(self, settings: "WhatIfSettings") -> None:
        self.s = settings
        self.state = initial_state()
        self._apply(RunStarted(
            event_id=run_started_id("what-if"), epoch=_EPOCH, ts=0.0, run_id="what-if",
            config={"staleness": {"window_basis": settings.staleness.window_basis}},
            seed=0, code_version="what-if", window_versions=settings.staleness.window_versions,
            groups_per_step=settings.train.groups_per_step, samples_per_group=1,
        ))
        self.queue: deque[AnyEvent] = deque()
        self.lateness = 0.0
        self.blocked_due: float | None = None
        self.pending = False  # a selection is waiting to be made
        self.current: SimStep | None = None
        self.steps: list[SimStep] = []
        self.evicted: list[tuple[str, int]] = []
        self.lengths: dict[str, int] = {}
        self.stopped = "end of log"
        self.rewound = False
        self.seen_steps = 0
        #: the recorded trainer_version as the stream goes, and each group's version
        #: deficit (recorded - what-if) at its admission
        self.recorded_tv = 0
        self.shift: dict[str, int] = {}

    def _apply(self, event: Event) -> None:
        apply_event(self.state, event, self.state.position + 1)  # type: ignore[arg-type]

    # -- the stream ----------------------------------------------------------------

    def feed(self, position: int, event: AnyEvent) -> None:
        """The next recorded event, in log order (nothing after the first RunRewound)."""
        if self.rewound:
            return
        kind = type(event)
        if kind in _GROUP_EVENTS:
            self._drain(event.ts)
            self._apply_group(event)
            self._on_change(event.ts)
        elif kind in _TRAINER_EVENTS:
            self.seen_steps += kind is StepBegun
            self.recorded_tv += kind is StepFinished
            self.queue.append(event)
            if (
                kind is StepAborted
                and self.blocked_due is not None
                and self.current is not None
                and self.current.step == event.step
            ):
                self._abort_while_blocked()
            self._drain(event.ts)
        elif kind is RunRewound:
            self.stopped = f"RunRewound at position {position}"
            self.rewound = True

    def finish(self) -> SimResult:
        """The log ended: run what is left of the recorded schedule; the result."""
        self._drain(float("inf"))
        if self.queue:
            self.stopped = (
                f"starved: {len(self.queue)} recorded trainer events could not be matched "
                f"(the policy could not fill step {self._blocked_step()})"
            )
        return SimResult(
            self.s, self.steps, self.evicted, self.lateness, self.stopped, self.seen_steps, self.lengths
        )

    def _blocked_step(self) -> int | str:
        head = self.queue[0] if self.queue else None
        return getattr(head, "step", "?")

    def _apply_group(self, event: AnyEvent) -> None:
        state = self.state
        group = state.groups.get(event.group_id)
        if type(event) is RolloutAdmitted:
            if group is not None and group.status is not GroupStatus.FAILED:
                return  # the reducer already vetted the log; nothing sane to do here
            self._apply(msgspec.structs.replace(event, epoch=_EPOCH))
            self.shift[event.group_id] = self.recorded_tv - state.trainer_version
            return
        if type(event) is SegmentsDropped:  # a failed attempt's lost rows: as recorded
            failed = group is not None and group.status is GroupStatus.FAILED
            if failed and group.attempt == event.attempt and event.group_id in state.inflight:
                self._apply(msgspec.structs.replace(event, epoch=_EPOCH))
            return
        if group is None or group.status is not GroupStatus.ADMITTED or group.attempt != event.attempt:
            return
        if type(event) is GroupFailed:
            self._apply(msgspec.structs.replace(event, epoch=_EPOCH))
            return
        # Assumption 2: the generator held weights the what-if trainer had produced --
        # at most its trainer_version now, whatever the recorded run had published.
        shift, now = self.shift.get(event.group_id, 0), state.trainer_version
        moved = lambda v: min(now, max(0, v - shift))  # noqa: E731
        if type(event) is SegmentsRecorded:
            v = event.weight_version
            self._apply(msgspec.structs.replace(
                event, epoch=_EPOCH, weight_version=None if v is None else moved(v)
            ))
            return
        start, end = moved(event.weight_version_start), moved(event.weight_version_end)
        rec = state.inflight.get(event.group_id)
        if rec is not None:  # flushes moved with an earlier, smaller trainer_version
            start = min([start, *(v for v in rec.first_version if v >= 0)])
        runs = [_moved_runs(r, moved, rec, i) for i, r in enumerate(event.version_runs)]
        self._apply(msgspec.structs.replace(
            event, epoch=_EPOCH, weight_version_start=start, weight_version_end=end,
            version_runs=runs,
        ))
        self.lengths[event.group_id] = sum(event.lengths)

    # -- the trainer ------------------------------------------------------------------

    def _on_change(self, now: float) -> None:
        if self.pending and self._try_select():
            if self.blocked_due is not None:
                self.lateness += max(0.0, now - self.blocked_due)
                self.blocked_due = None
            self._drain(now)

    def _drain(self, now: float) -> None:
        if self.blocked_due is not None:
            return  # waiting for data: only a group event (``_on_change``) unblocks
        while self.queue:
            head = self.queue[0]
            due = head.ts + self.lateness
            if due > now:
                return
            if not self._fire(head):
                self.blocked_due = due
                return
            self.queue.popleft()

    def _abort_while_blocked(self) -> None:
        """The recorded step aborted while the what-if still waits to fill it: abort it."""
        while type(self.queue[0]) is not StepAborted:
            self.queue.popleft()
        self.blocked_due = None

    def _fire(self, event: AnyEvent) -> bool:
        """Carry out a recorded trainer event; False while its selection cannot be made."""
        kind = type(event)
        if kind is StepBegun:
            if self.current is None or self.current.step != event.step:
                self._begin(event)
            return self._selection_done()
        if kind is MicrobatchTrained:
            if not self._selection_done():
                return False
            self._next_selection()
            return True
        if kind is StepFinished:
            if not self._selection_done():
                return False
            self._end("finished", event.ts + self.lateness)
            return True
        self._end("aborted", event.ts + self.lateness)  # StepAborted
        return True

    def _begin(self, event: StepBegun) -> None:
        state = self.state
        ts = event.ts + self.lateness
        self._apply(StepBegun(
            event_id=step_event_id(state.next_step, "begun"), epoch=_EPOCH, ts=ts,
            step=state.next_step, base_trainer_version=state.trainer_version,
        ))
        self.current = SimStep(
            step=event.step,
            status="open",
            base_trainer_version=state.trainer_version,
            microbatches=[],
            lags=[],
            ended_ts=0.0,
        )
        self._next_selection()

    def _next_selection(self) -> None:
        self.pending = policies.claimed_count(self.state) < self.s.train.groups_per_step
        if self.pending:
            self._try_select()

    def _selection_done(self) -> bool:
        return not self.pending or self._try_select()

    def _try_select(self) -> bool:
        """Evict, then select a microbatch; claim it when the policy can (the loop's plan)."""
        state, s, train = self.state, self.s.staleness, self.s.train
        plan = policies.plan_microbatch(
            state, window=s.window_versions, selection=s.selection,
            groups_per_step=train.groups_per_step, groups_per_microbatch=train.groups_per_microbatch,
            at=decisions.Stamp(epoch=_EPOCH, ts=0.0, position=state.position),
        )
        for evicted in plan.evictions:
            self._apply(evicted)
            self.evicted.append((evicted.group_id, evicted.lag))
        if not plan.ready:
            return False
        step, open_step = self.current, state.open_step
        assert step is not None and open_step is not None
        ids = list(plan.group_ids)
        self._apply(MicrobatchTrained(
            event_id=microbatch_event_id(open_step.step, len(open_step.microbatches)),
            epoch=_EPOCH, ts=0.0, step=open_step.step, index=len(open_step.microbatches),
            group_ids=ids, num_sequences=0, num_tokens=0,
        ))
        step.lags.extend(state.groups[gid].lag for gid in ids)  # type: ignore[misc]
        step.microbatches.append(ids)
        self.pending = False
        return True

    def _end(self, status: str, ts: float) -> None:
        step, open_step = self.current, self.state.open_step
        self.pending = False
        if step is None or open_step is None:
            return
        step.status, step.ended_ts = status, ts
        if status == "finished":
            self._apply(StepFinished(
                event_id=step_event_id(open_step.step, "finished"), epoch=_EPOCH, ts=ts,
                step=open_step.step, trainer_version=open_step.base_trainer_version + 1,
                metrics={}, grad_norm=0.0, weights_digest="",
            ))
        else:
            self._apply(decisions.step_aborted(
                self.state, "recorded step aborted", decisions.Stamp(_EPOCH, ts, self.state.position)
            ))
        self.steps.append(step)
        self.current = None


def _moved_runs(runs: list[int], moved: Callable[[int], int], rec: InflightSegments | None, sample: int) -> list[int]:
    """A commit's ``version_runs`` for one sample under assumption 2: its recorded tokens
    at their flushes' versions as the simulation moved them (each at its own time), the
    tokens after them moved now; runs that the move made equal are merged."""
    pairs: list[tuple[int, int]] = []
    recorded = 0
    if rec is not None:
        for f in rec.flushes:
            for seg in f.segments:
                if seg.sample == sample:
                    pairs.append((-1 if f.weight_version is None else f.weight_version, seg.length))
                    recorded += seg.length
    for v, n in zip(runs[0::2], runs[1::2]):
        skip = min(n, recorded)  # the tokens the flushes above already gave
        recorded -= skip
        if n > skip:
            pairs.append((moved(v), n - skip))
    out: list[int] = []
    for v, n in pairs:
        if out and out[-2] == v:
            out[-1] += n
        else:
            out += [v, n]
    return out


def simulate(events: Iterable[tuple[int, AnyEvent]], settings: "WhatIfSettings") -> SimResult:
    """Re-run the policies with ``settings`` over recorded ``(position, event)`` pairs
    (the CLI feeds the simulation from the projector's fold: ``replay.whatif.WhatIf``)."""
    sim = Simulation(settings)
    for position, event in events:
        sim.feed(position, event)
    return sim.finish()


__all__ = ["FED_EVENTS", "RunState", "SimResult", "SimStep", "Simulation", "simulate"]
