"""The reducer: ``RunState`` x event -> ``RunState``, enforcing every invariant of the run.

``apply(state, stored)`` is the one entry point (``apply_event`` is the same with the
``StoredEvent`` unwrapped, for the fold's hot path). It **updates ``state`` in place and
returns it**: a fold owns its accumulator, and copying a state with 10^5 groups per
event would make replaying a 1M-event log quadratic. Callers that need the state
before an event take ``state.copy()`` first.

Every handler validates first and mutates after, so an event that raises
:class:`InvariantViolation` leaves ``state`` exactly as it was (a caller may report the
violation and keep using the state). Violations name the event's log position and id.

Epochs (fencing)::

    [RunStarted(epoch=1), ControllerStarted(epoch=1), ...]   a new run
    [..., ControllerStarted(epoch=2), ...]                    a restart (or takeover)

RunStarted claims the run's first epoch; the first ControllerStarted may repeat it
(the controller that wrote RunStarted announcing itself), every later one must be
strictly newer than all earlier ones. Any other event must carry exactly the current
epoch: an older one is a stale (fenced) writer, a newer one was never claimed.

Pure: no I/O, no clock, no randomness, no logging.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable, NoReturn, assert_never, get_args

from controller.errors import InvariantViolation
from controller.state import (
    CheckpointRecord,
    CheckpointRejection,
    EpochRecord,
    GroupRecord,
    GroupStatus,
    OpenStep,
    RewindRecord,
    RunState,
    StepRecord,
    StepStatus,
    WorkerLossRecord,
    initial_state,
)
from events.schema import (
    AnyEvent,
    CheckpointRejected,
    CheckpointSaved,
    ControllerStarted,
    GroupCommitted,
    GroupEvicted,
    GroupFailed,
    MicrobatchTrained,
    PayloadsReleased,
    RolloutAdmitted,
    RunFinished,
    RunRewound,
    RunStarted,
    StepAborted,
    StepBegun,
    StepFinished,
    StoredEvent,
    WeightsPublished,
    WorkerLost,
)

__all__ = ["HANDLERS", "apply", "apply_event", "check_preamble", "handler_for", "initial_state"]

_Handler = Callable[[RunState, Any, int], None]

_ADMITTED = GroupStatus.ADMITTED
_COMMITTED = GroupStatus.COMMITTED
_CLAIMED = GroupStatus.CLAIMED
_CONSUMED = GroupStatus.CONSUMED
_RELEASED = GroupStatus.RELEASED
#: payloads of these groups feed no finished step that a checkpoint must cover (they
#: may be released any time)
_EVICTED = GroupStatus.EVICTED
_FAILED = GroupStatus.FAILED
_LOST = GroupStatus.LOST


def apply(state: RunState, stored: StoredEvent) -> RunState:
    """Apply one stored event to ``state`` (in place) and return it."""
    return apply_event(state, stored.event, stored.position)


def apply_event(state: RunState, event: AnyEvent, position: int) -> RunState:
    """Apply ``event`` found at log ``position`` to ``state`` (in place) and return it."""
    # One combined test on the hot path; check_preamble sorts out the rare cases.
    if position != state.position + 1 or event.epoch != state.epoch or not state.started:
        check_preamble(state, event, position)
    # Dispatch on the exact type: one dict lookup instead of up to 17 isinstance tests.
    handler = HANDLERS.get(type(event))
    if handler is None:
        handler = handler_for(event)
    handler(state, event, position)
    state.position = position
    return state


def handler_for(event: AnyEvent) -> _Handler:
    """The handler of an event whose exact type is not a key of ``HANDLERS``: a subclass of
    an event type gets its base's, anything outside the union is an error (never a no-op)."""
    for cls in type(event).__mro__[1:]:
        handler = HANDLERS.get(cls)
        if handler is not None:
            return handler
    assert_never(event)  # type: ignore[arg-type]


def _violation(position: int, event: AnyEvent, reason: str) -> NoReturn:
    raise InvariantViolation(position, reason, getattr(event, "event_id", None))


