"""Reducer handlers for the group lifecycle: admit, commit, fail, evict, release.

Part of ``controller.core.reducer`` (which dispatches to these); the same rules hold:
validate first, mutate after, violations name the position. Pure.
"""

from __future__ import annotations

import struct

from controller.core import failures
from controller.core import reducer_episodes as episodes
from controller.core.episodes import InflightEpisodes, restart
from controller.core.errors import violation as _violation
from controller.core.segments import (
    InflightSegments,
    commit_problem,
    commit_summary,
    lost_samples,
    record_flush,
    runs_problem,
    segments_problem,
    without_samples,
)
from controller.core.packing import pack_f64, pack_i64, pack_keys
from controller.core.state import GroupRecord, GroupStatus, RunState
from events.schema import (
    GroupCommitted,
    GroupEvicted,
    GroupFailed,
    PayloadsReleased,
    RolloutAdmitted,
    SegmentsDropped,
    SegmentsRecorded,
)

_ADMITTED = GroupStatus.ADMITTED
_COMMITTED = GroupStatus.COMMITTED
_CONSUMED = GroupStatus.CONSUMED
_RELEASED = GroupStatus.RELEASED
_EVICTED = GroupStatus.EVICTED
_FAILED = GroupStatus.FAILED
_LOST = GroupStatus.LOST


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
    if ev.generator:  # where it runs: its commit or failure counts for or against that worker
        state.failures.dispatched[gid] = ev.generator
    rec = state.inflight.get(gid) if state.inflight else None
    if rec is not None:  # a re-admission resumes from what earlier attempts recorded
        rec.attempt, rec.attempt_flushes = ev.attempt, 0
    if state.episodes:
        episodes.on_readmitted(state, gid, ev.attempt)


def _on_segments_recorded(state: RunState, ev: SegmentsRecorded, pos: int) -> None:
    group = _admitted_group(state, ev, pos)
    rec = state.inflight.get(ev.group_id)
    if rec is None:
        rec = InflightSegments.empty(group.n_samples, group.attempt)
    problem = segments_problem(rec, ev, state.trainer_version)
    if problem:
        _violation(pos, ev, f"group {ev.group_id}: {problem}")
    record_flush(rec, ev)
    state.inflight[ev.group_id] = rec


def _on_segments_dropped(state: RunState, ev: SegmentsDropped, pos: int) -> None:
    """Only a failed attempt's group drops segments (no attempt is sampling after them),
    and only segments it recorded; each sample that lost one restarts from the prompt.

    An episode's sample that recorded calls restarts its episode too (a new ``restart``
    in its calls' keys, its turns dropped, as ``EpisodesRestarted`` does): its turns'
    tokens are gone, so its next attempt samples them again and cannot be held to the
    requests the lost turns made, nor be handed results whose context it no longer has
    (a resume refused such a sample at every attempt, "the result recorded N
    observation tokens, the rows hold 0", until the group ran out of attempts)."""
    gid = ev.group_id
    group = state.groups.get(gid)
    if group is None or group.status is not _FAILED or group.attempt != ev.attempt:
        status = "unknown" if group is None else f"{group.status.value} at attempt {group.attempt}"
        _violation(pos, ev, f"segments of group {gid} dropped by attempt {ev.attempt}; only the "
                            f"attempt that failed may drop them, the group is {status}")
    rec = state.inflight.get(gid) if state.inflight else None
    if rec is None or not ev.keys:
        _violation(pos, ev, f"group {gid} has no recorded segments to drop" if rec is None
                   else f"group {gid}: a drop names no key")
    samples, unknown = lost_samples(rec, ev.keys)
    if unknown:
        _violation(pos, ev, f"group {gid}: {unknown[0]} is not a segment the group recorded")
    played = state.episodes.get(gid) if state.episodes else None
    if played is not None and (called := [i for i in sorted(samples) if played.samples[i].turns]):
        restart(played, None, called)
    kept = without_samples(rec, samples)
    if kept is None:
        del state.inflight[gid]
    else:
        state.inflight[gid] = kept


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


#: what a commit's checks found, for its handler to apply: the group, its packed lengths,
#: and its episode and segment records
CheckedCommit = tuple[GroupRecord, bytes, "InflightEpisodes | None", "InflightSegments | None"]


def check_committed(state: RunState, ev: GroupCommitted, pos: int) -> CheckedCommit:
    """Every rule a commit must pass: raises the violation applying ``ev`` at ``pos``
    would raise, reading ``state`` only (one copy of each rule, for the handler and the
    log writer, which checks a worker's commit before the store write so that a bad one
    is refused instead of written). Returns what :func:`apply_checked_commit` applies:
    the group, its packed lengths, and its episode and segment records -- valid as long
    as nothing about its group changes in between."""
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
    try:
        packed_lengths = pack_i64(lengths)
    except struct.error:
        _violation(pos, ev, f"group {gid}: a length is not an int64")
    played = episodes.check_commit(state, ev, pos) if state.episodes else None
    rec = state.inflight.get(gid) if state.inflight else None
    if rec is not None and (problem := commit_problem(rec, lengths, start, end)):
        _violation(pos, ev, f"group {gid}: {problem}")
    if ev.version_runs and (problem := runs_problem(ev.version_runs, lengths, start, end, rec)):
        _violation(pos, ev, f"group {gid}: {problem}")
    return group, packed_lengths, played, rec


def _on_group_committed(state: RunState, ev: GroupCommitted, pos: int) -> None:
    apply_checked_commit(state, ev, pos, check_committed(state, ev, pos))


def apply_checked_commit(state: RunState, ev: GroupCommitted, pos: int, checked: CheckedCommit) -> None:
    """The commit's change to ``state``, its checks passed (``checked``: what they found)."""
    group, packed_lengths, played, rec = checked
    gid, start, end = ev.group_id, ev.weight_version_start, ev.weight_version_end
    if rec is not None:
        del state.inflight[gid]
    episodes.on_committed(state, group, played, rec)
    group.version_token_sum, group.partial_span, group.obs_tokens = commit_summary(
        rec, ev.lengths, start, end, ev.version_runs
    )
    group.status = _COMMITTED
    group.committed_ts = ev.ts
    group.committed_position = pos
    group.weight_version_start = start
    group.weight_version_end = end
    group.packed_keys = pack_keys(ev.payload_keys)
    group.rewards_f64 = pack_f64(ev.rewards)
    group.lengths_i64 = packed_lengths
    del state.admitted[gid]
    state.buffer[gid] = None
    failures.on_committed(state.failures, gid)


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
    failures.on_failed(state.failures, ev.group_id, ev.reason, ev.ts, pos)


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
