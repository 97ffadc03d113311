"""Named crash points at every write-ahead boundary -- a test hook, off by default.

``RLC_CRASH_AT=after_step_begun:3`` makes the controller process exit abruptly
(``os._exit``, no cleanup, no flush: as close to ``kill -9`` as a process can do to
itself) the moment it reaches ``after_step_begun`` with key 3. Without a key
(``RLC_CRASH_AT=before_group_committed``) the first hit crashes. Several points may be
given, comma separated. ``after_step_finished:1@trainer`` kills a *worker* (the trainer,
or ``generator-0``, ...) at that point instead, once, and the controller carries on:
the in-run WorkerLost path. Chaos tests use this to stop the controller between an intent
and its side effect, and between a side effect and its fact.

The points right after an append are the log writer's (``LogWriter.append`` calls
:func:`after_append` once the store acknowledged a batch): each event type has its point
and key in :data:`AFTER_APPEND`, and a batch may name one more, keyed by the writer's
epoch (:data:`BATCH_POINTS`). Nobody calls those by hand, so a new append site reaches
them without anyone remembering to. The others (``before_*``, and points after a side
effect rather than an append) are called where they stand.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, Callable, Final

from controller.core.state import RunState
from controller.core.turns import expanded
from events import schema as ev

ENV_VAR: Final = "RLC_CRASH_AT"
EXIT_CODE: Final = 137

#: Every boundary the controller announces, in protocol order. ``before_X`` sits
#: between a side effect and the fact ``X`` that records it (or just before the intent
#: ``X``); ``after_X`` sits right after the log acknowledged ``X``.
CRASH_POINTS: Final = (
    # opening a run (controller.startup)
    "after_run_started",
    "after_controller_started",
    "after_log_repaired",
    # reconciling workers with the log (controller.recovery)
    "after_spill_reloaded",
    "after_orphans_deleted",
    "after_lost_payloads_evicted",
    "after_checkpoint_rejected",
    "after_step_retrained",
    "after_run_rewound",
    # the loop's admission side
    "after_rollout_admitted",
    "before_group_committed",
    "after_group_committed",
    "before_segments_recorded",
    "after_segments_recorded",
    # episodes: the intent before env calls run, their results after they returned
    "after_env_steps_requested",
    "before_env_steps_completed",
    "after_env_steps_completed",
    "after_episodes_restarted",
    "after_group_failed",
    "after_group_evicted",
    # the loop's train side
    "after_step_begun",
    "after_begin_train_step",
    "before_microbatch_trained",
    "after_microbatch_trained",
    "before_step_finished",
    "after_step_finished",
    "after_step_aborted",
    "before_weights_published",
    "after_weights_published",
    "before_checkpoint_saved",
    "after_checkpoint_saved",
    "before_payloads_released",
    "after_payloads_released",
    # a worker died during the run and was restarted
    "after_worker_lost",
)


#: event type -> (the point right after the log acknowledged it, its key); the key may
#: read the state the event was folded into
AFTER_APPEND: Final[dict[type, tuple[str, Callable[[Any, RunState], object]]]] = {
    ev.RunStarted: ("after_run_started", lambda e, s: e.run_id),
    ev.ControllerStarted: ("after_controller_started", lambda e, s: e.epoch),
    ev.RolloutAdmitted: ("after_rollout_admitted", lambda e, s: e.group_id),
    ev.GroupCommitted: ("after_group_committed", lambda e, s: e.group_id),
    ev.SegmentsRecorded: ("after_segments_recorded", lambda e, s: e.group_id),
    ev.EnvStepsRequested: ("after_env_steps_requested", lambda e, s: e.group_id),
    ev.EnvStepsCompleted: ("after_env_steps_completed", lambda e, s: e.group_id),
    ev.EpisodesRestarted: ("after_episodes_restarted", lambda e, s: e.group_id),
    ev.GroupFailed: ("after_group_failed", lambda e, s: e.group_id),
    ev.GroupEvicted: ("after_group_evicted", lambda e, s: e.group_id),
    ev.StepBegun: ("after_step_begun", lambda e, s: e.step),
    ev.MicrobatchTrained: ("after_microbatch_trained", lambda e, s: e.step),
    ev.StepFinished: ("after_step_finished", lambda e, s: e.step),
    ev.StepAborted: ("after_step_aborted", lambda e, s: e.step),
    ev.WeightsPublished: ("after_weights_published", lambda e, s: e.weight_version),
    ev.CheckpointSaved: ("after_checkpoint_saved", lambda e, s: e.trainer_version),
    ev.CheckpointRejected: ("after_checkpoint_rejected", lambda e, s: e.trainer_version),
    # releases follow the newest checkpoint: the version it covers names the release
    ev.PayloadsReleased: ("after_payloads_released", lambda e, s: s.covered_trainer_version()),
    ev.WorkerLost: ("after_worker_lost", lambda e, s: e.worker),
    ev.RunRewound: ("after_run_rewound", lambda e, s: e.to_trainer_version),
}

#: points that follow a whole batch appended for one purpose (keyed by the epoch)
BATCH_POINTS: Final = ("after_log_repaired", "after_lost_payloads_evicted")


def _parse(spec: str) -> dict[str, list[tuple[str | None, str | None]]]:
    armed: dict[str, list[tuple[str | None, str | None]]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        item, _, worker = item.partition("@")
        name, _, key = item.partition(":")
        if name not in CRASH_POINTS:
            raise ValueError(
                f"{ENV_VAR}: unknown crash point {name!r}; known: {', '.join(CRASH_POINTS)}"
            )
        armed.setdefault(name, []).append((key or None, worker or None))
    return armed


_armed = _parse(os.environ.get(ENV_VAR, ""))
_killer: Callable[[str], None] | None = None


def rearm(spec: str) -> None:
    """Re-read the spec (tests that arm crash points in-process)."""
    global _armed
    _armed = _parse(spec)


def set_worker_killer(kill: Callable[[str], None] | None) -> None:
    """How ``name@worker`` kills a worker by name (registered by the wiring)."""
    global _killer
    _killer = kill


def crash_point(name: str, key: object = None) -> None:
    """Exit the process abruptly if ``name`` (with ``key``) is armed.

    An entry armed as ``name[:key]@worker`` kills that worker instead (once), and the
    controller goes on -- to notice the death at its next call to the worker.
    """
    if not _armed:
        return
    entries = _armed.get(name)
    if entries is None:
        if name not in CRASH_POINTS:
            raise ValueError(f"crash_point({name!r}) is not a declared crash point")
        return
    for entry in list(entries):
        want, worker = entry
        if want is not None and want != str(key):
            continue
        if worker is not None:
            entries.remove(entry)
            if _killer is None:
                raise RuntimeError(f"{ENV_VAR}: {name}@{worker} armed but no worker killer set")
            sys.stderr.write(f"[rl-controller] crash point {name}:{key}: killing {worker}\n")
            _killer(worker)
            continue
        sys.stderr.write(f"[rl-controller] crash point {name}:{key} reached; exiting\n")
        sys.stderr.flush()
        os._exit(EXIT_CODE)


def after_append(events: Sequence[ev.Event], state: RunState, epoch: int, batch: str | None) -> None:
    """The points of an acknowledged batch: each event's, in order, then the batch's."""
    if batch is not None and batch not in BATCH_POINTS:
        raise ValueError(f"{batch!r} is not a batch point; known: {', '.join(BATCH_POINTS)}")
    if not _armed:
        return
    # A pause's one append reaches the points of every event it stands for, in order
    # (model turn recorded, intent recorded, results recorded): one append, one crash
    # window, where the separate events had one each.
    for event in expanded(events):
        point = AFTER_APPEND.get(type(event))
        if point is not None:
            crash_point(point[0], point[1](event, state))
    if batch is not None:
        crash_point(batch, epoch)
