"""Megatron-core backend of the trainer split API: mcore ``DistributedDataParallel``.

Same contract, state machine, metrics, logprobs and checkpoint layout as
:class:`~workers.trainer.torch_backend.TorchTrainer` (it is a subclass and reuses all
of that); what differs is the gradient path, through mcore's contiguous gradient
buffers (``param.main_grad``) and its bucketed data-parallel collective::

    begin     zero_grad_buffer; save config.grad_sync_func / no_sync_func, set both None
    micro*    with ddp.no_sync(): forward, loss with normaliser 1, backward
              (grads accumulate into the fp32 buffer; nothing is communicated)
    finish    gather the step's counts -> global N; ddp.scale_gradients(1/N);
              MoE aux grads += aux / (global microbatch count);
              ONE cross-DP reduction: start_grad_sync() only if overlap_grad_reduce,
              then finish_grad_sync() (which, with overlap off, *is* the synchronous
              reduction -- calling both would reduce twice: gradients x world size);
              clip, read the LR, optimizer step, scheduler step; restore the hooks
    abort     wait out any reduction in flight, zero the buffer, restore RNG and hooks

Why the hooks are nulled: mcore schedules and overlapping wrappers read
``config.no_sync_func`` / ``config.grad_sync_func``. The no-pipelining schedule runs
its *last* microbatch outside ``no_sync_func``; with overlap on, that microbatch's
backward hooks count per-parameter "grad ready" events, the counts are kept as the
golden set at the next ``zero_grad_buffer`` and later steps auto-dispatch a reduction
mid-step. The split API decides which microbatch is last only at ``finish``, so during
a step nothing may dispatch a sync but ``finish``; after it (or after any exception)
the caller's hooks are back exactly as they were.

Gradient scaling: the DDP wrapper gets a copy of the model's ``TransformerConfig``
with ``calculate_per_token_loss = True``, which makes mcore's collective a plain SUM
(scaling factor 1); the only division is by the global N, once. The model itself
keeps its own config (its MoE router is unaffected).

MoE auxiliary losses: the router attaches them to activations through
``MoEAuxLossAutoScaler``, whose backward scale mcore sets to 1/num_microbatches before
the step -- unknown here until ``finish``. So each microbatch captures the aux losses
instead, differentiates their sum separately (``autograd.grad``, which does not run the
DDP accumulation hooks) into a side buffer, and ``finish`` adds it scaled by 1/M, M =
the global count of real microbatches, before the one reduction.

Optimizers: on CPU (or with ``use_distributed_optimizer = False``) a torch optimizer
over the parameters, stepping on ``main_grad`` -- megatron's own optimizers cannot be
built without CUDA; this path is numerically the torch backend's. On GPU by default
(AdamW, not float64), megatron's distributed optimizer (``get_megatron_optimizer``:
gradients reduce-scattered, parameters all-gathered after the step).

Models: any causal-LM ``nn.Module`` (``model(input_ids) -> logits``), e.g. the built-in
``TinyCausalLM`` (mcore DDP wraps any module given a ``TransformerConfig``), or
:class:`McoreGPTFactory`, mcore's ``GPTModel`` with the local (non-TransformerEngine)
layer spec, which runs on CPU with ``workers.trainer.megatron_shims``. Tensor and
pipeline parallel size are 1: the data-parallel group is the whole world.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.availability import BackendUnavailableError, check_megatron
from workers.batch import TrainBatch
from workers.loss import LossConfig, Metric, microbatch_loss
from workers.trainer import checkpoint as ckpt
from workers.trainer import distributed as dd
from workers.trainer import megatron_shims as shims
from workers.trainer.api import (
    CheckpointInfo,
    NonFiniteGradientError,
    StepPhase,
    StepResult,
)
from workers.trainer.config import LrSchedule, ManualLr, ModelFactory, TrainerConfig
from workers.trainer.megatron_model import McoreGPTFactory, McoreGPTLM
from workers.trainer.torch_backend import (
    TorchTrainer,
    _OpenStep,
    digest_parameters,
    model_logits,
)


@dataclass(frozen=True)
class MegatronOptions:
    """Knobs of the megatron backend (``trainer.megatron.*``)."""

    #: bucketed async reduction (mcore ``overlap_grad_reduce``); finish then dispatches it
    overlap_grad_reduce: bool = False
    #: megatron's distributed optimizer; None = on when the trainer runs on CUDA
    use_distributed_optimizer: bool | None = None
    #: accumulate and reduce gradients in fp32 whatever the parameter dtype
    grad_reduce_in_fp32: bool = True
    #: elements per bucket with overlap on; None = mcore's default
    bucket_size: int | None = None


def _ddp_transformer_config(module: nn.Module) -> Any:
    """A copy of the module's TransformerConfig (or a minimal one) with SUM reduction."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    own = getattr(module, "config", None)
    if isinstance(own, TransformerConfig):
        cfg = copy.copy(own)
    else:
        cfg = TransformerConfig(num_layers=1, hidden_size=1, num_attention_heads=1)
    cfg.calculate_per_token_loss = True  # gradient_scaling_factor 1: the collective sums
    cfg.grad_sync_func = None
    cfg.no_sync_func = None
    return cfg


