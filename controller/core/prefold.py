"""Worker facts folded before they are written: a generator's bad output is refused, never logged.

A pause (``EpisodeTurnsRecorded``, ``SegmentsRecorded``) and a commit (``GroupCommitted``)
carry what a generator returned. The fold is what checks them, and it used to run only
after the store had the batch: one out-of-rule flush from a buggy worker was written,
the fold refused it, and the log could never be folded past it again. The log writer
now calls :func:`prefold` on the state the batch will be folded onto, before the write:

* each pause is applied to the state at once, by its own handler (so the checks are the
  fold's, one copy of each rule), what it can change in its group's in-flight records
  marked first (``controller.core.group_marks.mark_pause``);
* each commit is checked without being applied (``reducer_groups.check_committed``);
* the first that breaks a rule puts every pause applied so far back, exactly, and
  raises :class:`RejectedFact` naming it: nothing of the batch is written, and the
  writer's caller decides what stands in for it (its group's attempt fails);
* otherwise the write goes on; if it fails, :func:`undo` puts the pauses back, and once
  it lands the writer folds the rest of the batch, only advances the position over the
  pauses already applied, and applies each checked commit with what its checks found
  instead of checking it again (:func:`fold_after_write`).

Exact only where no event of the batch depends on another: every event is about a
group (``group_id``), no two about the same one, none changes what another's checks
read (the trainer version, the run's end). The batches of worker facts are those (a
group is in one generator call; its commit follows its last pause's append); any other
batch is folded after the write as before (:func:`independent`).

Pure: no I/O, no clock, no randomness, no logging.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from controller.core.errors import InvariantViolation
from controller.core.group_marks import GroupMark, mark_pause, restore_group
from controller.core.reducer import apply_event, check_preamble, handle
from controller.core.reducer_groups import CheckedCommit, apply_checked_commit, check_committed
from controller.core.state import RunState
from events.schema import EpisodeTurnsRecorded, Event, GroupCommitted, SegmentsRecorded

#: the worker facts applied before the write (their group's records can be put back)
PAUSES: frozenset[type] = frozenset({EpisodeTurnsRecorded, SegmentsRecorded})
#: what a batch of worker facts may hold: these, and the commits
_FACTS = PAUSES | {GroupCommitted}


class RejectedFact(Exception):
    """A worker fact of a batch breaks a rule of the log: nothing of the batch was
    written. ``index`` is its place in the batch."""

    def __init__(self, index: int, event: Event, violation: InvariantViolation) -> None:
        self.index, self.event, self.violation = index, event, violation
        super().__init__(f"{type(event).__name__} {event.event_id} refused before it was "
                         f"written: {violation.reason}")


@dataclass
class Prefolded:
    """What :func:`prefold` did to a batch: the pauses it applied (index in the batch ->
    their group's mark, in batch order) and the commits it checked (index -> what the
    checks found, for :func:`fold_after_write`)."""

    pauses: dict[int, GroupMark] = field(default_factory=dict)
    commits: dict[int, CheckedCommit] = field(default_factory=dict)


def independent(state: RunState, batch: Sequence[Event]) -> bool:
    """Whether :func:`prefold` is exact for ``batch`` (see the module docstring): worker
    facts only, each about another group, written by the run's current epoch."""
    seen: set[str] = set()
    for event in batch:
        if type(event) not in _FACTS or event.epoch != state.epoch:
            return False
        gid = event.group_id  # type: ignore[attr-defined]
        if gid in seen:
            return False
        seen.add(gid)
    return state.started


def prefold(state: RunState, batch: Sequence[Event], first: int) -> Prefolded:
    """Apply ``batch``'s pauses and check its commits, the batch to be written at
    positions ``first``, ``first + 1``, ...; raises :class:`RejectedFact` for the first
    that breaks a rule, with the state as it was. Nothing for a batch
    :func:`independent` does not vouch for: the fold after the write checks it."""
    done = Prefolded()
    if not any(type(e) in _FACTS for e in batch) or not independent(state, batch):
        return done
    for k, event in enumerate(batch):
        try:
            if type(event) is GroupCommitted:
                done.commits[k] = check_committed(state, event, first + k)
                continue
            done.pauses[k] = mark_pause(state, event)  # type: ignore[arg-type]
            handle(state, event, first + k)
        except InvariantViolation as err:
            undo(state, done)
            raise RejectedFact(k, event, err) from None
        except Exception as err:  # a malformed value (a None where a number goes): refused too
            undo(state, done)
            why = f"malformed: {type(err).__name__}: {err}"
            raise RejectedFact(k, event, InvariantViolation(first + k, why, event.event_id)) from None
        except BaseException:  # an interrupt: nothing stays applied either
            undo(state, done)
            raise
    return done


def undo(state: RunState, done: Prefolded) -> None:
    """Put back every pause :func:`prefold` applied (the write did not happen)."""
    for mark in reversed(done.pauses.values()):
        restore_group(state, mark)


def fold_after_write(state: RunState, done: Prefolded, k: int, event: Event, position: int) -> None:
    """Fold the ``k``-th event of a written batch: a pause :func:`prefold` applied only
    advances the position, a commit it checked is applied with what its checks found
    (nothing about its group changed since: the batch is :func:`independent`), any
    other event is folded as always."""
    if k not in done.pauses:
        checked = done.commits.get(k)
        if checked is None:
            apply_event(state, event, position)  # type: ignore[arg-type]
            return
        _preamble(state, event, position)
        apply_checked_commit(state, event, position, checked)  # type: ignore[arg-type]
    else:
        _preamble(state, event, position)
    state.position = position


def _preamble(state: RunState, event: Event, position: int) -> None:
    """What ``reducer.apply_event`` checks before the handler (position, epoch, start)."""
    if position != state.position + 1 or event.epoch != state.epoch or not state.started:
        check_preamble(state, event, position)  # type: ignore[arg-type]
