"""Megatron-core backend of the trainer split API: mcore ``DistributedDataParallel``.

The step is :class:`~workers.trainer.rank.RankTrainer`'s, with the torch backend's
replicated placement and checkpoint layout; this module is the parallelism applied to
it (``parallelize_megatron``): the gradient path (``McoreDdpReduction``), through
mcore's contiguous gradient buffers (``param.main_grad``) and its bucketed
data-parallel collective::

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
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from workers.availability import BackendUnavailableError, check_megatron
from workers.trainer import distributed as dd
from workers.trainer import megatron_shims as shims
from workers.trainer.checkpoint import FileCheckpoint, UnsupportedCheckpoint
from workers.trainer.config import LrSchedule, ManualLr, ModelFactory, TrainerRuntime, TrainSection
from workers.trainer.megatron_model import McoreGPTFactory, McoreGPTLM
from workers.trainer.metrics import StepStats
from workers.trainer.options import MegatronOptions
from workers.trainer.parallel import REPLICATED, Parallelized, clip_global_norm, make_optimizer
from workers.trainer.rank import RankTrainer


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


def _distributed_optimizer(asked: bool | None, device: torch.device, cfg: TrainerRuntime) -> bool:
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


class McoreDdpReduction:
    """mcore DDP's gradient buffers, reduced once at finish (see the module docstring)."""

    def __init__(
        self, ddp: Any, params: list[nn.Parameter], optimizer: Any, options: MegatronOptions,
        mcore_optimizer: bool,
    ) -> None:
        self.ddp, self.params, self.optimizer, self.options = ddp, params, optimizer, options
        self.mcore_optimizer = mcore_optimizer
        self._hooks = _SavedHooks(ddp.config)
        self._aux: list[torch.Tensor] = []
        self._aux_grads: dict[nn.Parameter, torch.Tensor] = {}

    def begin(self) -> None:
        self.ddp.zero_grad_buffer()
        self._aux_grads.clear()
        self._hooks.save_and_null()

    @contextlib.contextmanager
    def microbatch(self) -> Iterator[None]:
        """Under ``no_sync`` (one reduction at finish), MoE aux losses captured."""
        self._aux = []
        with self.ddp.no_sync(), _capture_aux_losses(self._aux):
            yield

    def backward(self, loss_sum: torch.Tensor) -> None:
        """Aux losses' gradients kept apart (scaled at finish), then the loss's."""
        if self._aux:
            self._accumulate_aux(torch.stack([a.sum() for a in self._aux]).sum())
        loss_sum.backward()

    def _accumulate_aux(self, aux_total: torch.Tensor) -> None:
        grads = torch.autograd.grad(aux_total, self.params, retain_graph=True, allow_unused=True)
        for p, g in zip(self.params, grads):
            if g is not None:
                acc = self._aux_grads.get(p)
                g = g.detach().to(p.main_grad.dtype)
                self._aux_grads[p] = g if acc is None else acc + g

    def reduce(self, n: int, total: StepStats, zero_weight_pass: Callable[[], None]) -> None:
        self.ddp.scale_gradients(1.0 / n)
        for p, g in self._aux_grads.items():
            p.main_grad.add_(g, alpha=1.0 / total.num_microbatches)
        if self.options.overlap_grad_reduce:
            self.ddp.start_grad_sync()  # async dispatch; finish_grad_sync waits on it
        self.ddp.finish_grad_sync()  # with overlap off this IS the (only) reduction

    def clip(self, max_norm: float | None) -> float:
        if self.mcore_optimizer:
            self.optimizer.prepare_grads()
            norm = float(self.optimizer.get_grad_norm())
            if max_norm is not None and math.isfinite(norm):
                self.optimizer.clip_grad_norm(max_norm)
            return norm
        for p in self.params:
            p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
        return clip_global_norm(self.params, max_norm)

    def step(self) -> None:
        if self.mcore_optimizer:
            self.optimizer.step_with_ready_grads()
        else:
            self.optimizer.step()

    def release(self) -> None:
        """The caller's hooks back; any reduction in flight waited out; buffers zeroed."""
        self._hooks.restore()
        for group in self.ddp.bucket_groups + self.ddp.expert_parallel_bucket_groups:
            if group.grad_reduce_handle is not None:
                group.grad_reduce_handle.wait()
                group.grad_reduce_handle = None
        self.ddp.zero_grad_buffer()
        self._aux_grads.clear()


