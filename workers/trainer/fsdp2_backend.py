"""FSDP2 backend of the trainer split API: ``fully_shard`` over a (dp, tp) device mesh.

The step is :class:`~workers.trainer.rank.RankTrainer`'s (contract, state machine,
metrics and normalisation are the other backends'); this module is the parallelism
applied to it (``parallelize_fsdp2``): where the weights live (``Sharded``), how
gradients travel (``ReduceScatter``) and the DCP checkpoint (``fsdp2_checkpoint``)::

    build     rank 0: factory() (the weights, full); every rank: the factory on the
              meta device; [tp plan]; fully_shard(each transformer block);
              fully_shard(root); rank 0's full state broadcast into the shards
    begin     zero the sharded grads; ``gathered``: gradient sync off and resharding
              off on every FSDP module
    micro*    forward + backward, loss with normaliser 1. ``per_microbatch`` (default):
              each block is all-gathered for its forward and again for its backward,
              and the backward reduce-scatters the microbatch's raw gradient sums
              into the sharded grads. ``gathered``: the first forward all-gathers each
              block's parameters and they stay gathered; gradients accumulate
              unsharded (plain sums). ``train_microbatch(None)``
              runs a real forward/backward of a one-row batch whose loss mask is empty
              (loss 0, gradient exactly 0), so every rank issues the same collectives
              in the same order.
    finish    gather counts -> global N; ``gathered``: sync back on and one zero-weight
              forward/backward whose backward reduce-scatters the accumulated sums
              (a plain SUM over the dp ranks: divide factor 1, sum-only collectives)
              and reshards; grads /= N on the shards; clip by the true global norm
              (the sum of squares over every shard, all-reduced); optimizer step on
              the shards; scheduler step
    abort     drop the grads (sharded and unsharded), reshard, restore RNG

Gradient reduction and parameter residency (``Fsdp2Options.grad_reduce``), measured
by ``bench/bench_fsdp2.py`` at dp 2 (d_model 128 x 4 layers, AdamW, K = 4
microbatches, one run per shape on a quiet 2-core machine; bytes = parameters +
gradients + optimizer state per rank, vs the replicated torch backend; time = split
step vs the same mode's one-shot ``train()``), by tokens per microbatch per rank:

    mode             at rest  step peak  split K=4 at ~134 / 795 / 1576 / 3064 tokens
    per_microbatch    0.50x     0.50x    2.02x / 1.44x / 1.13x / 0.99x
    gathered          0.50x     0.75x    0.99x / 0.98x / 0.91x / 0.87x
    (torch backend, replicated: 1.03x / 0.97x / 0.92x / 0.87x in the same runs)

* ``"per_microbatch"`` (default): every microbatch all-gathers each block (forward and
  backward) and reduce-scatters its gradient sums; a rank holds 1/dp of the
  parameters, gradients and optimizer state at every moment, and pays the
  collectives K times. That cost is fixed per microbatch (~30-50 ms here: gloo on
  loopback, two ranks sharing two cores), so it vanishes as microbatches grow: at
  ~3k tokens per microbatch per rank, the size RL trainers use, the split step
  matches the one-shot with half the memory. Default because memory is why anyone
  shards: the whole point of this backend is a model whose replicated
  parameters + gradients do not fit.
* ``"gathered"``: one all-gather and one reduce-scatter per step, like the one-shot,
  whatever K is. The price is memory during the step: full parameters and a full
  gradient per rank from the first forward to finish (ZeRO-2 inside a step, ZeRO-3
  between steps; the optimizer state stays sharded). For small models with tiny
  microbatches, where the collectives dominate (the tiny model on CPU).
* (A third mode, sync off with resharding on, was measured and removed: 0.62x peak
  and 1.50-1.57x, and its abort needed FSDP's private per-parameter state.)

Why the sum is exact: the loss of every microbatch is a raw sum (normaliser 1), the
reduce-scatter adds the ranks' sums, gradients accumulate by addition over
microbatches, and the one division by the global N happens at finish -- the same
math as one-shot ``train()`` on the whole batch at world size 1, up to summation
order. FSDP's default (divide by the dp world size in the collective) would be wrong
by exactly that factor; ``gradient_divide_factor = None`` keeps it, for the test that
proves the parity suite catches it.

Reference model (k3 KL): a second module sharded the same way with frozen
parameters; when the loss needs it, its forward runs on every microbatch (dummies
included) so its all-gathers stay aligned across ranks.

Reads of full weights (``weights_digest``, ``export_weights``, ``compute_logprobs``)
are collectives: call them on every rank (``TrainerGroup`` does).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from workers.trainer import fsdp2_shard as fs
from workers.trainer.config import ModelFactory, TrainerRuntime, TrainSection
from workers.trainer.fsdp2_checkpoint import DcpCheckpoint
from workers.trainer.metrics import StepStats
from workers.trainer.options import Fsdp2Options
from workers.trainer.parallel import Parallelized, filled_grads, make_optimizer
from workers.trainer.rank import RankTrainer

__all__ = ["Fsdp2Options", "Fsdp2Trainer", "ReduceScatter", "Sharded", "parallelize_fsdp2"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class Sharded:
    """Each dp rank holds 1/dp of every parameter: full reads are all-gathers."""

    collective_forward = True

    def __init__(self, mesh: DeviceMesh, rank: int, tensor_parallel: int) -> None:
        self.mesh, self.rank, self.replicas = mesh, rank, tensor_parallel

    def digest(self, module: nn.Module) -> str:
        return fs.digest_full(module)

    def export(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full CPU tensors on rank 0 (empty dict elsewhere); call on every rank."""
        return fs.gather_full(module, keep=self.rank == 0)


