"""Reducer handler for an episode pause (``EpisodeTurnsRecorded``), folded in one pass.

A pause stands for the events it replaced (``controller.core.turns.expand``):
``EnvStepsCompleted``, one ``SegmentsRecorded`` per flush, ``EnvStepsRequested``, applied
in that order at the pause's one position. Folding it by expanding it and dispatching
each part built two env events per pause that nothing keeps, only to take their fields
apart again. Here the pause's results and calls are checked and recorded straight from
the pause, with the same rule functions the parts' handlers call
(``episodes.env_items_problem`` and friends: one copy of each rule); its flushes go
through the ``SegmentsRecorded`` handler as before, since the state keeps each flush as
that event.

The resulting state and every problem are exactly those of folding the parts in turn:
a part that breaks a rule leaves the parts before it applied (as folding them did), and
its violation is raised by that part's own handler on the part itself, so the message
and the event id it names are the parts' (``tests/unit/test_pause_fold.py`` folds
generated pauses, valid and each kind of bad, both ways). Observers that must see the
state between the parts still fold them one by one (``reducer.apply_parts``).

Pure: no I/O, no clock, no randomness, no logging.
"""

from __future__ import annotations

from controller.core.episodes import (
    InflightEpisodes,
    env_items_problem,
    env_problem,
    record_completed,
    record_requested,
)
from controller.core.errors import violation
from controller.core.reducer_episodes import _on_env_steps_completed, _on_env_steps_requested
from controller.core.reducer_groups import _on_segments_recorded
from controller.core.state import GroupStatus, RunState
from controller.core.turns import expand, flush_part
from events.schema import EnvStepsCompleted, EnvStepsRequested, EpisodeTurnsRecorded

_ADMITTED = GroupStatus.ADMITTED


def fold_pause(state: RunState, ev: EpisodeTurnsRecorded, pos: int) -> None:
    """Apply a pause's parts, in order, without building its env events."""
    results, flushes, calls = ev.results, ev.flushes, ev.calls
    if not results and not flushes and not calls:
        violation(pos, ev, f"group {ev.group_id}: a pause with no results, segments or calls")
    gid, attempt, env_index = ev.group_id, ev.attempt, ev.env_index
    group = state.groups.get(gid)
    admitted = group is not None and group.status is _ADMITTED and group.attempt == attempt
    if results:
        rec = state.episodes.get(gid)
        if not admitted or rec is None or env_items_problem(rec, env_index, attempt, results, True):
            _part_breaks_a_rule(state, ev, pos, EnvStepsCompleted)
        record_completed(rec, results)  # type: ignore[arg-type]
        env_index += 1
    for k, flush in enumerate(flushes, start=ev.segment_index):
        _on_segments_recorded(state, flush_part(ev, k, flush), pos)
    if calls:
        rec = state.episodes.get(gid)
        if rec is None and admitted:
            rec = InflightEpisodes.empty(group.n_samples, attempt, ev.env, ev.dedupes_by_key,  # type: ignore[union-attr]
                                         ev.agent)
        if (not admitted or env_problem(rec, ev.env, ev.dedupes_by_key, ev.agent)  # type: ignore[arg-type]
                or env_items_problem(rec, env_index, attempt, calls, False)):  # type: ignore[arg-type]
            _part_breaks_a_rule(state, ev, pos, EnvStepsRequested)
        record_requested(rec, attempt, calls)  # type: ignore[arg-type]
        state.episodes[gid] = rec  # type: ignore[assignment]


def _part_breaks_a_rule(state: RunState, ev: EpisodeTurnsRecorded, pos: int, kind: type) -> None:
    """Raise the violation the pause's part of ``kind`` raises when applied on its own."""
    part = next(p for p in expand(ev) if type(p) is kind)
    handler = _on_env_steps_completed if kind is EnvStepsCompleted else _on_env_steps_requested
    handler(state, part, pos)  # type: ignore[arg-type]
    # the checks above are the handler's own; reaching here means the two disagree
    raise AssertionError(f"group {ev.group_id}: the pause's {kind.__name__} broke a rule "
                         "its own handler accepts")
