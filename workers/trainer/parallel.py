"""What a trainer backend supplies: parallelism applied as functions to one train step.

The train step itself -- state machine, normaliser, clip, optimizer step, digest,
one-shot ``train()`` -- is written once, in :class:`workers.trainer.rank.RankTrainer`.
A backend is a function (``Parallelize``) that builds the rank's model under the
backend's parallelism and returns a :class:`Parallelized`: the modules and optimizer
it built, plus three small strategies the step calls at fixed points::

    Placement        where the weights live: how full weights are read (digest,
                     export), whether a forward is itself a collective, how many
                     ranks train the same rows
    Reduction        how the step's raw gradient sums become the update's gradient:
                     begin / per-microbatch context / backward / reduce + 1/N / clip
                     / optimizer step / release
    CheckpointFormat how the rank's state is written and read back

The backends (``torch_backend``, ``fsdp2_backend``, ``megatron_backend``) hold no
train-step logic and no backend inherits another: the replicated placement and the
file checkpoint are shared values, not base classes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from workers.trainer.config import LrSchedule, ModelFactory, TrainerRuntime, TrainSection
from workers.trainer.metrics import StepStats
from workers.trainer.tensors import digest_parameters

__all__ = [
    "CheckpointFormat",
    "CheckpointParts",
    "Parallelize",
    "Parallelized",
    "Placement",
    "REPLICATED",
    "Reduction",
    "Restored",
    "clip_global_norm",
    "filled_grads",
    "make_optimizer",
]


class Placement(Protocol):
    """Where a rank's weights live, and what reading them costs."""

    #: a forward issues collectives (sharded parameters are all-gathered): zero-weight
    #: dummies and the reference model's forward must then run on every rank alike
    collective_forward: bool
    #: ranks that train the same rows (tensor-parallel ranks of one dp index); the
    #: step's counts are taken from one of each
    replicas: int

    def digest(self, module: nn.Module) -> str:
        """sha256 of the full parameters (a collective when they are sharded)."""
        ...

    def export(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full CPU copies of the state dict's tensors (a collective when sharded)."""
        ...


class Reduction(Protocol):
    """The gradient path of one step; called by the skeleton, in this order."""

    def begin(self) -> None:
        """The step opened (gradients already zeroed): prepare the buffers and hooks."""
        ...

    def microbatch(self) -> AbstractContextManager[None]:
        """Context around one microbatch's forward and backward."""
        ...

    def backward(self, loss_sum: torch.Tensor) -> None:
        """Back-propagate the microbatch's raw loss sum (normaliser 1)."""
        ...

    def reduce(self, n: int, total: StepStats, zero_weight_pass: Callable[[], None]) -> None:
        """Exactly one cross-data-parallel reduction of the gradient sums, then divide
        by the global normaliser ``n``. ``zero_weight_pass`` runs a forward/backward
        that adds nothing (for a reduction that rides on a backward)."""
        ...

    def clip(self, max_norm: float | None) -> float:
        """The global gradient L2 norm before clipping; clip to ``max_norm`` if set."""
        ...

    def step(self) -> None:
        """Apply the optimizer to the reduced, clipped gradients."""
        ...

    def release(self) -> None:
        """The step ended (finished, failed or aborted): drop the gradients the
        optimizer does not see and restore what ``begin`` changed. Idempotent."""
        ...


@dataclass(frozen=True)
class CheckpointParts:
    """What a checkpoint format reads from (saving) or restores into (loading)."""

    model: nn.Module
    optimizer: Any
    scheduler: Any
    rank: int
    world_size: int


@dataclass(frozen=True)
class Restored:
    """A loaded checkpoint: its verified manifest, and this rank's RNG states if the
    format kept them for this rank (None: reseed)."""

    meta: Mapping[str, Any]
    sha256: str
    files: Mapping[str, str]
    rng: dict[str, Any] | None


class CheckpointFormat(Protocol):
    """How one backend's state goes to disk and back (a collective over the ranks)."""

    def save(
        self,
        final: Path,
        parts: CheckpointParts,
        rng: dict[str, Any],
        meta: Callable[[], dict[str, Any]],
    ) -> tuple[str, dict[str, str]]:
        """Write durably; returns (sha256 of the manifest, {file: sha256})."""
        ...

    def load(
        self, final: Path, parts: CheckpointParts, accept: Callable[[Mapping[str, Any]], None]
    ) -> Restored:
        """Verify every file, let ``accept`` refuse the manifest's meta, then restore."""
        ...


@dataclass(frozen=True)
class Parallelized:
    """One rank's model under a backend's parallelism, and the backend's strategies."""

    #: "torch", "fsdp2" or "megatron" (``trainer.backend``)
    backend: str
    #: the trained module: its parameters are digested, exported and checkpointed
    model: nn.Module
    #: what a microbatch's forward runs through (a DDP wrapper, or the model itself)
    forward: nn.Module
    #: the frozen KL reference, placed like the model; None without one
    reference: nn.Module | None
    optimizer: Any
    scheduler: Any
    placement: Placement
    reduction: Reduction
    checkpoint: CheckpointFormat


#: a backend: builds one rank (inside its process group) on ``device``
Parallelize = Callable[[ModelFactory, TrainSection, TrainerRuntime, torch.device], Parallelized]


class _Replicated:
    """Every rank holds the full weights: reads are local."""

    collective_forward = False
    replicas = 1

    def digest(self, module: nn.Module) -> str:
        return digest_parameters(module)

    def export(self, module: nn.Module) -> dict[str, torch.Tensor]:
        # tensors only: mcore modules add non-tensor ``_extra_state`` entries
        return {
            k: v.detach().to("cpu", copy=True)
            for k, v in module.state_dict().items()
            if isinstance(v, torch.Tensor)
        }


#: the placement of the torch and megatron backends (replicated data parallel)
REPLICATED: Placement = _Replicated()


def make_optimizer(
    train: TrainSection, runtime: TrainerRuntime, params: list[nn.Parameter]
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The configured torch optimizer over ``params`` and its LR schedule."""
    o, lr, decay = runtime.optimizer, train.lr, train.weight_decay
    optimizer: torch.optim.Optimizer
    if o.kind == "sgd":
        optimizer = torch.optim.SGD(params, lr=lr, momentum=o.momentum, weight_decay=decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=lr, betas=o.betas, eps=o.eps, weight_decay=decay)
    schedule = LrSchedule(runtime.scheduler, train.warmup_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def filled_grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    """Every parameter's gradient, zeros where it took no part (same layout on all ranks)."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def clip_global_norm(params: list[nn.Parameter], max_norm: float | None) -> float:
    """torch's clip over local (replicated) gradients; the norm before clipping."""
    limit = math.inf if max_norm is None else max_norm
    return float(torch.nn.utils.clip_grad_norm_(params, limit))
