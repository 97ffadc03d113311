"""The failure budget: when failing generations stop the run, and how a worker whose
calls keep failing is held back.

Without it, a run whose every group fails (a tokenizer that encodes prompts to nothing,
a task whose ``reward()`` raises) admitted and failed groups forever: 300k events in
five minutes, nothing on the console. Two rules, both pure functions of the folded
state (``RunState.failures``, a :class:`FailureRecord`):

* **Stop** (:func:`stop_decision`). Once ``failures.max_in_row`` groups failed in a row
  on the workers -- no group committed since, on any of them -- the decision is a
  ``RunStopped`` naming the root cause: the worker's exception type and message, as
  the first of those failures recorded it. The shell appends it and stops (exit status
  4); the log stays consistent and the run resumable once the cause is fixed.
* **Back off** (:func:`ready_at`). A worker whose calls keep failing gets its next call
  only ``backoff_s * 2 ** (k - 1)`` seconds (at most ``backoff_max_s``) after its last
  failure, ``k`` its failed calls in a row; a commit of one of its groups resets it. A
  sick generator cannot flood the log while the others work, and a lone one reaches
  the stop after a bounded number of events.

The streaks are folded from the log, so a replay or a resumed controller sees the same
ones: ``RolloutAdmitted.generator`` says where a group runs, ``GroupFailed`` and
``GroupCommitted`` of that group count against or for that worker (and the run).
``ControllerStarted`` starts them afresh -- a user who fixed the cause and resumed gets
a whole budget, and the failures a new controller records for its predecessor's
in-flight groups blame no worker. So do failures in logs older than the field.

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import math

import msgspec

from events.config_checks import non_negative, positive


class FailuresSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[failures]``: when failing groups stop the run, and how re-admission backs off."""

    max_in_row: int = 0
    """Groups failing in a row (none committed) that stop the run. 0: eight full calls,
    or two full calls of every generator if that is more (rollout.groups_per_call x
    max(8, 2 x rollout.num_generators)): a lone generator stops after eight failed calls
    (about 13 s of back-off), and losing a node of generators at once does not stop a
    cluster run."""
    backoff_s: float = 0.1
    """A worker's next call after a failed one waits this long, doubling with each of its
    calls that failed in a row."""
    backoff_max_s: float = 10.0
    """The longest a worker is held back: its failure rate is at most one call per this."""

    def __post_init__(self) -> None:
        non_negative("failures", self, "max_in_row", "backoff_s")
        positive("failures", self, "backoff_max_s")

    def budget(self, num_generators: int, groups_per_call: int) -> int:
        """The groups failing in a row that stop a run of this shape."""
        return self.max_in_row or groups_per_call * max(8, 2 * num_generators)


class WorkerStreak(msgspec.Struct, kw_only=True, gc=False):
    """One worker's groups failed in a row, and when the last one failed (event time)."""

    in_row: int = 0
    last_ts: float = 0.0


class FailureRecord(msgspec.Struct, kw_only=True):
    """The failure streaks, as the reducer folds them (see the module docstring)."""

    #: groups in flight -> the generator they were dispatched to (RolloutAdmitted)
    dispatched: dict[str, str] = {}
    #: groups failed on workers since the last commit (or controller start)
    in_row: int = 0
    #: log position of the streak's first failure
    since_position: int = 0
    #: the streak's first failure: the worker and its error (worker prefix dropped)
    first_worker: str = ""
    cause: str = ""
    #: every failure of the streak had ``cause``
    same_cause: bool = True
    workers: dict[str, WorkerStreak] = {}
    #: RunStopped's reason, until a controller starts again
    stopped: str | None = None


# -- the reducer's part (called by controller.core.reducer_groups / reducer) -------------


def on_admitted(f: FailureRecord, group_id: str, generator: str) -> None:
    if generator:
        f.dispatched[group_id] = generator


def on_committed(f: FailureRecord, group_id: str) -> None:
    f.in_row = 0
    worker = f.dispatched.pop(group_id, None)
    if worker is not None:
        f.workers.pop(worker, None)


def on_failed(f: FailureRecord, group_id: str, reason: str, ts: float, position: int) -> None:
    worker = f.dispatched.pop(group_id, None)
    if worker is None:  # a repair after a restart, or an older log: nobody's failure
        return
    streak = f.workers.get(worker)
    if streak is None:
        streak = f.workers[worker] = WorkerStreak()
    streak.in_row += 1
    streak.last_ts = ts
    cause = root_cause(reason, worker)
    if f.in_row == 0:
        f.since_position, f.first_worker, f.cause, f.same_cause = position, worker, cause, True
    elif cause != f.cause:
        f.same_cause = False
    f.in_row += 1


def on_controller_started(f: FailureRecord) -> None:
    """A new controller: fresh streaks (the groups in flight are repaired, not blamed)."""
    f.dispatched.clear()
    f.workers.clear()
    f.in_row = 0
    f.stopped = None


def root_cause(reason: str, worker: str) -> str:
    """A GroupFailed reason without the ``"generator-0: "`` the shell puts in front."""
    prefix = f"{worker}: "
    return reason[len(prefix):] if reason.startswith(prefix) else reason


# -- the decisions ---------------------------------------------------------------------


def stop_reason(f: FailureRecord, budget: int) -> str | None:
    """Why the run must stop now (one line), or None while the budget lasts."""
    if f.stopped is not None or f.in_row < budget:
        return None
    which = "all with" if f.same_cause else "the first with"
    return (f"{f.in_row} groups failed in a row (none committed since log position "
            f"{f.since_position}), {which}: {f.cause} (on {f.first_worker})")


def ready_at(f: FailureRecord, worker: str, section: FailuresSection, groups_per_call: int) -> float:
    """Event time from which ``worker`` may get its next call (0.0: at once)."""
    streak = f.workers.get(worker)
    if streak is None or streak.in_row == 0 or section.backoff_s == 0:
        return 0.0
    calls = math.ceil(streak.in_row / max(1, groups_per_call))
    delay = min(section.backoff_max_s, section.backoff_s * 2.0 ** min(calls - 1, 60))
    return streak.last_ts + delay
