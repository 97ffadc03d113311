"""Reducer handlers for the step lifecycle: begin, microbatch (claim), finish, abort.

Part of ``controller.core.reducer`` (which dispatches to these); the same rules hold:
validate first, mutate after, violations name the position. Pure.
"""

from __future__ import annotations

from itertools import chain

from controller.core.errors import violation as _violation
from controller.core.state import (
    GroupStatus,
    OpenStep,
    RunState,
    StepRecord,
    StepStatus,
)
from events.schema import (
    MicrobatchTrained,
    StepAborted,
    StepBegun,
    StepFinished,
)

_COMMITTED = GroupStatus.COMMITTED
_CLAIMED = GroupStatus.CLAIMED
_CONSUMED = GroupStatus.CONSUMED


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
    newest = state.window_basis == "newest_token"
    for gid in ids:
        if gid not in buffer:
            _violation(pos, ev, _unclaimable(state, gid))
        group = groups[gid]
        lag = base - group.weight_version_start  # type: ignore[operator]
        # the window bounds the oldest token's lag, or the newest one's (partial rollouts)
        bounded = base - group.weight_version_end if newest else lag  # type: ignore[operator]
        if lag < 0 or bounded > window:
            _violation(
                pos,
                ev,
                f"group {gid} lag {bounded} at trainer_version {base} is outside the window "
                f"[0, {window}]" + (" (its newest token's)" if newest else ""),
            )
    step = ev.step
    claimed = []
    for gid in ids:
        del buffer[gid]
        group = groups[gid]
        group.status = _CLAIMED
        group.claimed_step = step
        group.lag = base - group.weight_version_start  # type: ignore[operator]
        # the record's own id string: the step keeps no second copy of each id
        claimed.append(group.group_id)
    microbatches.append(tuple(claimed))
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
