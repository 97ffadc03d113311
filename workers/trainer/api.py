"""The trainer split API: the contract the controller drives, independent of any backend.

Lifecycle of one rank's train step (``StepPhase``)::

    IDLE --begin_train_step--> OPEN --train_microbatch*--> OPEN --finish_train_step--> IDLE
                                 |                           (trainer_version += 1)
                                 +--an exception in begin/train_microbatch/finish--> FAILED
    OPEN | FAILED --abort_train_step--> IDLE      (weights, optimizer, version untouched)
    IDLE --abort_train_step--> IDLE                (idempotent)

Calling a method in the wrong phase raises :class:`TrainStepStateError` and changes
nothing. A FAILED step accepts only ``abort_train_step``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import torch

from workers.batch import TrainBatch
from workers.loss import Aggregation, MetricKind, OldPolicy, StepLoss

__all__ = [
    "Aggregation",
    "CheckpointInfo",
    "MetricKind",
    "MicrobatchResult",
    "OldPolicy",
    "StepPhase",
    "StepLoss",
    "StepResult",
    "TrainStepStateError",
    "Trainer",
    "LogprobSource",
    "train_one_shot",
]

#: which model :meth:`Trainer.compute_logprobs` runs
LogprobSource = Literal["policy", "reference"]


class TrainStepStateError(RuntimeError):
    """A split-API method was called in a phase that does not allow it."""


class NonFiniteGradientError(FloatingPointError):
    """The step's global gradient norm is inf/nan; no update was applied (abort the step)."""


class StepPhase(Enum):
    """Where a rank is in its train step (diagram in the module docstring)."""

    IDLE = "idle"
    OPEN = "open"
    FAILED = "failed"


@dataclass(frozen=True)
class MicrobatchResult:
    """What one rank trained in one ``train_microbatch`` call (local counts)."""

    #: 0-based position of this microbatch within the step on this rank
    index: int
    num_sequences: int
    num_tokens: int
    #: True for a zero-weight placeholder (``train_microbatch(None)``)
    dummy: bool = False


@dataclass(frozen=True)
class StepResult:
    """Outcome of ``finish_train_step``; identical on every data-parallel rank."""

    step: int
    #: number of finished steps after this one (base version + 1)
    trainer_version: int
    #: normalised metrics (see ``workers.trainer.metrics``)
    metrics: Mapping[str, float]
    #: global gradient L2 norm before clipping
    grad_norm: float
    #: learning rate used for THIS step's update (read before the scheduler advanced)
    lr: float
    #: global valid sequences / tokens of the step (the loss normaliser is one of them)
    num_sequences: int
    num_tokens: int
    #: global count of real (non-dummy) microbatches
    num_microbatches: int
    #: sha256 of the weights after the update (``weights_digest()``); None if disabled
    weights_digest: str | None = None


@dataclass(frozen=True)
class CheckpointInfo:
    """A durable checkpoint: where it is and the sha256 of its manifest."""

    path: str
    trainer_version: int
    step: int | None
    sha256: str
    files: Mapping[str, str] = field(default_factory=dict)


@runtime_checkable
class Trainer(Protocol):
    """One data-parallel rank of a trainer (or a driver fanning out to all ranks)."""

    @property
    def trainer_version(self) -> int: ...

    def begin_train_step(self, step: int, loss_config: StepLoss) -> None: ...

    def train_microbatch(self, batch: TrainBatch | None) -> MicrobatchResult: ...

    def finish_train_step(self) -> StepResult: ...

    def abort_train_step(self) -> None: ...

    def train(
        self, batch: TrainBatch | None, loss_config: StepLoss, *, step: int | None = None
    ) -> StepResult: ...

    def compute_logprobs(
        self, batch: TrainBatch, which: LogprobSource = "policy", *, temperature: float = 1.0
    ) -> torch.Tensor: ...

    def save_checkpoint(self, directory: str | Path) -> CheckpointInfo: ...

    def load_checkpoint(self, directory: str | Path) -> CheckpointInfo: ...

    def weights_digest(self) -> str: ...

    def export_weights(self) -> dict[str, torch.Tensor]: ...

    def close(self) -> None:
        """Free what the trainer started (a group's rank actors); unusable afterwards."""
        ...


def train_one_shot(
    trainer: Trainer, batch: TrainBatch | None, loss_config: StepLoss, step: int | None
) -> StepResult:
    """``Trainer.train`` for any trainer: begin, one microbatch, finish; the step is
    aborted on any exception. ``step`` None = the trainer's version."""
    trainer.begin_train_step(trainer.trainer_version if step is None else step, loss_config)
    try:
        trainer.train_microbatch(batch)
        return trainer.finish_train_step()
    except BaseException:
        trainer.abort_train_step()
        raise