def check_preamble(state: RunState, event: AnyEvent, position: int) -> None:
    """Position, first-event and epoch rules; returns only if the event may proceed."""
    if position != state.position + 1:
        _violation(position, event, f"log position must follow {state.position} (gapless)")
    if not state.started:
        if type(event) is not RunStarted:
            _violation(position, event, "the first event of a run must be RunStarted")
        return
    if type(event) is ControllerStarted:
        return  # its handler checks that the epoch is new
    if event.epoch < state.epoch:
        _violation(
            position, event, f"stale epoch {event.epoch}: epoch {state.epoch} owns the run"
        )
    if event.epoch > state.epoch:
        _violation(
            position,
            event,
            f"epoch {event.epoch} was never claimed (current epoch {state.epoch}); "
            "a ControllerStarted must claim it first",
        )


# -- run and controller lifecycle ---------------------------------------------------


def _on_run_started(state: RunState, ev: RunStarted, pos: int) -> None:
    if state.started:
        _violation(pos, ev, f"RunStarted again (run {state.run_id!r} already started)")
    if ev.epoch < 1:
        _violation(pos, ev, f"RunStarted must claim an epoch >= 1, got {ev.epoch}")
    if ev.window_versions < 0 or ev.groups_per_step < 1 or ev.samples_per_group < 1:
        _violation(
            pos,
            ev,
            "need window_versions >= 0, groups_per_step >= 1, samples_per_group >= 1; got "
            f"{ev.window_versions}, {ev.groups_per_step}, {ev.samples_per_group}",
        )
    state.started = True
    state.run_id = ev.run_id
    state.config = dict(ev.config)
    state.seed = ev.seed
    state.code_version = ev.code_version
    state.window_versions = ev.window_versions
    state.groups_per_step = ev.groups_per_step
    state.samples_per_group = ev.samples_per_group
    state.epoch = ev.epoch


def _on_controller_started(state: RunState, ev: ControllerStarted, pos: int) -> None:
    last_started = state.epochs[-1].epoch if state.epochs else 0
    # The first ControllerStarted may repeat the epoch RunStarted claimed.
    if ev.epoch <= last_started or ev.epoch < state.epoch:
        _violation(
            pos,
            ev,
            f"ControllerStarted epoch {ev.epoch} is not newer than epoch "
            f"{max(last_started, state.epoch)}",
        )
    state.epoch = ev.epoch
    state.epochs.append(
        EpochRecord(epoch=ev.epoch, host=ev.host, pid=ev.pid, ts=ev.ts, position=pos)
    )
    # A restarted controller may resume a finished run.
    state.finished = False
    state.finished_reason = None


def _on_run_finished(state: RunState, ev: RunFinished, pos: int) -> None:
    if state.finished:
        _violation(pos, ev, "RunFinished again (the run is already finished)")
    if state.open_step is not None:
        _violation(pos, ev, f"RunFinished while step {state.open_step.step} is open")
    state.finished = True
    state.finished_reason = ev.reason


def _on_worker_lost(state: RunState, ev: WorkerLost, pos: int) -> None:
    state.workers_lost.append(
        WorkerLossRecord(worker=ev.worker, role=ev.role, reason=ev.reason, ts=ev.ts, position=pos)
    )


# -- groups ---------------------------------------------------------------------------


def _on_rollout_admitted(state: RunState, ev: RolloutAdmitted, pos: int) -> None:
    gid = ev.group_id
    groups = state.groups
    # Hot path: a new group's first attempt passes this one test; everything else
    # (re-admission, or a violation) goes through the checks that explain it.
    if state.finished or gid in groups or ev.attempt != 1 or ev.n_samples < 1:
        _check_admission(state, ev, pos)
    groups[gid] = GroupRecord(
        group_id=gid,
        status=_ADMITTED,
        attempt=ev.attempt,
        prompt_index=ev.prompt_index,
        prompt_ref=ev.prompt_ref,
        n_samples=ev.n_samples,
        sample_seed=ev.sample_seed,
        dispatch_weight_version=ev.weight_version,
        admitted_ts=ev.ts,
        admitted_position=pos,
    )
    state.admitted[gid] = None


