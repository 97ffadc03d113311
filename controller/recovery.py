"""Bringing the caches (trainer weights, data plane, generator weights) back to the log.

Runs at every controller start, after ``controller.startup`` made the log itself
consistent (open step aborted, in-flight generations failed), and again for one worker
when it dies during a run (``WorkerLost``):

1. Data plane: rows spilled to disk are re-loaded (a full restart empties
   TransferQueue); rows of no committed group (a generator died between writing its
   payload and ``GroupCommitted``) are deleted; a buffered group whose rows are gone
   is evicted (``GroupEvicted``, reason "payload lost") -- never trained on silently.
2. Trainer: if it reports the (trainer_version, weights digest) the log recorded, it
   is kept. Otherwise the newest usable checkpoint <= the log's version is loaded
   (its manifest hash must equal the one ``CheckpointSaved`` recorded; a corrupt one is
   refused with ``CheckpointRejected`` and the one before is tried) and the finished
   steps after it are re-trained exactly as the log recorded them: same groups, same
   microbatch order, advantages from the recorded rewards. Every re-trained step's
   digest must equal its ``StepFinished`` digest -- the run never continues from
   weights the log does not describe (:class:`DigestMismatchError`).
   If a payload those steps need is gone, recovery stops (:class:`PayloadsLostError`)
   unless the user asked for ``--rewind-to-checkpoint``: then the run goes back to the
   newest usable checkpoint and a ``RunRewound`` names every discarded step and group.
3. Payloads a checkpoint now covers (and those of evicted or lost groups) are released
   (``PayloadsReleased``) -- a crash between the delete and the event is repaired here.
4. Generators: the current weights are published (``WeightsPublished``).

Every append goes through the ``Journal`` (which wakes the loop's pumps when recovery
runs inside it); the events are the core's decisions (``controller.core.decisions``),
the side effects shared with the loop are ``controller.effects``, exact re-training is
``controller.retraining``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from controller import effects
from controller.core import decisions
from controller.core.segments import segment_keys
from controller.core.state import CheckpointRecord, RunState
from controller.crashpoints import crash_point
from controller.journal import Journal
from controller.log_writer import LogWriter
from controller.retraining import (
    DigestMismatchError,
    PayloadsLostError,
    RecoveryError,
    checkpoints_on_disk,
    digest_mismatch,
    expected_digest,
    missing_payloads,
    retrain_step,
)
from events import schema as ev
from workers.api import PayloadStore, StartedWorkers, TrainerClient, WorkerLostError

if TYPE_CHECKING:
    from controller.settings import CheckpointSection

__all__ = [
    "DigestMismatchError", "PayloadsLostError", "RecoveryError", "bring_trainer_to_log",
    "reconcile_workers",
]

log = structlog.get_logger("rl_controller.recovery")


# -- the trainer -------------------------------------------------------------------------


def usable_checkpoints(state: RunState, at_most: int) -> list[CheckpointRecord]:
    """Checkpoints recovery may start from, newest first."""
    return [
        ck for ck in reversed(state.checkpoints)
        if not ck.rejected and not ck.lost and ck.trainer_version <= at_most
    ]


async def load_checkpoint(journal: Journal, trainer: TrainerClient, ck: CheckpointRecord) -> bool:
    """Load ``ck`` after checking it against the log; a bad one gets ``CheckpointRejected``."""
    try:
        version, _ = await trainer.load_checkpoint(ck.uri, ck.sha256)
        if version != ck.trainer_version:
            raise RecoveryError(f"holds trainer_version {version}, the log says {ck.trainer_version}")
        return True
    except WorkerLostError:
        raise
    except Exception as err:
        log.warning("checkpoint_rejected", uri=ck.uri, error=str(err))
        at = journal.stamp()
        await journal.append(journal.make(
            ev.CheckpointRejected,
            event_id=ev.checkpoint_rejected_id(ck.trainer_version, at.epoch, at.position),
            trainer_version=ck.trainer_version, uri=ck.uri, reason=str(err)[:500],
        ))
        return False


async def _start_from_initial(trainer: TrainerClient, touched: bool) -> None:
    """Initial weights (version 0): reset unless the trainer is known to be untouched."""
    version, _ = await trainer.version_and_digest()
    if version != 0 or touched:
        await trainer.reset()


async def bring_trainer_to_log(
    journal: Journal,
    trainer: TrainerClient,
    payloads: PayloadStore,
    *,
    rewind: bool = False,
    checkpoint_dir: str | None = None,
) -> None:
    """Step 2 of the module docstring (with ``rewind``: go back instead of failing)."""
    state = journal.state
    target = state.trainer_version
    version, digest = await trainer.version_and_digest()
    if version == target and (target == 0 or digest == expected_digest(state, target)):
        return
    present = set(await payloads.keys())
    touched = False
    for ck in usable_checkpoints(state, target):
        lost = missing_payloads(state, state.steps_after(ck.trainer_version), present)
        if lost:
            break  # an older checkpoint needs these rows too
        touched = True
        if await load_checkpoint(journal, trainer, ck):
            return await _retrain(journal, trainer, ck.trainer_version)
    else:
        lost = missing_payloads(state, state.steps_after(0), present)
        if not lost:
            await _start_from_initial(trainer, touched)
            return await _retrain(journal, trainer, 0)
    if not rewind:
        raise payloads_lost(state, lost)
    await rewind_to_checkpoint(journal, trainer, lost, checkpoint_dir=checkpoint_dir)


async def _retrain(journal: Journal, trainer: TrainerClient, base: int) -> None:
    state = journal.state
    for record in state.steps_after(base):
        got = await retrain_step(trainer, state, record)
        if got != record.weights_digest:
            raise digest_mismatch(record, got)
        log.info("step_retrained", step=record.step, trainer_version=record.trainer_version)
        crash_point("after_step_retrained", record.step)


def payloads_lost(state: RunState, lost_groups: list[str]) -> PayloadsLostError:
    usable, gone = checkpoints_on_disk(state)
    where = ("the initial weights (no usable checkpoint)" if not usable
             else f"the newest usable checkpoint (trainer_version {usable[-1].trainer_version})")
    steps = sorted({state.groups[g].consumed_step for g in lost_groups})
    return PayloadsLostError(
        f"the payload rows of {len(lost_groups)} consumed groups ({', '.join(lost_groups[:5])}"
        f"{', ...' if len(lost_groups) > 5 else ''}; steps {steps}) are gone from the data "
        f"plane and the spill directory, so the weights of trainer_version "
        f"{state.trainer_version} cannot be rebuilt and checked against the log. The run "
        f"stops rather than continue from weights the log does not describe.{_gone(gone)} "
        "To continue "
        f"from {where} and discard the steps "
        "after it -- recorded as RunRewound, shown by 'rl-controller audit' -- resume "
        f"run {state.run_id} with --rewind-to-checkpoint"
    )


def _gone(gone: list[CheckpointRecord]) -> str:
    """A sentence naming the log's checkpoints whose files are gone ("" when none is)."""
    if not gone:
        return ""
    versions = sorted({ck.trainer_version for ck in gone})
    uris = ", ".join(dict.fromkeys(ck.uri for ck in gone))
    if len(versions) == 1:
        return (f" The checkpoint of trainer_version {versions[0]} is missing (its files are "
                f"gone: {uris}).")
    return (f" The checkpoints of trainer_version {', '.join(map(str, versions))} are missing "
            f"(their files are gone: {uris}).")