def _megatron_optimizer(
    ddp: Any, train: TrainSection, config: TrainerRuntime
) -> tuple[Any, ManualLr]:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = config.optimizer
    mcfg = OptimizerConfig(
        optimizer="sgd" if o.kind == "sgd" else "adam",
        lr=train.lr,
        weight_decay=train.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_eps=o.eps,
        sgd_momentum=o.momentum,
        clip_grad=train.grad_clip,  # 0.0: no clipping, in megatron as in [train]
        use_distributed_optimizer=True,
    )
    optimizer = get_megatron_optimizer(mcfg, [ddp])
    schedule = LrSchedule(config.scheduler, train.warmup_steps)
    return optimizer, ManualLr(optimizer, train.lr, schedule)


def _wrap_ddp(module: nn.Module, options: MegatronOptions, use_dist_opt: bool, cpu: bool) -> Any:
    """mcore DDP over ``module`` with the hooks megatron's training loop installs."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    # "in fp32" means upcast: float64 parameters keep float64 gradient buffers
    wide = all(p.dtype == torch.float64 for p in module.parameters())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=options.grad_reduce_in_fp32 and not wide,
        overlap_grad_reduce=options.overlap_grad_reduce,
        use_distributed_optimizer=use_dist_opt,
        bucket_size=options.bucket_size,
        average_in_collective=False,
    )
    with shims.buffers_on_cpu(cpu):
        ddp = DistributedDataParallel(_ddp_transformer_config(module), ddp_config, module)
    # what megatron's training loop installs; saved and nulled while a step is open
    ddp.config.no_sync_func = ddp.no_sync
    ddp.config.grad_sync_func = ddp.start_grad_sync
    return ddp


_NO_DIST_OPT_CHECKPOINT = UnsupportedCheckpoint(
    "checkpointing megatron's distributed optimizer is not implemented yet (its state is "
    "sharded over ranks); use use_distributed_optimizer = false",
    "loading into megatron's distributed optimizer is not implemented yet",
)


def parallelize_megatron(
    model_factory: ModelFactory,
    train: TrainSection,
    config: TrainerRuntime,
    device: torch.device,
    *,
    options: MegatronOptions,
) -> Parallelized:
    """Megatron's parallel state (over the default group), the seeded model broadcast
    from rank 0 and wrapped in mcore DDP, a second instance as the reference."""
    shims.require_megatron()
    cpu = device.type == "cpu"
    shims.ensure_parallel_state(cpu=cpu)
    use_dist_opt = _distributed_optimizer(options.use_distributed_optimizer, device, config)
    check_megatron(installed=True, cuda=device.type == "cuda", require_gpu=use_dist_opt)
    torch.manual_seed(config.seed)
    module = model_factory().to(device=device, dtype=config.torch_dtype)
    module.eval()  # dropout off: determinism
    dd.broadcast_module_(module)
    reference = None
    if config.keep_reference:
        # a second instance, not deepcopy: mcore modules hold process groups
        reference = model_factory().to(device=device, dtype=config.torch_dtype).eval()
        reference.load_state_dict(module.state_dict())
        reference.requires_grad_(False)
    ddp = _wrap_ddp(module, options, use_dist_opt, cpu)
    params = [p for p in module.parameters() if p.requires_grad]
    if use_dist_opt:
        optimizer, scheduler = _megatron_optimizer(ddp, train, config)
    else:
        optimizer, scheduler = make_optimizer(train, config, params)
    return Parallelized(
        backend="megatron",
        model=module,
        forward=ddp,
        reference=reference,
        optimizer=optimizer,
        scheduler=scheduler,
        placement=REPLICATED,
        reduction=McoreDdpReduction(ddp, params, optimizer, options, use_dist_opt),
        checkpoint=_NO_DIST_OPT_CHECKPOINT if use_dist_opt else FileCheckpoint(),
    )


def MegatronTrainer(  # noqa: N802
    model_factory: ModelFactory,
    train: TrainSection | None = None,
    runtime: TrainerRuntime | None = None,
    options: MegatronOptions | None = None,
) -> RankTrainer:
    """One rank of the megatron backend (a constructor: the trainer class is ``RankTrainer``)."""
    parallelize = functools.partial(parallelize_megatron, options=options or MegatronOptions())
    return RankTrainer(model_factory, train, runtime, parallelize)


__all__ = [
    "BackendUnavailableError",
    "McoreDdpReduction",
    "McoreGPTFactory",
    "McoreGPTLM",
    "MegatronOptions",
    "MegatronTrainer",
    "parallelize_megatron",
]