def _check_admission(state: RunState, ev: RolloutAdmitted, pos: int) -> None:
    if state.finished:
        _violation(pos, ev, f"group {ev.group_id} admitted after RunFinished")
    old = state.groups.get(ev.group_id)
    if old is None:
        if ev.attempt != 1:
            _violation(pos, ev, f"new group {ev.group_id} must be attempt 1, got {ev.attempt}")
    elif old.status is not GroupStatus.FAILED:
        _violation(
            pos, ev, f"group {ev.group_id} is {old.status.value}; only a failed group is re-admitted"
        )
    elif ev.attempt != old.attempt + 1:
        _violation(
            pos,
            ev,
            f"group {ev.group_id} re-admitted as attempt {ev.attempt}, expected {old.attempt + 1}",
        )
    if ev.n_samples < 1:
        _violation(pos, ev, f"group {ev.group_id} admitted with n_samples {ev.n_samples}")


def _admitted_group(
    state: RunState, ev: GroupCommitted | GroupFailed, pos: int
) -> GroupRecord:
    group = state.groups.get(ev.group_id)
    if group is None:
        _violation(pos, ev, f"group {ev.group_id} was never admitted")
    if group.status is not _ADMITTED:
        _violation(pos, ev, f"group {ev.group_id} is {group.status.value}, not admitted")
    if group.attempt != ev.attempt:
        _violation(
            pos,
            ev,
            f"group {ev.group_id} attempt {ev.attempt} does not match the admitted "
            f"attempt {group.attempt}",
        )
    return group


def _on_group_committed(state: RunState, ev: GroupCommitted, pos: int) -> None:
    # Hot path: the checks are inlined (see _admitted_group for messages).
    gid = ev.group_id
    group = state.groups.get(gid)
    if group is None or group.status is not _ADMITTED or group.attempt != ev.attempt:
        group = _admitted_group(state, ev, pos)  # raises, naming what is wrong
    keys, rewards, lengths = ev.payload_keys, ev.rewards, ev.lengths
    n = len(keys)
    start, end = ev.weight_version_start, ev.weight_version_end
    if not n or len(rewards) != n or len(lengths) != n or end < start:
        _check_commit(ev, pos)
    group.status = _COMMITTED
    group.committed_ts = ev.ts
    group.committed_position = pos
    group.weight_version_start = start
    group.weight_version_end = end
    group.payload_keys = tuple(keys)
    group.rewards = tuple(rewards)
    group.lengths = tuple(lengths)
    del state.admitted[gid]
    state.buffer[gid] = None


def _check_commit(ev: GroupCommitted, pos: int) -> None:
    n = len(ev.payload_keys)
    if not n or len(ev.rewards) != n or len(ev.lengths) != n:
        _violation(
            pos,
            ev,
            f"group {ev.group_id}: payload_keys/rewards/lengths must have the same non-zero "
            f"length, got {n}/{len(ev.rewards)}/{len(ev.lengths)}",
        )
    if ev.weight_version_end < ev.weight_version_start:
        _violation(
            pos,
            ev,
            f"group {ev.group_id}: weight_version_end {ev.weight_version_end} < start "
            f"{ev.weight_version_start}",
        )


def _on_group_failed(state: RunState, ev: GroupFailed, pos: int) -> None:
    group = _admitted_group(state, ev, pos)
    group.status = GroupStatus.FAILED
    group.failed_reason = ev.reason
    del state.admitted[ev.group_id]


def _on_group_evicted(state: RunState, ev: GroupEvicted, pos: int) -> None:
    group = state.groups.get(ev.group_id)
    if group is None or group.status is not _COMMITTED:
        status = "unknown" if group is None else group.status.value
        _violation(
            pos, ev, f"only a committed, unclaimed group can be evicted; {ev.group_id} is {status}"
        )
    group.status = GroupStatus.EVICTED
    group.evicted_reason = ev.reason
    group.evicted_lag = ev.lag
    del state.buffer[ev.group_id]


