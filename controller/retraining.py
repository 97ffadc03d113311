"""Exact re-training: running finished steps again as the log recorded them.

Recovery (``controller.recovery``) rebuilds a trainer's weights this way after loading a
checkpoint, and ``rl-controller replay --retrain`` (``replay.retrain``) does the same to
check a log against its weights. A recorded step is re-run with the same groups in the
same microbatch order, advantages recomputed from the recorded rewards by the one
function the loop used (``policies.microbatch_advantages``); its digest must equal the
one its ``StepFinished`` recorded.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from controller.core import policies
from controller.core.state import CheckpointRecord, RunState, StepRecord
from workers.api import CHECKPOINT_MANIFEST, MicrobatchRef, TrainerClient


class RecoveryError(RuntimeError):
    """The workers cannot be brought to the state the log describes."""


class DigestMismatchError(RecoveryError):
    """Re-training a step did not reproduce the weights its StepFinished recorded."""


class PayloadsLostError(RecoveryError):
    """Payload rows that re-training needs are gone from the data plane and the spill."""


def checkpoint_on_disk(ck: CheckpointRecord) -> bool:
    """Whether ``ck``'s files are still there (its manifest): the log says a checkpoint
    was saved, only the disk says it still exists."""
    return (Path(ck.uri) / CHECKPOINT_MANIFEST).is_file()


def checkpoints_on_disk(
    state: RunState,
) -> tuple[list[CheckpointRecord], list[CheckpointRecord]]:
    """The log's usable checkpoints (neither rejected nor rewound past), oldest first:
    (those whose files exist, those whose files are gone)."""
    usable = [ck for ck in state.checkpoints if not ck.rejected and not ck.lost]
    present = [ck for ck in usable if checkpoint_on_disk(ck)]
    return present, [ck for ck in usable if ck not in present]


def expected_digest(state: RunState, version: int) -> str | None:
    step = state.step_for_version(version)
    return None if step is None else step.weights_digest


def microbatch_ref(state: RunState, group_ids: Iterable[str]) -> MicrobatchRef:
    """A recorded microbatch, rebuilt exactly as the loop built it."""
    keys, advantages, _ = policies.microbatch_advantages(state, group_ids)
    versions = policies.microbatch_versions(state, group_ids)
    return MicrobatchRef(payload_keys=keys, advantages=advantages, versions=versions,
                         turn_advantages=policies.microbatch_turn_advantages(state, group_ids))


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
