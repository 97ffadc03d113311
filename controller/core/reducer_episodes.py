"""Reducer handlers for episodes: environment intents and results, restarts, commits.

Part of ``controller.core.reducer`` (which dispatches to these); the rules are
``controller.core.episodes``'s. Validate first, mutate after; violations name the
position. Pure.
"""

from __future__ import annotations

from controller.core.episodes import (
    InflightEpisodes,
    commit_problem,
    completed_problem,
    record_completed,
    record_requested,
    requested_problem,
    restart,
    restart_problem,
    summarize,
)
from controller.core.errors import violation
from controller.core.segments import InflightSegments
from controller.core.state import GroupRecord, GroupStatus, RunState
from events.schema import (
    EnvStepsCompleted,
    EnvStepsRequested,
    EpisodesRestarted,
    GroupCommitted,
)


def _admitted(state: RunState, ev: EnvStepsRequested | EnvStepsCompleted, pos: int) -> GroupRecord:
    group = state.groups.get(ev.group_id)
    if group is None or group.status is not GroupStatus.ADMITTED or group.attempt != ev.attempt:
        status = "unknown" if group is None else f"{group.status.value} at attempt {group.attempt}"
        violation(pos, ev, f"group {ev.group_id} attempt {ev.attempt}: env calls of a group "
                           f"that is not admitted at that attempt ({status})")
    return group


def _on_env_steps_requested(state: RunState, ev: EnvStepsRequested, pos: int) -> None:
    group = _admitted(state, ev, pos)
    rec = state.episodes.get(ev.group_id)
    if rec is None:
        rec = InflightEpisodes.empty(group.n_samples, group.attempt, ev.env, ev.dedupes_by_key,
                                     ev.agent)
    problem = requested_problem(rec, ev)
    if problem:
        violation(pos, ev, f"group {ev.group_id}: {problem}")
    record_requested(rec, ev.attempt, ev.calls)
    state.episodes[ev.group_id] = rec


def _on_env_steps_completed(state: RunState, ev: EnvStepsCompleted, pos: int) -> None:
    _admitted(state, ev, pos)
    rec = state.episodes.get(ev.group_id)
    problem = "no call was requested" if rec is None else completed_problem(rec, ev)
    if problem:
        violation(pos, ev, f"group {ev.group_id}: {problem}")
    assert rec is not None
    record_completed(rec, ev.results)


def _on_episodes_restarted(state: RunState, ev: EpisodesRestarted, pos: int) -> None:
    group = state.groups.get(ev.group_id)
    if group is None or group.status is not GroupStatus.FAILED or group.attempt != ev.attempt:
        violation(pos, ev, f"group {ev.group_id}: episodes restart only after attempt "
                           f"{ev.attempt} failed")
    rec = state.episodes.get(ev.group_id)
    problem = restart_problem(rec, ev)
    if problem:
        violation(pos, ev, f"group {ev.group_id}: {problem}")
    assert rec is not None
    kept = restart(rec, state.inflight.get(ev.group_id), ev.samples)
    if kept is not None:
        state.inflight[ev.group_id] = kept


def on_readmitted(state: RunState, group_id: str, attempt: int) -> None:
    """A re-admitted group's episodes go on under the new attempt."""
    rec = state.episodes.get(group_id)
    if rec is not None:
        rec.attempt, rec.attempt_events = attempt, 0


def check_commit(state: RunState, ev: GroupCommitted, pos: int) -> InflightEpisodes | None:
    """The group's episode record if the commit agrees with it (violation otherwise)."""
    rec = state.episodes.get(ev.group_id)
    if rec is not None and (problem := commit_problem(rec, ev.rewards)):
        violation(pos, ev, f"group {ev.group_id}: {problem}")
    return rec


def on_committed(
    state: RunState, group: GroupRecord, rec: InflightEpisodes | None,
    segments: InflightSegments | None,
) -> None:
    """After a checked commit: the episodes' turns move onto the group."""
    if rec is not None:
        del state.episodes[group.group_id]
        group.episode = summarize(rec, segments)