def _on_payloads_released(state: RunState, ev: PayloadsReleased, pos: int) -> None:
    ids = ev.group_ids
    if len(ids) > 1 and len(set(ids)) != len(ids):
        _violation(pos, ev, "duplicate group ids in PayloadsReleased")
    groups, steps = state.groups, state.steps
    covered = state.covered_trainer_version()
    for gid in ids:
        group = groups.get(gid)
        if group is None:
            _violation(pos, ev, f"payloads of unknown group {gid} released")
        if group.payload_released:
            _violation(pos, ev, f"payloads of group {gid} were already released")
        status = group.status
        if status is _CONSUMED:
            # A finished step's trainer_version is never None.
            if steps[group.consumed_step].trainer_version <= covered:  # type: ignore[index, operator]
                continue
        # Identity tests: hashing an Enum member (set membership) runs Python code.
        elif status is _EVICTED or status is _FAILED or status is _LOST:
            continue
        _violation(
            pos,
            ev,
            f"payloads released before a checkpoint covers them: group {gid} is "
            f"{status.value}"
            + ("" if group.consumed_step is None else f" by step {group.consumed_step}")
            + f", newest usable checkpoint is trainer_version {covered}",
        )
    for gid in ids:
        group = groups[gid]
        group.payload_released = True
        if group.status is _CONSUMED:
            group.status = _RELEASED
    state.released_groups += len(ids)


# -- steps ----------------------------------------------------------------------------


def _open_step(state: RunState, ev: MicrobatchTrained | StepFinished | StepAborted, pos: int) -> OpenStep:
    open_step = state.open_step
    if open_step is None:
        _violation(pos, ev, f"step {ev.step} is not open (no step is open)")
    if open_step.step != ev.step:
        _violation(pos, ev, f"step {ev.step} is not open (step {open_step.step} is)")
    return open_step


def _on_step_begun(state: RunState, ev: StepBegun, pos: int) -> None:
    if state.open_step is not None:
        _violation(pos, ev, f"step {ev.step} begun while step {state.open_step.step} is open")
    if state.finished:
        _violation(pos, ev, f"step {ev.step} begun after RunFinished")
    if ev.step != state.next_step:
        _violation(
            pos, ev, f"step {ev.step} begun, expected step {state.next_step} (numbers are never reused)"
        )
    if ev.base_trainer_version != state.trainer_version:
        _violation(
            pos,
            ev,
            f"step {ev.step} base_trainer_version {ev.base_trainer_version} != "
            f"trainer_version {state.trainer_version}",
        )
    state.open_step = OpenStep(
        step=ev.step, base_trainer_version=ev.base_trainer_version, begun_ts=ev.ts, begun_position=pos
    )
    state.next_step = ev.step + 1


def _on_microbatch_trained(state: RunState, ev: MicrobatchTrained, pos: int) -> None:
    open_step = state.open_step
    if open_step is None or open_step.step != ev.step:
        open_step = _open_step(state, ev, pos)  # raises, naming what is wrong
    microbatches = open_step.microbatches
    if ev.index != len(microbatches):
        _violation(pos, ev, f"microbatch index {ev.index}, expected {len(microbatches)}")
    ids = ev.group_ids
    if not ids or (len(ids) > 1 and len(set(ids)) != len(ids)):
        _violation(pos, ev, "a microbatch needs at least one group and no duplicate ids")
    if ev.num_sequences < 0 or ev.num_tokens < 0:
        _violation(pos, ev, "negative num_sequences/num_tokens")
    groups, buffer = state.groups, state.buffer
    base, window = open_step.base_trainer_version, state.window_versions
    for gid in ids:
        if gid not in buffer:
            _violation(pos, ev, _unclaimable(state, gid))
        lag = base - groups[gid].weight_version_start  # type: ignore[operator]
        if lag < 0 or lag > window:
            _violation(
                pos,
                ev,
                f"group {gid} lag {lag} at trainer_version {base} is outside the window "
                f"[0, {window}]",
            )
    step = ev.step
    for gid in ids:
        del buffer[gid]
        group = groups[gid]
        group.status = _CLAIMED
        group.claimed_step = step
        group.lag = base - group.weight_version_start  # type: ignore[operator]
    microbatches.append(tuple(ids))
    open_step.num_sequences += ev.num_sequences
    open_step.num_tokens += ev.num_tokens


