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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from controller.core import policies

from controller.crashpoints import crash_point
from controller.log_writer import LogWriter
from controller.core.segments import segment_keys
from controller.core.state import CheckpointRecord, GroupStatus, RunState, StepRecord
from events import schema as ev
from workers.api import (
    MicrobatchRef,
    PayloadStore,
    TrainerClient,
    WeightPublisher,
    WorkerLostError,
)

if TYPE_CHECKING:
    from controller.step_close import CheckpointSection

log = structlog.get_logger("rl_controller.recovery")

#: groups whose rows must stay in the data plane (a step may still train on them)
_NEEDS_ROWS = (GroupStatus.COMMITTED, GroupStatus.CLAIMED, GroupStatus.CONSUMED)
#: groups whose rows no step will ever need again
_RELEASABLE = (GroupStatus.EVICTED, GroupStatus.LOST)


class RecoveryError(RuntimeError):
    """The workers cannot be brought to the state the log describes."""


class DigestMismatchError(RecoveryError):
    """Re-training a step did not reproduce the weights its StepFinished recorded."""


class PayloadsLostError(RecoveryError):
    """Payload rows that re-training needs are gone from the data plane and the spill."""


# -- re-training -------------------------------------------------------------------------


def expected_digest(state: RunState, version: int) -> str | None:
    step = state.version_steps.get(version)
    return None if step is None else state.steps[step].weights_digest


def microbatch_ref(state: RunState, group_ids) -> MicrobatchRef:
    """A recorded microbatch, rebuilt exactly as the loop built it."""
    keys, advantages, _ = policies.microbatch_advantages(state, group_ids)
    return MicrobatchRef(payload_keys=keys, advantages=advantages)


async def retrain_step(trainer: TrainerClient, state: RunState, record: StepRecord) -> str:
    """Re-run one finished step as the log recorded it; returns the resulting digest."""
    await trainer.begin_train_step(record.step)
    try:
        for group_ids in record.microbatches:
            await trainer.train_microbatch(microbatch_ref(state, group_ids))
        outcome = await trainer.finish_train_step()
    except BaseException:
        await trainer.abort_train_step()
        raise
    return outcome.weights_digest


def steps_after(state: RunState, version: int) -> list[StepRecord]:
    """Finished, not-lost steps producing versions version+1 .. trainer_version, in order."""
    return [
        state.steps[state.version_steps[v]]
        for v in range(version + 1, state.trainer_version + 1)
    ]


def digest_mismatch(record: StepRecord, got: str) -> DigestMismatchError:
    return DigestMismatchError(
        f"re-training step {record.step} gave weights {got[:12]}..., the log recorded "
        f"{(record.weights_digest or '?')[:12]}... at trainer_version "
        f"{record.trainer_version}; refusing to continue from weights the log does "
        "not describe"
    )


def missing_payloads(state: RunState, records: list[StepRecord], present: set[str]) -> list[str]:
    """Group ids of ``records`` with at least one payload row not in ``present``."""
    return [
        gid for r in records for gid in r.group_ids
        if any(k not in present for k in state.groups[gid].payload_keys)
    ]


def usable_checkpoints(state: RunState, at_most: int) -> list[CheckpointRecord]:
    """Checkpoints recovery may start from, newest first."""
    return [
        ck for ck in reversed(state.checkpoints)
        if not ck.rejected and not ck.lost and ck.trainer_version <= at_most
    ]


async def load_checkpoint(writer: LogWriter, trainer: TrainerClient, ck: CheckpointRecord) -> bool:
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
        writer.append(writer.make(
            ev.CheckpointRejected,
            event_id=f"checkpoint:{ck.trainer_version}:rejected:e{writer.epoch}:p{writer.position}",
            trainer_version=ck.trainer_version, uri=ck.uri, reason=str(err)[:500],
        ))
        crash_point("after_checkpoint_rejected", ck.trainer_version)
        return False


async def _start_from_initial(trainer: TrainerClient, touched: bool) -> None:
    """Initial weights (version 0): reset unless the trainer is known to be untouched."""
    version, _ = await trainer.version_and_digest()
    if version != 0 or touched:
        await trainer.reset()


