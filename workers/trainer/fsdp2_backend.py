"""FSDP2 backend of the trainer split API: ``fully_shard`` over a (dp, tp) device mesh.

Same contract, state machine, metrics and normalisation as
:class:`~workers.trainer.torch_backend.TorchTrainer` (a subclass reusing them); what
differs is where the weights live and how gradients travel::

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

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from workers.batch import TrainBatch
from workers.loss import LossConfig, Metric, microbatch_loss, token_logprobs
from workers.trainer import distributed as dd
from workers.trainer import fsdp2_checkpoint as fckpt
from workers.trainer import fsdp2_shard as fs
from workers.trainer.api import (
    CheckpointInfo,
    LogprobSource,
    MicrobatchResult,
    NonFiniteGradientError,
    StepPhase,
    StepResult,
)
from workers.trainer.config import LrSchedule, ModelFactory, TrainerConfig
from workers.trainer.metrics import StepStats, combine, loss_normaliser
from workers.trainer.tensors import model_logits
from workers.trainer.torch_backend import TorchTrainer, _OpenStep

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class Fsdp2Options:
    """Knobs of the FSDP2 backend (``train.tensor_parallel`` and ``trainer.fsdp2.*``)."""

    #: tensor-parallel degree; the mesh is (world // tensor_parallel, tensor_parallel)
    tensor_parallel: int = 1
    #: where gradients are reduce-scattered (see the module docstring)
    grad_reduce: Literal["gathered", "per_microbatch"] = "per_microbatch"
    #: FSDP's gradient divide factor. 1.0 = raw sums (correct for the split API);
    #: None = FSDP's default, the average over dp ranks -- wrong, kept for the tests
    gradient_divide_factor: float | None = 1.0
    #: free each block's gathered parameters after its forward (memory over time)
    reshard_after_forward: bool = True
    #: cast the model's parameters after building it; None = ``TrainerConfig.dtype``
    param_dtype: Literal["float32", "float64"] | None = None


def _dummy_batch(device: torch.device) -> TrainBatch:
    """One row, two tokens, empty loss mask: loss 0 and a gradient of exactly 0."""
    return TrainBatch(
        input_ids=torch.zeros(1, 2, dtype=torch.int64, device=device),
        attention_mask=torch.ones(1, 2, dtype=torch.bool, device=device),
        loss_mask=torch.zeros(1, 2, dtype=torch.bool, device=device),
        generator_logprobs=torch.zeros(1, 2, device=device),
        advantages=torch.zeros(1, device=device),
    )


class Fsdp2Trainer(TorchTrainer):
    """One rank of an FSDP2 (dp x tp) trainer; the default group is the whole world."""

    def __init__(
        self,
        model_factory: ModelFactory,
        config: TrainerConfig | None = None,
        options: Fsdp2Options | None = None,
    ) -> None:
        self.config = cfg = config or TrainerConfig()
        self.options = opts = options or Fsdp2Options()
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        if cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        fs.ensure_process_group()
        self.rank, self.world_size = dd.rank_and_world()
        self.device = self._resolve_device(cfg.device)
        self.mesh = fs.make_mesh(self.device.type, opts.tensor_parallel)
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self._model, full_state, full_buffers = self._build(model_factory, None, None)
        self._params = [p for p in self._model.parameters() if p.requires_grad]
        self._reference: nn.Module | None = None
        self._reference_digest: str | None = None
        if cfg.keep_reference:
            self._reference, _, _ = self._build(model_factory, full_state, full_buffers)
            self._reference.requires_grad_(False)
            self._reference_digest = fs.digest_full(self._reference)
        del full_state, full_buffers
        self._fsdp_modules = fs.fsdp_modules(self._model)
        self._reference_fsdp = fs.fsdp_modules(self._reference) if self._reference else []
        if opts.gradient_divide_factor is not None:
            for m in self._fsdp_modules:
                m.set_gradient_divide_factor(opts.gradient_divide_factor)
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        self._optimizer = self._make_optimizer()
        self._scheduler = torch.optim.lr_scheduler.LambdaLR(
            self._optimizer, LrSchedule(cfg.scheduler)
        )
        torch.manual_seed(cfg.seed + 1 + self.rank)
        self._version = 0
        self._last_step: int | None = None
        self._phase = StepPhase.IDLE
        self._open: _OpenStep | None = None

    def _build(
        self,
        factory: ModelFactory,
        full_state: dict[str, torch.Tensor] | None,
        full_buffers: dict[str, torch.Tensor] | None,
    ) -> tuple[nn.Module, dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
        """A sharded copy of the model; rank 0 builds the weights unless given them."""
        dtype = self.config.torch_dtype or _DTYPES.get(self.options.param_dtype or "")
        if self.rank == 0 and full_state is None:
            torch.manual_seed(self.config.seed)
            source = factory().to(self.device)
            if dtype is not None:
                source = source.to(dtype)
            full_state = {k: v.detach() for k, v in source.state_dict().items()}
            full_buffers = {k: b.detach() for k, b in source.named_buffers()}
            del source
        # Every rank shards a meta-device copy: a real tensor would make rank 0 take a
        # different (scattering) path through the tensor-parallel plan than the others.
        module = fs.build_on_meta(factory)
        if dtype is not None:
            module = module.to(dtype)
        module.eval()  # dropout off: determinism
        fs.shard_model(module, self.mesh, reshard_after_forward=self.options.reshard_after_forward)
        fs.materialise_from_rank0(module, full_state, full_buffers, self.device)
        return module, full_state, full_buffers

    # -- reads of the full weights (collectives) -------------------------------------

    def weights_digest(self) -> str:
        return fs.digest_full(self._model)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full CPU tensors on rank 0 (empty dict elsewhere); call on every rank."""
        return fs.gather_full(self._model, keep=self.rank == 0)

    def memory_bytes(self) -> dict[str, int]:
        """This rank's parameter, gradient and optimizer-state bytes (local shards)."""
        state = [t for s in self._optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0]
        return {
            "params": fs.local_bytes(self._params),
            "grads": fs.local_bytes(p.grad for p in self._params),
            "optimizer": fs.local_bytes(state),
        }

    # -- the split API ----------------------------------------------------------------

    def begin_train_step(self, step: int, loss_config: LossConfig) -> None:
        super().begin_train_step(step, loss_config)
        if self.options.grad_reduce == "gathered":
            self._set_sync(False)
            self._keep_gathered(True)

    def _set_sync(self, on: bool) -> None:
        for m in self._fsdp_modules:
            m.set_requires_gradient_sync(on, recurse=False)

    def _keep_gathered(self, on: bool) -> None:
        """``gathered``: from the step's first forward to its finish, keep every module's
        parameters (the reference model's too) unsharded; off restores the configured
        resharding and frees what is still gathered (public FSDP API only)."""
        after_forward = self.options.reshard_after_forward and not on
        for m in self._fsdp_modules:
            m.set_reshard_after_forward(after_forward, recurse=False)
            m.set_reshard_after_backward(not on, recurse=False)
        for m in self._reference_fsdp:
            m.set_reshard_after_forward(after_forward, recurse=False)
        if not on:
            for m in (*self._fsdp_modules, *self._reference_fsdp):
                m.reshard()

    def train_microbatch(self, batch: TrainBatch | None) -> MicrobatchResult:
        """As the torch backend; a dummy (None) runs a real zero-weight forward/backward."""
        if batch is not None:
            return super().train_microbatch(batch)
        open_ = self._require_open("train_microbatch")
        index = open_.num_microbatches + open_.num_dummy
        try:
            self._forward_backward(_dummy_batch(self.device), open_.loss_config)
        except BaseException as err:
            self._fail(open_, err)
            raise
        open_.num_dummy += 1
        return MicrobatchResult(index=index, num_sequences=0, num_tokens=0, dummy=True)

    def _forward_backward(self, mb: TrainBatch, cfg: LossConfig) -> dict[str, Metric]:
        ref = self._reference_logprobs(mb, cfg)
        out = microbatch_loss(
            model_logits(self._model, mb.input_ids), mb, cfg, reference_logprobs=ref,
            trainer_version=self._version,
        )
        out.loss_sum.backward()
        return out.metrics

    def _reference_logprobs(self, mb: TrainBatch, cfg: LossConfig) -> torch.Tensor | None:
        """The reference forward runs whenever KL is on (its all-gathers must align on
        every rank), even if the batch brings its own reference logprobs."""
        if cfg.kl_coef <= 0 or self._reference is None:
            return mb.reference_logprobs
        with torch.no_grad():
            ref_logits = model_logits(self._reference, mb.input_ids)
            ref = token_logprobs(ref_logits, mb.input_ids, cfg.temperature)
        return ref if mb.reference_logprobs is None else mb.reference_logprobs

    def finish_train_step(self) -> StepResult:
        """Global N, grads /= N on the shards, clip by the global norm, step."""
        open_ = self._require_open("finish_train_step")
        try:
            total, n = self._global_normaliser(open_)
            if self.options.grad_reduce == "gathered":
                self._set_sync(True)  # this zero-weight pass reduce-scatters the sums
                for m in self._fsdp_modules:  # ... and frees the gathered parameters
                    m.set_reshard_after_backward(True, recurse=False)
                self._forward_backward(_dummy_batch(self.device), open_.loss_config)
                self._keep_gathered(False)
            grads = []
            for p in self._params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            for g in grads:
                g.div_(float(max(n, 1)))  # n = 0: every gradient is 0
            grad_norm = self._clip_gradients()
            if not math.isfinite(grad_norm):
                raise NonFiniteGradientError(
                    f"step {open_.step}: gradient norm is {grad_norm}; no update applied"
                )
            lr = float(self._optimizer.param_groups[0]["lr"])
            if n:  # an empty step (no loss-bearing token) moves no weight
                self._optimizer.step()
                self._scheduler.step()
        except BaseException as err:
            self._fail(open_, err)
            raise
        self._optimizer.zero_grad(set_to_none=True)
        return self._close_step(open_, total, grad_norm, lr)

    def _global_normaliser(self, open_: _OpenStep) -> tuple[StepStats, int]:
        """Counts and metric sums over the dp ranks only: the tp ranks of one dp index
        trained the same rows, and counting them tp times would scale N by tp."""
        cfg = open_.loss_config
        local = open_.metrics.stats(
            open_.num_sequences, open_.num_tokens, open_.num_microbatches, open_.num_dummy
        )
        tp = self.options.tensor_parallel
        per_rank = dd.all_gather_objects(local)
        total = combine([s for r, s in enumerate(per_rank) if r % tp == 0])
        return total, loss_normaliser(total, cfg.aggregation)  # 0: an empty step

    def _clip_gradients(self) -> float:
        """Clip by the L2 norm over every shard of every gradient (an all-reduce per mesh)."""
        total = fs.global_norm([p.grad for p in self._params])
        max_norm = self.config.max_grad_norm
        if max_norm is not None:
            # torch's clip_grads_with_norm_ arithmetic, one tensor at a time: with tp the
            # gradients live on two meshes, which a foreach op cannot mix
            coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
            for p in self._params:
                p.grad.mul_(coef)
        return float(total)

    def abort_train_step(self) -> None:
        """Drop the open (or failed) step: public FSDP API only. Gathered, the module's
        registered parameters are the unsharded ones holding the step's gradients, so
        those are dropped before resharding; the sharded ones are cleared by the base."""
        if self._phase is StepPhase.IDLE:
            return
        if self.options.grad_reduce == "gathered":
            for p in self._model.parameters():
                p.grad = None
            self._set_sync(True)
            self._keep_gathered(False)
        super().abort_train_step()

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch | None, which: LogprobSource = "policy", *, temperature: float = 1.0
    ) -> torch.Tensor:
        """As the torch backend; every rank must call it (None: a forward that returns [0, 0])."""
        if batch is not None:
            return super().compute_logprobs(batch, which, temperature=temperature)
        model = self._model if which == "policy" else self._reference
        if model is None:
            raise ValueError("no reference model: build the trainer with keep_reference=True")
        model_logits(model, _dummy_batch(self.device).input_ids)
        return torch.zeros(0, 0)

    # -- checkpoints ----------------------------------------------------------------

    def save_checkpoint(self, directory: str | Path) -> CheckpointInfo:
        self._require_idle("save_checkpoint")
        return fckpt.save(self, Path(directory))

    def load_checkpoint(self, directory: str | Path) -> CheckpointInfo:
        self._require_idle("load_checkpoint")
        return fckpt.load(self, Path(directory))
