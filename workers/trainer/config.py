"""Typed configuration of the trainer, and picklable model factories.

``TrainSection`` is the ``[train]`` table of a run's config (its ``[train.loss]`` table
is ``workers.loss.LossOptions``): the controller's ``Config`` composes it and hands it,
unchanged, to the trainer worker, and every trainer rank takes it as it is, with a
:class:`TrainerRuntime` beside it for what the table does not say (seed, device,
dtype, optimizer kind). This module imports no torch, so loading a config stays cheap.

A model factory is any zero-argument callable returning the policy ``nn.Module``
(called once per rank under the trainer's seed); it must be picklable to reach Ray
actors, hence small frozen dataclasses rather than lambdas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from events.config_checks import non_negative, positive
from workers.loss.config import LossOptions

if TYPE_CHECKING:
    import torch
    from torch import nn

    from workers.models.config import ModelSection
    from workers.models.tiny import TinyConfig

#: torch: replicated ranks, one flat all-reduce; megatron: megatron-core DDP; fsdp2:
#: fully_shard over a (data_parallel, tensor_parallel) mesh (``workers.backends``)
TrainerBackend = Literal["torch", "megatron", "fsdp2"]

#: builds the policy; called once per rank under the trainer's seed
ModelFactory = Callable[[], "nn.Module"]


@dataclass(frozen=True)
class TinyModelFactory:
    """Picklable factory for the built-in tiny transformer."""

    config: "TinyConfig"

    def __call__(self) -> nn.Module:
        from workers.models.tiny import TinyCausalLM

        return TinyCausalLM(self.config)


@dataclass(frozen=True)
class BuiltModelFactory:
    """Picklable factory for ``workers.models.factory.build_model`` (tiny or local HF)."""

    model: "ModelSection"
    #: the run's seed (the tiny model's initial weights)
    seed: int = 0

    def __call__(self) -> nn.Module:
        from workers.models.factory import build_model

        return build_model(self.model, self.seed)[0]


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer's kind and constants; its learning rate and weight decay are
    ``train.lr`` and ``train.weight_decay``."""

    kind: Literal["adamw", "sgd"] = "adamw"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    #: SGD only
    momentum: float = 0.0


@dataclass(frozen=True)
class SchedulerConfig:
    """The learning rate's shape after the warmup (``train.warmup_steps``)."""

    kind: Literal["constant", "linear", "cosine"] = "constant"
    #: step at which linear/cosine decay reaches min_lr_ratio (required for them)
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind != "constant" and not self.total_steps:
            raise ValueError(f"SchedulerConfig.total_steps is required for kind={self.kind!r}")


@dataclass(frozen=True)
class TrainerRuntime:
    """What a trainer rank runs with beside the user's ``[train]`` table: the run's own
    values (seed, device, threads, dtype, whether a KL reference is kept) and the knobs
    no config key sets (optimizer kind and constants, schedule shape), which tests and
    benchmarks choose. No field repeats one of ``TrainSection``'s."""

    #: the run's seed: initial weights and every rank's dropout stream
    seed: int = 0
    #: "cpu", "cuda" or "cuda:<i>"; None = the current CUDA device if any, else CPU
    device: str | None = None
    #: torch intra-op threads (process-wide); fix it for cross-process bitwise determinism
    num_threads: int | None = None
    #: torch.use_deterministic_algorithms (process-wide)
    deterministic: bool = True
    #: keep a frozen copy of the initial weights as the KL reference model (a run keeps
    #: one when ``train.loss.kl_coef`` > 0)
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
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @property
    def torch_dtype(self) -> "torch.dtype | None":
        import torch

        return None if self.dtype is None else getattr(torch, self.dtype)


class LrSchedule:
    """LR multiplier per scheduler step (a plain object so LambdaLR can save its state)."""

    def __init__(self, cfg: SchedulerConfig, warmup_steps: int) -> None:
        self.warmup = warmup_steps
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


class TrainSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[train]``: the trainer worker and its optimizer."""

    backend: TrainerBackend = "torch"
    """torch: replicated ranks, one flat all-reduce; megatron: mcore DDP; fsdp2:
    fully_shard over a (data_parallel, tensor_parallel) mesh (docs/backends.md)."""
    groups_per_step: int = 16
    groups_per_microbatch: int = 8
    lr: float = 3e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this; 0 = no clipping (the norm is reported)."""
    warmup_steps: int = 0
    data_parallel: int = 1
    node_resource: str = ""
    """Ray custom resource the trainer's node must offer; empty = any node."""
    tensor_parallel: int = 1
    """Tensor-parallel ranks per data-parallel rank (fsdp2 backend, HF Llama/Qwen2 blocks)."""
    fsdp2_grad_reduce: Literal["gathered", "per_microbatch"] = "per_microbatch"
    """fsdp2: per_microbatch = sharded at every moment, collectives repeated per
    microbatch (their cost vanishes at ~3k tokens per microbatch); gathered =
    parameters all-gathered once per step and gradients reduced once at finish (faster
    with tiny microbatches; full parameters + gradient during the step).
    See docs/backends.md."""
    loss: LossOptions = msgspec.field(default_factory=LossOptions)

    def __post_init__(self) -> None:
        positive(
            "train", self, "groups_per_step", "groups_per_microbatch", "data_parallel",
            "tensor_parallel",
        )
        non_negative("train", self, "lr", "weight_decay", "warmup_steps", "grad_clip")
        if self.tensor_parallel > 1 and self.backend != "fsdp2":
            raise ValueError('train.tensor_parallel > 1 needs train.backend = "fsdp2"')

    def runtime(self, seed: int) -> TrainerRuntime:
        """The run's trainer runtime: seeded by the run, keeping a KL reference model
        when ``train.loss.kl_coef`` > 0."""
        return TrainerRuntime(seed=seed, keep_reference=self.loss.kl_coef > 0)
