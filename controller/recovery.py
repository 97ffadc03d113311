"""Bringing the caches (trainer weights, data plane, generator weights) back to the log.

Runs at every controller start, after ``controller.startup`` made the log itself
consistent (open step aborted, in-flight generations failed):

1. Data plane: rows spilled to disk are re-loaded (a full restart empties
   TransferQueue); rows of no committed group (a generator died between writing its
   payload and ``GroupCommitted``) are deleted.
2. Trainer: if it reports the (trainer_version, weights digest) the log recorded, it
   is kept. Otherwise the newest usable checkpoint <= the log's version is loaded
   (a corrupt one is refused with ``CheckpointRejected`` and the one before is tried)
   and the finished steps after it are re-trained exactly as the log recorded them:
   same groups, same microbatch order, advantages from the recorded rewards. Every
   re-trained step's digest must equal its ``StepFinished`` digest -- the run never
   continues from weights the log does not describe.
3. Generators: the current weights are published (``WeightsPublished``).
"""

from __future__ import annotations

import structlog

from controller import policies
from controller.clients import MicrobatchRef, PayloadStore, TrainerClient, WeightPublisher
from controller.log_writer import LogWriter
from controller.state import GroupStatus, RunState, StepRecord
from events import schema as ev

log = structlog.get_logger("rl_controller.recovery")

_HAS_PAYLOAD = (GroupStatus.COMMITTED, GroupStatus.CLAIMED, GroupStatus.CONSUMED)


class RecoveryError(RuntimeError):
    """The workers cannot be brought to the state the log describes."""


class DigestMismatchError(RecoveryError):
    pass


def expected_digest(state: RunState, version: int) -> str | None:
    step = state.version_steps.get(version)
    return None if step is None else state.steps[step].weights_digest


def microbatch_ref(state: RunState, group_ids) -> MicrobatchRef:
    keys: list[str] = []
    advantages: list[float] = []
    for gid in group_ids:
        group = state.groups[gid]
        keys.extend(group.payload_keys)
        advantages.extend(policies.group_advantages(list(group.rewards))[0])
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


async def bring_trainer_to_log(writer: LogWriter, trainer: TrainerClient) -> None:
    state = writer.state
    target = state.trainer_version
    version, digest = await trainer.version_and_digest()
    if version == target and digest == (expected_digest(state, target) or digest):
        return
    base = 0
    for ck in reversed(state.checkpoints):
        if ck.rejected or ck.lost or ck.trainer_version > target:
            continue
        try:
            base, _ = await trainer.load_checkpoint(ck.uri)
            break
        except Exception as err:
            log.warning("checkpoint_rejected", uri=ck.uri, error=str(err))
            writer.append(writer.make(
                ev.CheckpointRejected,
                event_id=f"checkpoint:{ck.trainer_version}:rejected:e{writer.epoch}",
                trainer_version=ck.trainer_version, uri=ck.uri, reason=str(err)[:500],
            ))
    else:
        if version != 0:
            raise RecoveryError(
                f"trainer is at version {version} but the log has no usable checkpoint "
                f"to rebuild version {target} from; restart the trainer from initial weights"
            )
    for record in steps_after(state, base):
        got = await retrain_step(trainer, state, record)
        if got != record.weights_digest:
            raise DigestMismatchError(
                f"re-training step {record.step} gave weights {got[:12]}..., the log recorded "
                f"{(record.weights_digest or '?')[:12]}... at trainer_version "
                f"{record.trainer_version}; refusing to continue from weights the log does "
                "not describe"
            )
        log.info("step_retrained", step=record.step, trainer_version=record.trainer_version)


async def clean_data_plane(state: RunState, payloads: PayloadStore) -> int:
    keep = {k for g in state.groups.values() if g.status in _HAS_PAYLOAD for k in g.payload_keys}
    orphans = [k for k in await payloads.keys() if k not in keep]
    if orphans:
        await payloads.delete(orphans)
    return len(orphans)


async def publish_current(writer: LogWriter, publisher: WeightPublisher) -> None:
    version = writer.state.trainer_version
    acked = await publisher.publish(version)
    writer.append(writer.make(
        ev.WeightsPublished,
        event_id=f"weights:{version}:published:e{writer.epoch}",
        weight_version=version,
        generators=acked,
    ))


async def reconcile_workers(writer: LogWriter, workers, settings) -> None:
    """Steps 1-3 of the module docstring, in order."""
    reload = getattr(workers.dataplane, "reload", None)
    if reload is not None:
        reload(writer.run_id)
    removed = await clean_data_plane(writer.state, workers.payloads)
    if removed:
        log.info("orphan_rows_deleted", count=removed)
    await bring_trainer_to_log(writer, workers.trainer)
    await publish_current(writer, workers.publisher)