async def bring_trainer_to_log(
    writer: LogWriter,
    trainer: TrainerClient,
    payloads: PayloadStore,
    *,
    rewind: bool = False,
    checkpoint_dir: str | None = None,
) -> None:
    """Step 2 of the module docstring (with ``rewind``: go back instead of failing)."""
    state = writer.state
    target = state.trainer_version
    version, digest = await trainer.version_and_digest()
    if version == target and (target == 0 or digest == expected_digest(state, target)):
        return
    present = set(await payloads.keys())
    touched = False
    for ck in usable_checkpoints(state, target):
        lost = missing_payloads(state, steps_after(state, ck.trainer_version), present)
        if lost:
            break  # an older checkpoint needs these rows too
        touched = True
        if await load_checkpoint(writer, trainer, ck):
            return await _retrain(writer, trainer, ck.trainer_version)
    else:
        lost = missing_payloads(state, steps_after(state, 0), present)
        if not lost:
            await _start_from_initial(trainer, touched)
            return await _retrain(writer, trainer, 0)
    if not rewind:
        raise payloads_lost(state, lost)
    await rewind_to_checkpoint(writer, trainer, lost, checkpoint_dir=checkpoint_dir)


async def _retrain(writer: LogWriter, trainer: TrainerClient, base: int) -> None:
    state = writer.state
    for record in steps_after(state, base):
        got = await retrain_step(trainer, state, record)
        if got != record.weights_digest:
            raise digest_mismatch(record, got)
        log.info("step_retrained", step=record.step, trainer_version=record.trainer_version)
        crash_point("after_step_retrained", record.step)


def payloads_lost(state: RunState, lost_groups: list[str]) -> PayloadsLostError:
    newest = state.latest_checkpoint()
    where = ("the initial weights (no usable checkpoint)" if newest is None
             else f"the newest usable checkpoint (trainer_version {newest.trainer_version})")
    steps = sorted({state.groups[g].consumed_step for g in lost_groups})
    return PayloadsLostError(
        f"the payload rows of {len(lost_groups)} consumed groups ({', '.join(lost_groups[:5])}"
        f"{', ...' if len(lost_groups) > 5 else ''}; steps {steps}) are gone from the data "
        f"plane and the spill directory, so the weights of trainer_version "
        f"{state.trainer_version} cannot be rebuilt and checked against the log. The run "
        "stops rather than continue from weights the log does not describe. To continue "
        f"from {where} and discard the steps "
        "after it -- recorded as RunRewound, shown by 'rl-controller audit' -- run "
        f"'rl-controller run --resume --run-id {state.run_id} --rewind-to-checkpoint'."
    )


async def rewind_to_checkpoint(
    writer: LogWriter,
    trainer: TrainerClient,
    lost_groups: list[str],
    *,
    checkpoint_dir: str | None,
) -> None:
    """Go back to the newest loadable checkpoint; record what was discarded (RunRewound)."""
    state = writer.state
    to = None
    for ck in usable_checkpoints(state, state.trainer_version):
        if await load_checkpoint(writer, trainer, ck):
            to = ck.trainer_version
            break
    if to is None:
        to = await _checkpoint_initial(writer, trainer, checkpoint_dir)
    lost_steps = [state.version_steps[v] for v in range(to + 1, state.trainer_version + 1)]
    lost_ids = [g for s in lost_steps for g in state.steps[s].group_ids]
    writer.append(writer.make(
        ev.RunRewound,
        event_id=f"run:rewound:e{writer.epoch}:p{writer.position}",
        to_trainer_version=to,
        lost_steps=lost_steps,
        lost_group_ids=lost_ids,
        reason=f"--rewind-to-checkpoint: payloads of {len(lost_groups)} consumed groups lost",
    ))
    log.warning("run_rewound", to_trainer_version=to, lost_steps=lost_steps)
    crash_point("after_run_rewound", to)


