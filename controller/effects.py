"""The side effects that close a step, each followed by the fact that records it.

Publishing weights (``WeightsPublished``), saving a checkpoint (``CheckpointSaved``) and
deleting the payload rows a checkpoint covers (``PayloadsReleased``) happen as a step
closes (``controller.step_close``), when a worker comes back (``controller.worker_loss``)
and at every start (``controller.recovery``). Each is written once, here: side effect
first, fact after, through the ``Journal``. The crash points right after each append
are the writer's; the ones before are here.
"""

from __future__ import annotations

from controller.core import decisions
from controller.crashpoints import crash_point
from controller.journal import Journal
from events import schema as ev
from workers.api import CheckpointOutcome, PayloadStore, TrainerClient, WeightPublisher


async def publish_current(
    journal: Journal, publisher: WeightPublisher, only: list[str] | None = None
) -> None:
    """Publish the trainer's current version (to ``only`` those generators, or all)."""
    version = journal.state.trainer_version
    crash_point("before_weights_published", version)
    acked = await (publisher.publish(version) if only is None else publisher.publish(version, only))
    at = journal.stamp()
    await journal.append(journal.make(
        ev.WeightsPublished,
        event_id=ev.weights_published_id(version, at.epoch, at.position),
        weight_version=version,
        generators=acked,
    ))


async def save_checkpoint(
    journal: Journal, trainer: TrainerClient, directory: str, version: int
) -> None:
    """Checkpoint the trainer's weights (of ``version``) and record it.

    The epoch is in the name: a version may be checkpointed again after a crash between
    the save and its CheckpointSaved, or after a RunRewound.
    """
    crash_point("before_checkpoint_saved", version)
    ck = await trainer.save_checkpoint(checkpoint_path(journal, directory, version))
    await record_checkpoint(journal, version, ck)


def checkpoint_path(journal: Journal, directory: str, version: int) -> str:
    return f"{directory}/v{version:06d}-e{journal.epoch}"


async def record_checkpoint(journal: Journal, version: int, ck: CheckpointOutcome) -> None:
    """``CheckpointSaved`` for a checkpoint the trainer reported durable."""
    await journal.append(journal.make(
        ev.CheckpointSaved,
        event_id=ev.checkpoint_saved_id(version, journal.epoch),
        trainer_version=ck.trainer_version,
        uri=ck.uri,
        sha256=ck.sha256,
    ))


async def release_covered(journal: Journal, payloads: PayloadStore, version: int) -> None:
    """Delete the rows a checkpoint of ``version`` makes unneeded, then record it.

    Delete first, fact after: a crash in between leaves rows already gone and no event --
    the next start repeats the (idempotent) delete and writes the event.
    """
    groups = decisions.releasable(journal.state, version)
    if not groups:
        return
    await payloads.delete([k for g in groups for k in g.payload_keys])
    crash_point("before_payloads_released", version)
    await journal.append(decisions.payloads_released(groups, version, journal.stamp()))
