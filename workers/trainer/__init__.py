"""The trainer: split-API train steps over data-parallel ranks.

``api`` holds the contract (``Trainer`` protocol, ``StepResult``, errors), ``config`` the
typed configs and model factories, ``rank`` the train step every backend runs
(``RankTrainer``), ``parallel`` what a backend supplies to it (placement, reduction,
checkpoint format), ``torch_backend`` / ``fsdp2_backend`` / ``megatron_backend`` those
backends, ``actor`` the thin Ray shell and the driver that fans calls out to every rank.
The loss itself lives in ``workers.loss``.

The names below are imported on first use, so that importing a torch-free
submodule (the ``config`` the controller's ``Config`` composes) does not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.lazy import lazy_exports

if TYPE_CHECKING:
    from workers.loss import Aggregation, MetricKind, OldPolicy, StepLoss
    from workers.trainer.api import (
        CheckpointInfo,
        MicrobatchResult,
        NonFiniteGradientError,
        StepPhase,
        StepResult,
        Trainer,
        TrainStepStateError,
    )
    from workers.trainer.checkpoint import CheckpointCorruptError, CheckpointError
    from workers.trainer.config import (
        BuiltModelFactory,
        OptimizerConfig,
        SchedulerConfig,
        TinyModelFactory,
        TrainerRuntime,
    )
    from workers.trainer.rank import RankTrainer
    from workers.trainer.torch_backend import TorchTrainer

#: public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "Aggregation": "workers.loss",
    "BuiltModelFactory": "workers.trainer.config",
    "CheckpointCorruptError": "workers.trainer.checkpoint",
    "CheckpointError": "workers.trainer.checkpoint",
    "CheckpointInfo": "workers.trainer.api",
    "MetricKind": "workers.loss",
    "MicrobatchResult": "workers.trainer.api",
    "NonFiniteGradientError": "workers.trainer.api",
    "OldPolicy": "workers.loss",
    "OptimizerConfig": "workers.trainer.config",
    "RankTrainer": "workers.trainer.rank",
    "SchedulerConfig": "workers.trainer.config",
    "StepLoss": "workers.loss",
    "StepPhase": "workers.trainer.api",
    "StepResult": "workers.trainer.api",
    "TinyModelFactory": "workers.trainer.config",
    "TorchTrainer": "workers.trainer.torch_backend",
    "TrainStepStateError": "workers.trainer.api",
    "Trainer": "workers.trainer.api",
    "TrainerRuntime": "workers.trainer.config",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