async def _checkpoint_initial(writer: LogWriter, trainer: TrainerClient, directory: str | None) -> int:
    """No usable checkpoint: checkpoint the initial weights so RunRewound can name one."""
    if directory is None:
        raise RecoveryError("rewinding to the initial weights needs a checkpoint directory")
    await trainer.reset()
    ck = await trainer.save_checkpoint(f"{directory}/v000000-e{writer.epoch}")
    writer.append(writer.make(
        ev.CheckpointSaved,
        event_id=f"checkpoint:0:saved:e{writer.epoch}",
        trainer_version=ck.trainer_version, uri=ck.uri, sha256=ck.sha256,
    ))
    return 0


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


def evict_lost_payloads(writer: LogWriter, present: set[str]) -> list[str]:
    """Buffered groups whose rows are gone cannot be trained on: evict them, on the log."""
    state = writer.state
    gone = [
        g.group_id for g in state.iter_buffer()
        if any(k not in present for k in g.payload_keys)
    ]
    if gone:
        writer.append(*(
            writer.make(
                ev.GroupEvicted,
                event_id=ev.group_event_id(gid, "evicted"),
                group_id=gid,
                reason="payload lost (data plane and spill)",
                lag=state.lag_of(state.groups[gid]) or 0,
            )
            for gid in gone
        ))
        crash_point("after_lost_payloads_evicted", writer.epoch)
    return gone


async def release_covered(writer: LogWriter, payloads: PayloadStore, version: int) -> None:
    """Delete rows of consumed groups a checkpoint of ``version`` covers, then record it.

    Evicted and lost groups' rows go too (no step needs them). Delete first, fact after:
    a crash in between leaves rows already gone and no event -- the next start repeats
    the (idempotent) delete and writes the event.
    """
    state = writer.state
    groups = [
        g for g in state.groups.values()
        if not g.payload_released and g.payload_keys and (
            g.status in _RELEASABLE
            or (g.status is GroupStatus.CONSUMED
                and state.steps[g.consumed_step].trainer_version <= version)
        )
    ]
    if not groups:
        return
    await payloads.delete([k for g in groups for k in g.payload_keys])
    crash_point("before_payloads_released", version)
    writer.append(writer.make(
        ev.PayloadsReleased,
        event_id=f"payloads:released:v{version}:e{writer.epoch}:p{writer.position}",
        group_ids=[g.group_id for g in groups],
    ))
    crash_point("after_payloads_released", version)


# -- generators --------------------------------------------------------------------------


async def publish_current(
    writer: LogWriter, publisher: WeightPublisher, only: list[str] | None = None
) -> None:
    version = writer.state.trainer_version
    crash_point("before_weights_published", version)
    acked = await (publisher.publish(version) if only is None else publisher.publish(version, only))
    writer.append(writer.make(
        ev.WeightsPublished,
        event_id=f"weights:{version}:published:e{writer.epoch}:p{writer.position}",
        weight_version=version,
        generators=acked,
    ))
    crash_point("after_weights_published", version)


# -- the whole procedure -----------------------------------------------------------------


def reload_spill(dataplane: object, run_id: str) -> int:
    reload = getattr(dataplane, "reload", None)
    return 0 if reload is None else reload(run_id)


async def reconcile_workers(
    writer: LogWriter,
    workers,
    checkpoint: CheckpointSection,
    *,
    checkpoint_dir: str,
    rewind: bool = False,
) -> None:
    """Steps 1-4 of the module docstring, in order."""
    token = getattr(workers, "token", None)
    if token is not None:  # from here on every worker call carries this epoch
        token.value = writer.epoch
    reloaded = reload_spill(workers.dataplane, writer.run_id)
    crash_point("after_spill_reloaded", writer.epoch)
    removed = await clean_data_plane(writer.state, workers.payloads)
    crash_point("after_orphans_deleted", writer.epoch)
    present = set(await workers.payloads.keys())
    evicted = evict_lost_payloads(writer, present)
    log.info("data_plane_reconciled", reloaded=reloaded, orphans_deleted=removed,
             evicted_lost=len(evicted))
    await bring_trainer_to_log(
        writer, workers.trainer, workers.payloads,
        rewind=rewind, checkpoint_dir=checkpoint_dir,
    )
    if checkpoint.retain_payloads == "until_checkpoint":
        await release_covered(writer, workers.payloads, writer.state.covered_trainer_version())
    await publish_current(writer, workers.publisher)