def _unclaimable(state: RunState, gid: str) -> str:
    group = state.groups.get(gid)
    if group is None:
        return f"group {gid} was never admitted"
    if group.status is _CLAIMED:
        return f"group {gid} is already claimed by step {group.claimed_step}"
    return f"group {gid} is {group.status.value}; only committed groups can be trained on"


def _on_step_finished(state: RunState, ev: StepFinished, pos: int) -> None:
    open_step = _open_step(state, ev, pos)
    if not open_step.microbatches:
        _violation(pos, ev, f"step {ev.step} finished without any microbatch")
    if ev.trainer_version != open_step.base_trainer_version + 1:
        _violation(
            pos,
            ev,
            f"step {ev.step} finished at trainer_version {ev.trainer_version}, expected "
            f"{open_step.base_trainer_version + 1} (base + 1)",
        )
    groups = state.groups
    group_ids = tuple(chain.from_iterable(open_step.microbatches))
    for gid in group_ids:
        group = groups[gid]
        group.status = _CONSUMED
        group.consumed_step = ev.step
    state.steps[ev.step] = _step_record(
        open_step, ev, pos, group_ids, StepStatus.FINISHED, ev.trainer_version
    )
    state.version_steps[ev.trainer_version] = ev.step
    state.trainer_version = ev.trainer_version
    state.open_step = None


def _on_step_aborted(state: RunState, ev: StepAborted, pos: int) -> None:
    open_step = _open_step(state, ev, pos)
    groups = state.groups
    group_ids = tuple(chain.from_iterable(open_step.microbatches))
    for gid in group_ids:
        group = groups[gid]
        group.status = _COMMITTED
        group.claimed_step = None
        group.lag = None
    if group_ids:
        # Back into the buffer in their original commit order.
        merged = sorted([*state.buffer, *group_ids], key=lambda g: groups[g].committed_position)  # type: ignore[arg-type, return-value]
        state.buffer = dict.fromkeys(merged)
    record = _step_record(open_step, ev, pos, group_ids, StepStatus.ABORTED, None)
    record.abort_reason = ev.reason
    state.steps[ev.step] = record
    state.open_step = None


def _step_record(
    open_step: OpenStep,
    ev: StepFinished | StepAborted,
    pos: int,
    group_ids: tuple[str, ...],
    status: StepStatus,
    trainer_version: int | None,
) -> StepRecord:
    record = StepRecord(
        step=open_step.step,
        base_trainer_version=open_step.base_trainer_version,
        trainer_version=trainer_version,
        status=status,
        group_ids=group_ids,
        microbatches=open_step.microbatches,
        num_sequences=open_step.num_sequences,
        num_tokens=open_step.num_tokens,
        begun_ts=open_step.begun_ts,
        begun_position=open_step.begun_position,
        ended_ts=ev.ts,
        ended_position=pos,
    )
    if isinstance(ev, StepFinished):
        record.metrics = ev.metrics
        record.grad_norm = ev.grad_norm
        record.weights_digest = ev.weights_digest
    return record


# -- weights and checkpoints ------------------------------------------------------------


def _on_weights_published(state: RunState, ev: WeightsPublished, pos: int) -> None:
    if ev.weight_version > state.trainer_version:
        _violation(
            pos,
            ev,
            f"weight_version {ev.weight_version} published ahead of trainer_version "
            f"{state.trainer_version}",
        )
    if ev.weight_version < state.weight_version:
        _violation(
            pos,
            ev,
            f"weight_version {ev.weight_version} published after {state.weight_version} "
            "(published versions never go back, except by RunRewound)",
        )
    state.weight_version = ev.weight_version


def _on_checkpoint_saved(state: RunState, ev: CheckpointSaved, pos: int) -> None:
    # Every version in 0..trainer_version is initial weights (0) or was produced by a
    # finished, not lost step (``version_steps``), so "<= trainer_version" is the rule.
    version = ev.trainer_version
    if not 0 <= version <= state.trainer_version:
        _violation(
            pos,
            ev,
            f"checkpoint of trainer_version {version}: the trainer is at "
            f"{state.trainer_version}",
        )
    state.checkpoints.append(
        CheckpointRecord(trainer_version=version, uri=ev.uri, sha256=ev.sha256, ts=ev.ts, position=pos)
    )


