"""Torch backend of the trainer split API: any causal LM ``nn.Module``, replicated data
parallel. The step is :class:`~workers.trainer.rank.RankTrainer`'s; this module is the
parallelism applied to it (``parallelize_torch``): a seeded model broadcast from rank 0,
the replicated placement, the flat all-reduce below, and the file checkpoint.

Gradient reduction: an explicit flat all-reduce at ``finish_train_step``, not DDP.

* The split API does not know which microbatch is the last one until ``finish`` is
  called, so DDP could not overlap its reduction with the last backward anyway: it
  would have to run every microbatch under ``no_sync`` and then trigger the reduction
  with an extra (dummy) forward/backward outside it. The flat all-reduce does the same
  single reduction without that extra pass.
* DDP averages (divides by world size) inside backward hooks; our normaliser is the
  *global* token/sequence count known only at finish. Summing raw gradients once and
  dividing by N once is exactly the math, with no hooks to restore after a failure.
* No collective ever runs inside a microbatch, so ranks may run different numbers of
  microbatches; zero-weight dummies (``train_microbatch(None)``) only keep every rank's
  call sequence aligned with the driver's and cost nothing (no forward). A backend whose
  forward contains collectives (FSDP, tensor parallel) would have to run a real
  forward/backward on a one-token batch with its loss multiplied by 0 instead.
* Every trainable parameter gets a gradient (zeros if it took no part), so the buffer
  layout is identical on all ranks and the optimizer treats all parameters the same at
  any world size.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from workers.trainer import distributed as dd
from workers.trainer.checkpoint import FileCheckpoint
from workers.trainer.config import ModelFactory, TrainerRuntime, TrainSection
from workers.trainer.metrics import StepStats
from workers.trainer.parallel import (
    REPLICATED,
    Parallelized,
    clip_global_norm,
    filled_grads,
    make_optimizer,
)
from workers.trainer.rank import RankTrainer
from workers.trainer.tensors import digest_parameters, model_logits

__all__ = ["FlatAllReduce", "TorchTrainer", "digest_parameters", "model_logits", "parallelize_torch"]


class FlatAllReduce:
    """Raw gradient sums accumulate locally; ``reduce`` all-reduces them once, flat."""

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
                 bucket_bytes: int) -> None:
        self.params, self.optimizer, self.bucket_bytes = params, optimizer, bucket_bytes

    def begin(self) -> None:
        pass

    def microbatch(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def backward(self, loss_sum: torch.Tensor) -> None:
        loss_sum.backward()

    def reduce(self, n: int, total: StepStats, zero_weight_pass: Callable[[], None]) -> None:
        grads = filled_grads(self.params)
        dd.all_reduce_sum_flat_(grads, self.bucket_bytes)
        torch._foreach_div_(grads, float(n))

    def clip(self, max_norm: float | None) -> float:
        return clip_global_norm(self.params, max_norm)

    def step(self) -> None:
        self.optimizer.step()

    def release(self) -> None:
        pass  # the skeleton drops the optimizer's gradients; nothing else was touched


def parallelize_torch(
    model_factory: ModelFactory, train: TrainSection, runtime: TrainerRuntime, device: torch.device
) -> Parallelized:
    """Every rank: the seeded model, rank 0's weights broadcast, a deep-copied reference."""
    torch.manual_seed(runtime.seed)
    model = model_factory().to(device=device, dtype=runtime.torch_dtype)
    model.eval()  # dropout off: determinism
    dd.broadcast_module_(model)
    reference = copy.deepcopy(model).requires_grad_(False) if runtime.keep_reference else None
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = make_optimizer(train, runtime, params)
    return Parallelized(
        backend="torch",
        model=model,
        forward=model,
        reference=reference,
        optimizer=optimizer,
        scheduler=scheduler,
        placement=REPLICATED,
        reduction=FlatAllReduce(params, optimizer, runtime.reduce_bucket_mb << 20),
        checkpoint=FileCheckpoint(),
    )


def TorchTrainer(  # noqa: N802
    model_factory: ModelFactory,
    train: TrainSection | None = None,
    runtime: TrainerRuntime | None = None,
) -> RankTrainer:
    """One rank of the torch backend (a constructor: the trainer class is ``RankTrainer``)."""
    return RankTrainer(model_factory, train, runtime, parallelize_torch)
