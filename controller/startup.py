"""Opening a run: create it, or take it over (new epoch) and make the log consistent.

New run::   claim epoch 1 -> [RunStarted, ControllerStarted]
Resume::    claim epoch e+1 (fences the previous controller) -> the projector's state
            (newest snapshot + tail)
            -> ControllerStarted -> StepAborted(restart) for an open step
            -> GroupFailed(restart) for every admitted-but-uncommitted group
               (the loop re-admits them as the next attempt)

What the workers hold (trainer weights, data-plane rows) is reconciled separately by
``controller.recovery``; this module only touches the log.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from controller.core import decisions
from controller.core.state import initial_state
from controller.log_writer import LogWriter
from controller.projector import Projector
from events import schema as ev
from events.errors import RunNotFoundError
from events.store import EventStore


class RunExistsError(RuntimeError):
    """A new run was asked for with an id that already has a log."""


def create_run(
    store: EventStore,
    run_id: str,
    *,
    config: dict[str, Any],
    seed: int,
    code_version: str,
    window_versions: int,
    groups_per_step: int,
    samples_per_group: int,
) -> LogWriter:
    # A run whose log is empty was claimed by a start that died before RunStarted
    # landed: nothing happened in it, so it is started afresh (with a newer epoch).
    if store.run_exists(run_id) and store.last_position(run_id) > 0:
        raise RunExistsError(
            f"run {run_id!r} already exists; pass --resume to continue it, "
            "or choose another --run-id"
        )
    epoch = store.claim_epoch(run_id)
    writer = LogWriter(store, run_id, epoch, initial_state())
    writer.append(
        writer.make(
            ev.RunStarted,
            event_id=ev.run_started_id(run_id),
            run_id=run_id,
            config=config,
            seed=seed,
            code_version=code_version,
            window_versions=window_versions,
            groups_per_step=groups_per_step,
            samples_per_group=samples_per_group,
        ),
        _controller_started(writer),
    )
    return writer


def resume_run(store: EventStore, run_id: str) -> LogWriter:
    if not store.run_exists(run_id):
        raise RunNotFoundError(run_id, sorted(r.run_id for r in store.list_runs()))
    # Claim first: from here on the previous controller's appends are refused, so the
    # state folded below cannot move under us.
    epoch = store.claim_epoch(run_id)
    # No forked page readers: this process may already hold Ray's threads.
    state = Projector(store, fork_readers=False).get(run_id).require()
    writer = LogWriter(store, run_id, epoch, state)
    writer.append(_controller_started(writer))
    repair_log(writer, reason="restart")
    return writer


def repair_log(writer: LogWriter, *, reason: str) -> None:
    """Abort the open step and fail in-flight generations (both were in the old process)."""
    events = decisions.log_repair(writer.state, reason, writer.stamp())
    if events:
        writer.append(*events, batch_point="after_log_repaired")


def _controller_started(writer: LogWriter) -> ev.ControllerStarted:
    return writer.make(
        ev.ControllerStarted,
        event_id=ev.controller_started_id(writer.epoch),
        host=socket.gethostname(),
        pid=os.getpid(),
    )
