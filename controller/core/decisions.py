"""Decisions as ready-made events: what the controller decided, with canonical ids.

Each function here is a pure function of the folded state (and of a :class:`Stamp`: the
epoch, time and log position the shell will append at) that returns the events recording
a decision. The shell appends them as they are -- it builds no event of these kinds
itself -- so an eviction, an abort or a repair is spelled once, whether the controller
loop, recovery or the replay what-if makes it.

Facts about side effects (``GroupCommitted``, ``StepFinished``, ``WeightsPublished``,
``CheckpointSaved``, ...) carry what a worker returned; the shell makes those with the
id helpers of ``events.schema``.

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from controller.core.episodes import restartable
from controller.core.failures import stop_reason
from controller.core.state import GroupRecord, GroupStatus, RunState
import events.schema as ev

#: groups whose payload rows no step will ever need again
_RELEASABLE = (GroupStatus.EVICTED, GroupStatus.LOST)


@dataclass(frozen=True)
class Stamp:
    """What the core cannot know about the events it builds: who writes them, when, and
    at which log position (ids of facts that may repeat name the epoch and position)."""

    epoch: int
    ts: float
    position: int


def group_evicted(group_id: str, *, lag: int, reason: str, at: Stamp) -> ev.GroupEvicted:
    """The one way a ``GroupEvicted`` is built (window, lost payloads, what-if)."""
    return ev.GroupEvicted(
        event_id=ev.group_event_id(group_id, "evicted"), epoch=at.epoch, ts=at.ts,
        group_id=group_id, reason=reason, lag=lag,
    )


def window_evictions(
    stale: Iterable[tuple[str, int]], *, window: int, at: Stamp
) -> tuple[ev.GroupEvicted, ...]:
    """``(group_id, lag)`` pairs past ``window`` (``policies.to_evict``), as events."""
    return tuple(
        group_evicted(gid, lag=lag, reason=f"lag {lag} > window {window}", at=at)
        for gid, lag in stale
    )


def lost_payload_evictions(
    state: RunState, present: Collection[str], at: Stamp
) -> list[ev.GroupEvicted]:
    """Buffered groups with a payload row not in ``present``: they cannot be trained on."""
    return [
        group_evicted(
            g.group_id, lag=state.lag_of(g) or 0,
            reason="payload lost (data plane and spill)", at=at,
        )
        for g in state.iter_buffer()
        if any(k not in present for k in g.payload_keys)
    ]


def group_failed(group_id: str, attempt: int, reason: str, at: Stamp) -> ev.GroupFailed:
    return ev.GroupFailed(
        event_id=ev.group_event_id(group_id, "failed", attempt), epoch=at.epoch, ts=at.ts,
        group_id=group_id, attempt=attempt, reason=reason[:500],
    )


def episodes_restarted(state: RunState, group_id: str, at: Stamp) -> ev.EpisodesRestarted | None:
    """Before a failed group is admitted again: restart its episodes whose last call has
    no result when the environment cannot deduplicate (a second call could repeat a side
    effect, so it is never made; ``controller.core.episodes``), or, for an agent that
    cannot, every episode with a recorded call (``restartable``). None when there are none."""
    rec = state.episodes.get(group_id) if state.episodes else None
    if rec is None or rec.dedupes_by_key:
        return None
    stuck = restartable(rec)
    if not stuck:
        return None
    attempt = state.groups[group_id].attempt
    turns = sorted({rec.samples[i].turns[-1].turn for i in stuck})
    return ev.EpisodesRestarted(
        event_id=ev.episodes_restarted_id(group_id, attempt), epoch=at.epoch, ts=at.ts,
        group_id=group_id, attempt=attempt, samples=stuck,
        reason=(f"agent {rec.env!r} cannot deduplicate and runs its calls again on a resume: "
                "its episodes with recorded calls start over with new keys") if rec.agent else
               (f"turn(s) {turns} of env {rec.env!r} have no result and it cannot deduplicate: "
                "the calls are never made again; the episodes start over with new keys"),
    )


def step_aborted(state: RunState, reason: str, at: Stamp) -> ev.StepAborted | None:
    """Abort the open step (None when no step is open)."""
    if state.open_step is None:
        return None
    step = state.open_step.step
    return ev.StepAborted(
        event_id=ev.step_event_id(step, "aborted"), epoch=at.epoch, ts=at.ts,
        step=step, reason=reason[:500],
    )


def log_repair(state: RunState, reason: str, at: Stamp) -> list[ev.Event]:
    """What a new controller records about the old one's work in progress: the open step
    aborted, every in-flight generation failed (the loop re-admits them)."""
    aborted = step_aborted(state, reason, at)
    failed = [
        group_failed(g.group_id, g.attempt, f"{reason}: generation was in flight", at)
        for g in state.in_flight()
    ]
    return ([aborted] if aborted is not None else []) + failed


def worker_lost(worker: str, role: str, reason: str, at: Stamp) -> ev.WorkerLost:
    return ev.WorkerLost(
        event_id=ev.worker_lost_id(worker, at.epoch, at.position), epoch=at.epoch, ts=at.ts,
        worker=worker, role=role, reason=reason[:500],
    )


def releasable(state: RunState, version: int) -> list[GroupRecord]:
    """Groups whose payload rows may go once a checkpoint of ``version`` is durable: those
    consumed by steps it covers, and evicted or lost ones (no step needs them)."""
    return [
        g for g in state.groups.values()
        if not g.payload_released and g.payload_keys and (
            g.status in _RELEASABLE
            or (g.status is GroupStatus.CONSUMED
                and state.steps[g.consumed_step].trainer_version <= version)  # type: ignore[index,operator]
        )
    ]


def payloads_released(
    groups: Iterable[GroupRecord], version: int, at: Stamp
) -> ev.PayloadsReleased:
    return ev.PayloadsReleased(
        event_id=ev.payloads_released_id(version, at.epoch, at.position), epoch=at.epoch,
        ts=at.ts, group_ids=[g.group_id for g in groups],
    )


def run_rewound(state: RunState, to: int, reason: str, at: Stamp) -> ev.RunRewound:
    """Go back to the checkpoint of ``to``: every finished step after it is discarded."""
    lost = state.steps_after(to)
    return ev.RunRewound(
        event_id=ev.run_rewound_id(at.epoch, at.position), epoch=at.epoch, ts=at.ts,
        to_trainer_version=to, lost_steps=[s.step for s in lost],
        lost_group_ids=[g for s in lost for g in s.group_ids], reason=reason,
    )


def rewound_evictions(state: RunState, to: int, at: Stamp) -> list[ev.GroupEvicted]:
    """Buffered groups sampled (in part) by a version after ``to``: weights a rewind to
    ``to`` discards. Trained after it they would have a negative lag -- the fold refuses
    such a step -- so they go with the rewind, in its batch."""
    return [
        group_evicted(
            g.group_id, lag=state.lag_of(g, to) or 0, at=at,
            reason=f"rewound: sampled by v{g.weight_version_end}, discarded by the rewind to v{to}",
        )
        for g in state.iter_buffer()
        if g.weight_version_end is not None and g.weight_version_end > to
    ]


def run_stopped(state: RunState, budget: int, at: Stamp) -> ev.RunStopped | None:
    """Stop the run when ``budget`` groups failed in a row (``controller.core.failures``);
    None while the budget lasts or once the run is stopped."""
    reason = stop_reason(state.failures, budget)
    if reason is None:
        return None
    return ev.RunStopped(
        event_id=ev.run_stopped_id(at.epoch, at.position), epoch=at.epoch, ts=at.ts,
        reason=reason, cause=state.failures.cause,
    )
