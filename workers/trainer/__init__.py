"""The trainer: split-API train steps over data-parallel ranks.

``api`` holds the contract (``Trainer`` protocol, ``StepResult``, errors), ``config`` the
typed configs and model factories, ``torch_backend`` the plain-torch implementation,
``actor`` the thin Ray shell and the driver that fans calls out to every rank. The loss
itself lives in ``workers.loss``.
"""

from workers.loss import Aggregation, LossConfig, MetricKind, OldPolicy
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
    TrainerConfig,
)
from workers.trainer.torch_backend import TorchTrainer

__all__ = [
    "Aggregation",
    "BuiltModelFactory",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "LossConfig",
    "MetricKind",
    "MicrobatchResult",
    "NonFiniteGradientError",
    "OldPolicy",
    "OptimizerConfig",
    "SchedulerConfig",
    "StepPhase",
    "StepResult",
    "TinyModelFactory",
    "TorchTrainer",
    "Trainer",
    "TrainerConfig",
    "TrainStepStateError",
]