async def rewind_to_checkpoint(
    journal: Journal,
    trainer: TrainerClient,
    lost_groups: list[str],
    *,
    checkpoint_dir: str | None,
) -> None:
    """Go back to the newest loadable checkpoint; record what was discarded (RunRewound)."""
    state = journal.state
    to = None
    for ck in usable_checkpoints(state, state.trainer_version):
        if await load_checkpoint(journal, trainer, ck):
            to = ck.trainer_version
            break
    if to is None:  # no usable checkpoint: checkpoint the initial weights to name one
        if checkpoint_dir is None:
            raise RecoveryError("rewinding to the initial weights needs a checkpoint directory")
        await trainer.reset()
        await effects.save_checkpoint(journal, trainer, checkpoint_dir, 0)
        to = 0
    reason = f"--rewind-to-checkpoint: payloads of {len(lost_groups)} consumed groups lost"
    at = journal.stamp()
    rewound = decisions.run_rewound(state, to, reason, at)
    evicted = decisions.rewound_evictions(state, to, at)
    await journal.append(rewound, *evicted)
    log.warning("run_rewound", to_trainer_version=to, lost_steps=rewound.lost_steps,
                evicted=[e.group_id for e in evicted])


# -- data plane --------------------------------------------------------------------------


def rows_to_keep(state: RunState) -> set[str]:
    """Keys of every committed group whose rows were not released, and the segment rows
    uncommitted groups recorded (a re-admission resumes from them)."""
    keep = {
        k for g in state.groups.values()
        if g.committed_position is not None and not g.payload_released
        for k in g.payload_keys
    }
    keep.update(segment_keys(state.inflight, state.inflight))
    return keep


async def clean_data_plane(state: RunState, payloads: PayloadStore) -> int:
    """Delete rows with no GroupCommitted (or already released); returns how many."""
    keep = rows_to_keep(state)
    orphans = [k for k in await payloads.keys() if k not in keep]
    if orphans:
        await payloads.delete(orphans)
    return len(orphans)


async def evict_lost_payloads(journal: Journal, present: set[str]) -> int:
    """Buffered groups whose rows are gone cannot be trained on: evict them, on the log."""
    evicted = decisions.lost_payload_evictions(journal.state, present, journal.stamp())
    if evicted:
        await journal.append(*evicted, batch_point="after_lost_payloads_evicted")
    return len(evicted)


def reload_spill(dataplane: object, run_id: str) -> int:
    from workers.dataplane.api import DurableDataPlane  # torch: only once a run recovers

    return dataplane.reload(run_id) if isinstance(dataplane, DurableDataPlane) else 0


# -- the whole procedure -----------------------------------------------------------------


async def reconcile_workers(
    writer: LogWriter,
    workers: StartedWorkers,
    checkpoint: CheckpointSection,
    *,
    checkpoint_dir: str,
    rewind: bool = False,
) -> None:
    """Steps 1-4 of the module docstring, in order (at a start, before the loop)."""
    journal = Journal(writer)
    workers.token.value = writer.epoch  # from here on every worker call carries it
    reloaded = reload_spill(workers.dataplane, writer.run_id)
    crash_point("after_spill_reloaded", writer.epoch)
    removed = await clean_data_plane(writer.state, workers.payloads)
    crash_point("after_orphans_deleted", writer.epoch)
    present = set(await workers.payloads.keys())
    evicted = await evict_lost_payloads(journal, present)
    log.info("data_plane_reconciled", reloaded=reloaded, orphans_deleted=removed,
             evicted_lost=evicted)
    await bring_trainer_to_log(
        journal, workers.trainer, workers.payloads,
        rewind=rewind, checkpoint_dir=checkpoint_dir,
    )
    if checkpoint.retain_payloads == "until_checkpoint":
        await effects.release_covered(
            journal, workers.payloads, writer.state.covered_trainer_version()
        )
    await effects.publish_current(journal, workers.publisher)