@contextlib.contextmanager
def _capture_aux_losses(into: list[torch.Tensor]) -> Iterator[None]:
    """Collect MoE aux losses instead of attaching them to the activations' graph."""
    try:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    except ImportError:  # pragma: no cover - megatron-core without MoE
        yield
        return
    original = MoEAuxLossAutoScaler.apply

    def capture(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        into.append(aux_loss)
        return output

    MoEAuxLossAutoScaler.apply = capture  # type: ignore[method-assign]
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.apply = original  # type: ignore[method-assign]


class _SavedHooks:
    """The DDP config's sync hooks, nulled while a step is open (see module docstring)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self._saved: tuple[Any, Any] | None = None

    def save_and_null(self) -> None:
        self._saved = (self.config.grad_sync_func, self.config.no_sync_func)
        self.config.grad_sync_func = None
        self.config.no_sync_func = None

    def restore(self) -> None:
        """Put the saved hooks back; idempotent."""
        if self._saved is not None:
            self.config.grad_sync_func, self.config.no_sync_func = self._saved
            self._saved = None


def _distributed_optimizer(asked: bool | None, device: torch.device, cfg: TrainerConfig) -> bool:
    """Asked for, or by default on CUDA; megatron-core 0.16 builds it for AdamW on
    float32/bf16/fp16 only (an H100 refused SGD and float64), else an error if asked."""
    unsupported = [f"optimizer {cfg.optimizer.kind!r}"] if cfg.optimizer.kind != "adamw" else []
    unsupported += ["float64 parameters"] if cfg.torch_dtype == torch.float64 else []
    if asked is None:
        return device.type == "cuda" and not unsupported
    if asked and unsupported:
        raise BackendUnavailableError(
            "megatron's distributed optimizer supports AdamW on float32/bf16/fp16 parameters "
            f"only, not {' and '.join(unsupported)}; set use_distributed_optimizer = false"
        )
    return asked


class MegatronTrainer(TorchTrainer):
    """One data-parallel rank over mcore DDP (the default group is the DP group)."""

    def __init__(
        self,
        model_factory: ModelFactory,
        config: TrainerConfig | None = None,
        options: MegatronOptions | None = None,
    ) -> None:
        shims.require_megatron()
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.config = cfg = config or TrainerConfig()
        self.options = opts = options or MegatronOptions()
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        if cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.device = self._resolve_device(cfg.device)
        shims.ensure_parallel_state(cpu=self.device.type == "cpu")
        self.rank, self.world_size = dd.rank_and_world()
        use_dist_opt = _distributed_optimizer(opts.use_distributed_optimizer, self.device, cfg)
        check_megatron(installed=True, cuda=self.device.type == "cuda", require_gpu=use_dist_opt)
        torch.manual_seed(cfg.seed)
        module = model_factory().to(device=self.device, dtype=cfg.torch_dtype)
        module.eval()  # dropout off: determinism
        dd.broadcast_module_(module)
        self._model = module
        self._reference: nn.Module | None = None
        self._reference_digest: str | None = None
        if cfg.keep_reference:
            # a second instance, not deepcopy: mcore modules hold process groups
            reference = model_factory().to(device=self.device, dtype=cfg.torch_dtype).eval()
            reference.load_state_dict(module.state_dict())
            self._reference = reference.requires_grad_(False)
            self._reference_digest = digest_parameters(self._reference)
        # "in fp32" means upcast: float64 parameters keep float64 gradient buffers
        wide = all(p.dtype == torch.float64 for p in module.parameters())
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=opts.grad_reduce_in_fp32 and not wide,
            overlap_grad_reduce=opts.overlap_grad_reduce,
            use_distributed_optimizer=use_dist_opt,
            bucket_size=opts.bucket_size,
            average_in_collective=False,
        )
        with shims.buffers_on_cpu(self.device.type == "cpu"):
            self._ddp = DistributedDataParallel(_ddp_transformer_config(module), ddp_config, module)
        # what megatron's training loop installs; saved and nulled while a step is open
        self._ddp.config.no_sync_func = self._ddp.no_sync
        self._ddp.config.grad_sync_func = self._ddp.start_grad_sync
        self._hooks = _SavedHooks(self._ddp.config)
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._aux_grads: dict[nn.Parameter, torch.Tensor] = {}
        self._mcore_optimizer = use_dist_opt
        if use_dist_opt:
            self._optimizer = self._make_megatron_optimizer()
            self._scheduler = ManualLr(
                self._optimizer, cfg.optimizer.lr, LrSchedule(cfg.scheduler)
            )
        else:
            self._optimizer = self._make_optimizer()
            self._scheduler = torch.optim.lr_scheduler.LambdaLR(
                self._optimizer, LrSchedule(cfg.scheduler)
            )
        torch.manual_seed(cfg.seed + 1 + self.rank)
        self._version = 0
        self._last_step: int | None = None
        self._phase = StepPhase.IDLE
        self._open: _OpenStep | None = None

    def _make_megatron_optimizer(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o, max_norm = self.config.optimizer, self.config.max_grad_norm
        mcfg = OptimizerConfig(
            optimizer="sgd" if o.kind == "sgd" else "adam",
            lr=o.lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            adam_eps=o.eps,
            sgd_momentum=o.momentum,
            clip_grad=0.0 if max_norm is None else max_norm,
            use_distributed_optimizer=True,
        )
        return get_megatron_optimizer(mcfg, [self._ddp])

    @property
    def ddp(self) -> Any:
        """The mcore ``DistributedDataParallel`` wrapper (its ``config`` holds the hooks)."""
        return self._ddp

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Tensors of the model's state dict (mcore adds non-tensor ``_extra_state``)."""
        return {
            k: v.detach().to("cpu", copy=True)
            for k, v in self._model.state_dict().items()
            if isinstance(v, torch.Tensor)
        }

    # -- the split API (the gradient path; state checks are TorchTrainer's) -------------

    def begin_train_step(self, step: int, loss_config: LossConfig) -> None:
        super().begin_train_step(step, loss_config)  # checks, zero_grad, opens the step
        self._ddp.zero_grad_buffer()
        self._aux_grads.clear()
        self._hooks.save_and_null()

    def _fail(self, open_: _OpenStep, err: BaseException) -> None:
        self._hooks.restore()
        super()._fail(open_, err)

    def _forward_backward(self, mb: TrainBatch, cfg: LossConfig) -> dict[str, Metric]:
        """Forward + backward under ``no_sync`` (one reduction at finish), with MoE
        auxiliary losses captured and their gradients kept apart (see ``finish_train_step``)."""
        aux: list[torch.Tensor] = []
        with self._ddp.no_sync(), _capture_aux_losses(aux):
            logits = model_logits(self._ddp, mb.input_ids)
            ref, version = self._reference_logprobs(mb, cfg), self._version
            out = microbatch_loss(logits, mb, cfg, reference_logprobs=ref, trainer_version=version)
            if aux:
                self._accumulate_aux(torch.stack([a.sum() for a in aux]).sum())
            out.loss_sum.backward()
        return out.metrics

    def _accumulate_aux(self, aux_total: torch.Tensor) -> None:
        grads = torch.autograd.grad(aux_total, self._params, retain_graph=True, allow_unused=True)
        for p, g in zip(self._params, grads):
            if g is not None:
                acc = self._aux_grads.get(p)
                g = g.detach().to(p.main_grad.dtype)
                self._aux_grads[p] = g if acc is None else acc + g

    def finish_train_step(self) -> StepResult:
        """Global normalise, ONE cross-DP reduction, clip, optimizer + scheduler step."""
        open_ = self._require_open("finish_train_step")
        try:
            total, n = self._global_normaliser(open_)
            self._ddp.scale_gradients(1.0 / max(n, 1))  # n = 0: every gradient is 0
            for p, g in self._aux_grads.items():
                p.main_grad.add_(g, alpha=1.0 / total.num_microbatches)
            if self.options.overlap_grad_reduce:
                self._ddp.start_grad_sync()  # async dispatch; finish_grad_sync waits on it
            self._ddp.finish_grad_sync()  # with overlap off this IS the (only) reduction
            grad_norm = self._clip_gradients()
            if not math.isfinite(grad_norm):
                raise NonFiniteGradientError(
                    f"step {open_.step}: gradient norm is {grad_norm}; no update applied"
                )
            lr = float(self._optimizer.param_groups[0]["lr"])
            if n:  # an empty step (no loss-bearing token) moves no weight
                self._optimizer_step()
                self._scheduler.step()
        except BaseException as err:
            self._fail(open_, err)
            raise
        self._hooks.restore()
        self._drop_gradients()
        return self._close_step(open_, total, grad_norm, lr)

    def _clip_gradients(self) -> float:
        max_norm = self.config.max_grad_norm
        if self._mcore_optimizer:
            self._optimizer.prepare_grads()
            norm = float(self._optimizer.get_grad_norm())
            if max_norm is not None and math.isfinite(norm):
                self._optimizer.clip_grad_norm(max_norm)
            return norm
        for p in self._params:
            p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
        return float(
            torch.nn.utils.clip_grad_norm_(self._params, math.inf if max_norm is None else max_norm)
        )

    def _optimizer_step(self) -> None:
        if self._mcore_optimizer:
            self._optimizer.step_with_ready_grads()
        else:
            self._optimizer.step()

    def _drop_gradients(self) -> None:
        """Wait out any reduction in flight, zero the buffers and optimizer gradients."""
        for group in self._ddp.bucket_groups + self._ddp.expert_parallel_bucket_groups:
            if group.grad_reduce_handle is not None:
                group.grad_reduce_handle.wait()
                group.grad_reduce_handle = None
        self._ddp.zero_grad_buffer()
        self._optimizer.zero_grad(set_to_none=True)
        self._aux_grads.clear()

    def abort_train_step(self) -> None:
        """Drop the open (or failed) step; a no-op when idle. Never touches weights."""
        if self._phase is StepPhase.IDLE:
            return
        assert self._open is not None
        self._hooks.restore()
        self._drop_gradients()
        self._set_rng_state(self._open.rng)
        self._open = None
        self._phase = StepPhase.IDLE

    # -- checkpoints ----------------------------------------------------------------

    def save_checkpoint(self, directory: str | Path) -> CheckpointInfo:
        """As the torch backend (same files); not yet for the distributed optimizer."""
        if self._mcore_optimizer:
            raise ckpt.CheckpointError(
                "checkpointing megatron's distributed optimizer is not implemented yet "
                "(its state is sharded over ranks); use use_distributed_optimizer = false"
            )
        return super().save_checkpoint(directory)

    def load_checkpoint(self, directory: str | Path) -> CheckpointInfo:
        if self._mcore_optimizer:
            raise ckpt.CheckpointError(
                "loading into megatron's distributed optimizer is not implemented yet"
            )
        return super().load_checkpoint(directory)


__all__ = [
    "BackendUnavailableError",
    "McoreGPTFactory",
    "McoreGPTLM",
    "MegatronOptions",
    "MegatronTrainer",
]
