"""Typed configuration of the torch trainer, and picklable model factories.

A model factory is any zero-argument callable returning the policy ``nn.Module``
(called once per rank under the trainer's seed); it must be picklable to reach Ray
actors, hence small frozen dataclasses rather than lambdas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

from workers.models.tiny import TinyCausalLM, TinyConfig

if TYPE_CHECKING:
    import torch

    from workers.models.factory import ModelConfig

#: builds the policy; called once per rank under the trainer's seed
ModelFactory = Callable[[], nn.Module]


@dataclass(frozen=True)
class TinyModelFactory:
    """Picklable factory for the built-in tiny transformer."""

    config: TinyConfig

    def __call__(self) -> nn.Module:
        return TinyCausalLM(self.config)


@dataclass(frozen=True)
class BuiltModelFactory:
    """Picklable factory for ``workers.models.factory.build_model`` (tiny or local HF)."""

    config: "ModelConfig"

    def __call__(self) -> nn.Module:
        from workers.models.factory import build_model

        return build_model(self.config)[0]


@dataclass(frozen=True)
class OptimizerConfig:
    kind: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    #: SGD only
    momentum: float = 0.0


@dataclass(frozen=True)
class SchedulerConfig:
    #: linear warmup from lr/warmup_steps to lr over this many steps
    warmup_steps: int = 0
    #: shape after warmup
    kind: Literal["constant", "linear", "cosine"] = "constant"
    #: step at which linear/cosine decay reaches min_lr_ratio (required for them)
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind != "constant" and not self.total_steps:
            raise ValueError(f"SchedulerConfig.total_steps is required for kind={self.kind!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"SchedulerConfig.warmup_steps = {self.warmup_steps}; must be >= 0")


@dataclass(frozen=True)
class TrainerConfig:
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    #: clip the global gradient L2 norm to this; None = no clipping (norm still reported)
    max_grad_norm: float | None = 1.0
    seed: int = 0
    #: "cpu", "cuda" or "cuda:<i>"; None = the current CUDA device if any, else CPU
    device: str | None = None
    #: torch intra-op threads (process-wide); fix it for cross-process bitwise determinism
    num_threads: int | None = None
    #: torch.use_deterministic_algorithms (process-wide)
    deterministic: bool = True
    #: keep a frozen copy of the initial weights as the KL reference model
    keep_reference: bool = False
    #: compute weights_digest() in every StepResult
    digest_on_finish: bool = True
    #: flat gradient all-reduce bucket size
    reduce_bucket_mb: int = 256
    #: cast the model's parameters (so gradients and optimizer state) to this dtype;
    #: None keeps the factory's. float64 is for exactness checks: split-vs-one-shot
    #: differences are then rounding at ~1e-16, which Adam's g / (|g| + eps) cannot
    #: magnify past 1e-12 (in float32 it can, by up to lr per step: see the tests)
    dtype: Literal["float32", "float64"] | None = None

    @property
    def torch_dtype(self) -> "torch.dtype | None":
        import torch

        return None if self.dtype is None else getattr(torch, self.dtype)


class LrSchedule:
    """LR multiplier per scheduler step (a plain object so LambdaLR can save its state)."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.warmup = cfg.warmup_steps
        self.kind = cfg.kind
        self.total = cfg.total_steps or 0
        self.min_ratio = cfg.min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        frac = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        shape = 1.0 - frac if self.kind == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
        return self.min_ratio + (1.0 - self.min_ratio) * shape


class ManualLr:
    """LambdaLR's arithmetic for optimizers that are not ``torch.optim.Optimizer``."""

    def __init__(self, optimizer: Any, base_lr: float, schedule: LrSchedule) -> None:
        self.optimizer, self.base_lr, self.schedule = optimizer, base_lr, schedule
        self.last_epoch = 0
        self._apply()

    def _apply(self) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = self.base_lr * self.schedule(self.last_epoch)

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        self._apply()