def _on_checkpoint_rejected(state: RunState, ev: CheckpointRejected, pos: int) -> None:
    for ckpt in state.checkpoints:
        if ckpt.trainer_version == ev.trainer_version and ckpt.uri == ev.uri:
            ckpt.rejected = True
    state.rejected_checkpoints.append(
        CheckpointRejection(
            trainer_version=ev.trainer_version, uri=ev.uri, reason=ev.reason, ts=ev.ts, position=pos
        )
    )


def _on_run_rewound(state: RunState, ev: RunRewound, pos: int) -> None:
    to = ev.to_trainer_version
    if state.open_step is not None:
        _violation(pos, ev, f"RunRewound while step {state.open_step.step} is open")
    if to > state.trainer_version:
        _violation(pos, ev, f"rewind to {to}, ahead of trainer_version {state.trainer_version}")
    if not any(
        c.trainer_version == to and not c.rejected and not c.lost for c in state.checkpoints
    ):
        _violation(pos, ev, f"rewind to trainer_version {to}: no usable checkpoint of it")
    lost_steps = [state.version_steps[v] for v in range(to + 1, state.trainer_version + 1)]
    if sorted(ev.lost_steps) != lost_steps:
        _violation(
            pos, ev, f"lost_steps {sorted(ev.lost_steps)} must be exactly the steps after it: {lost_steps}"
        )
    lost_groups = [gid for s in lost_steps for gid in state.steps[s].group_ids]
    if len(ev.lost_group_ids) != len(set(ev.lost_group_ids)) or set(ev.lost_group_ids) != set(
        lost_groups
    ):
        _violation(pos, ev, "lost_group_ids must be exactly the groups of the lost steps")
    for step in lost_steps:
        state.steps[step].lost = True
        del state.version_steps[state.steps[step].trainer_version]  # type: ignore[arg-type]
    for gid in lost_groups:
        state.groups[gid].status = GroupStatus.LOST
    for ckpt in state.checkpoints:
        if ckpt.trainer_version > to:
            ckpt.lost = True
    state.rewinds.append(
        RewindRecord(
            from_trainer_version=state.trainer_version,
            to_trainer_version=to,
            lost_steps=lost_steps,
            lost_group_ids=list(ev.lost_group_ids),
            reason=ev.reason,
            ts=ev.ts,
            position=pos,
        )
    )
    state.trainer_version = to
    state.weight_version = min(state.weight_version, to)


#: Exact event type -> handler: the reducer's ``match`` over the event union, as one dict
#: lookup per event instead of a chain of up to 17 isinstance tests. ``apply_event`` is
#: ``check_preamble`` (when the one combined test fails) + ``HANDLERS[type(event)]`` +
#: ``state.position = position``; ``controller.fold`` inlines exactly that in its loop.
HANDLERS: dict[type, _Handler] = {
    RunStarted: _on_run_started,
    ControllerStarted: _on_controller_started,
    RolloutAdmitted: _on_rollout_admitted,
    GroupCommitted: _on_group_committed,
    GroupFailed: _on_group_failed,
    GroupEvicted: _on_group_evicted,
    StepBegun: _on_step_begun,
    MicrobatchTrained: _on_microbatch_trained,
    StepFinished: _on_step_finished,
    StepAborted: _on_step_aborted,
    WeightsPublished: _on_weights_published,
    CheckpointSaved: _on_checkpoint_saved,
    CheckpointRejected: _on_checkpoint_rejected,
    PayloadsReleased: _on_payloads_released,
    RunRewound: _on_run_rewound,
    WorkerLost: _on_worker_lost,
    RunFinished: _on_run_finished,
}

# Exhaustive over the union, checked at import: an event type added to the schema
# without a handler fails here, not at its first occurrence in a log.
_missing = set(get_args(AnyEvent)) - set(HANDLERS)
if _missing:
    raise ImportError(f"no reducer handler for {sorted(c.__name__ for c in _missing)}")