class ReduceScatter:
    """FSDP's reduce-scatter of raw sums: per microbatch, or once at finish (gathered)."""

    def __init__(self, model: nn.Module, reference: nn.Module | None,
                 optimizer: torch.optim.Optimizer, options: Fsdp2Options,
                 grad_reduce: str) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.options, self.grad_reduce = optimizer, options, grad_reduce
        self.fsdp_modules = fs.fsdp_modules(model)
        self.reference_fsdp = fs.fsdp_modules(reference) if reference is not None else []
        self.model = model
        #: ``gathered`` only: sync is off and parameters stay gathered until reduce/release
        self._holding = False
        if options.gradient_divide_factor is not None:
            for m in self.fsdp_modules:
                m.set_gradient_divide_factor(options.gradient_divide_factor)
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM

    def begin(self) -> None:
        if self.grad_reduce == "gathered":
            self._set_sync(False)
            self._keep_gathered(True)
            self._holding = True

    def _set_sync(self, on: bool) -> None:
        for m in self.fsdp_modules:
            m.set_requires_gradient_sync(on, recurse=False)

    def _keep_gathered(self, on: bool) -> None:
        """``gathered``: from the step's first forward to its finish, keep every module's
        parameters (the reference model's too) unsharded; off restores the configured
        resharding and frees what is still gathered (public FSDP API only)."""
        after_forward = self.options.reshard_after_forward and not on
        for m in self.fsdp_modules:
            m.set_reshard_after_forward(after_forward, recurse=False)
            m.set_reshard_after_backward(not on, recurse=False)
        for m in self.reference_fsdp:
            m.set_reshard_after_forward(after_forward, recurse=False)
        if not on:
            for m in (*self.fsdp_modules, *self.reference_fsdp):
                m.reshard()

    def microbatch(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def backward(self, loss_sum: torch.Tensor) -> None:
        loss_sum.backward()

    def reduce(self, n: int, total: StepStats, zero_weight_pass: Callable[[], None]) -> None:
        """``gathered``: sync back on and one zero-weight pass whose backward
        reduce-scatters the accumulated sums; then grads /= N on the shards."""
        if self._holding:
            self._set_sync(True)
            for m in self.fsdp_modules:  # ... and frees the gathered parameters
                m.set_reshard_after_backward(True, recurse=False)
            zero_weight_pass()
            self._keep_gathered(False)
            self._holding = False
        for g in filled_grads(self.params):
            g.div_(float(n))

    def clip(self, max_norm: float | None) -> float:
        """Clip by the L2 norm over every shard of every gradient (an all-reduce per mesh)."""
        total = fs.global_norm([p.grad for p in self.params])
        if max_norm is not None:
            # torch's clip_grads_with_norm_ arithmetic, one tensor at a time: with tp the
            # gradients live on two meshes, which a foreach op cannot mix
            coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
            for p in self.params:
                p.grad.mul_(coef)
        return float(total)

    def step(self) -> None:
        self.optimizer.step()

    def release(self) -> None:
        """Gathered and still holding: the module's registered parameters are the
        unsharded ones holding the step's gradients, so those are dropped before
        resharding; the sharded ones are the skeleton's (optimizer.zero_grad)."""
        if not self._holding:
            return
        for p in self.model.parameters():
            p.grad = None
        self._set_sync(True)
        self._keep_gathered(False)
        self._holding = False


def _build(
    factory: ModelFactory,
    config: TrainerRuntime,
    options: Fsdp2Options,
    mesh: DeviceMesh,
    device: torch.device,
    full: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None,
) -> tuple[nn.Module, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None]:
    """A sharded copy of the model; rank 0 builds the (state, buffers) unless given them."""
    dtype = config.torch_dtype or _DTYPES.get(options.param_dtype or "")
    if mesh.get_rank() == 0 and full is None:
        torch.manual_seed(config.seed)
        source = factory().to(device)
        if dtype is not None:
            source = source.to(dtype)
        full = (
            {k: v.detach() for k, v in source.state_dict().items()},
            {k: b.detach() for k, b in source.named_buffers()},
        )
        del source
    # Every rank shards a meta-device copy: a real tensor would make rank 0 take a
    # different (scattering) path through the tensor-parallel plan than the others.
    module = fs.build_on_meta(factory)
    if dtype is not None:
        module = module.to(dtype)
    module.eval()  # dropout off: determinism
    fs.shard_model(module, mesh, reshard_after_forward=options.reshard_after_forward)
    state, buffers = full if full is not None else (None, None)
    fs.materialise_from_rank0(module, state, buffers, device)
    return module, full


def parallelize_fsdp2(
    model_factory: ModelFactory,
    train: TrainSection,
    config: TrainerRuntime,
    device: torch.device,
    *,
    options: Fsdp2Options,
) -> Parallelized:
    """A (dp, tp) mesh over the default group (a one-rank gloo group if none), the
    model and its reference sharded over it, the optimizer on the shards."""
    fs.ensure_process_group()
    mesh = fs.make_mesh(device.type, train.tensor_parallel)
    model, full = _build(model_factory, config, options, mesh, device, None)
    reference = None
    if config.keep_reference:
        reference, _ = _build(model_factory, config, options, mesh, device, full)
        reference.requires_grad_(False)
    del full
    optimizer, scheduler = make_optimizer(
        train, config, [p for p in model.parameters() if p.requires_grad]
    )
    return Parallelized(
        backend="fsdp2",
        model=model,
        forward=model,
        reference=reference,
        optimizer=optimizer,
        scheduler=scheduler,
        placement=Sharded(mesh, mesh.get_rank(), train.tensor_parallel),
        reduction=ReduceScatter(model, reference, optimizer, options, train.fsdp2_grad_reduce),
        checkpoint=DcpCheckpoint(list(mesh.shape)),
    )


def Fsdp2Trainer(  # noqa: N802
    model_factory: ModelFactory,
    train: TrainSection | None = None,
    runtime: TrainerRuntime | None = None,
    options: Fsdp2Options | None = None,
) -> RankTrainer:
    """One rank of the FSDP2 backend (a constructor: the trainer class is ``RankTrainer``);
    ``train.tensor_parallel`` and ``train.fsdp2_grad_reduce`` shape it."""
    parallelize = functools.partial(parallelize_fsdp2, options=options or Fsdp2Options())
    return RankTrainer(model_factory, train, runtime, parallelize)
