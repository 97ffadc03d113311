"""Torch backend of the trainer split API: any causal LM ``nn.Module``, data parallel.

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

Invariant: weights, optimizer and scheduler state are mutated only at the end of
``finish_train_step``, after every check that can fail (collectives, the empty-step and
non-finite-gradient checks), so ``abort_train_step`` only has to drop gradients,
accumulators and restore the RNG state captured at ``begin``.

Determinism: deterministic algorithms on, dropout off (the model is kept in eval
mode), a seeded init broadcast from rank 0, rank-ordered metric folding; with a fixed
``num_threads`` the same calls give bitwise-equal weights in two processes on CPU.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.batch import TrainBatch
from workers.loss import LossConfig, Metric, microbatch_loss, token_logprobs, valid_counts
from workers.trainer import checkpoint as ckpt
from workers.trainer import distributed as dd
from workers.trainer.api import (
    CheckpointInfo,
    LogprobSource,
    MicrobatchResult,
    NonFiniteGradientError,
    StepPhase,
    StepResult,
    TrainStepStateError,
)
from workers.trainer.config import LrSchedule, ModelFactory, TrainerConfig
from workers.trainer.metrics import MetricAccumulator, combine, loss_normaliser, normalise
from workers.trainer.tensors import _trim, digest_parameters, model_logits

__all__ = ["TorchTrainer", "digest_parameters", "model_logits"]


@dataclass
class _OpenStep:
    step: int
    loss_config: LossConfig
    rng: dict[str, Any]
    metrics: MetricAccumulator = field(default_factory=MetricAccumulator)
    num_sequences: int = 0
    num_tokens: int = 0
    num_microbatches: int = 0
    num_dummy: int = 0
    failure: str | None = None


class TorchTrainer:
    """One data-parallel rank (the default process group, if initialised, is the DP group)."""

    def __init__(self, model_factory: ModelFactory, config: TrainerConfig | None = None) -> None:
        self.config = cfg = config or TrainerConfig()
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        if cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.rank, self.world_size = dd.rank_and_world()
        self.device = self._resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        model = model_factory().to(device=self.device, dtype=cfg.torch_dtype)
        model.eval()  # dropout off: determinism (see module docstring)
        dd.broadcast_module_(model)
        self._model = model
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._reference: nn.Module | None = None
        self._reference_digest: str | None = None
        if cfg.keep_reference:
            self._reference = copy.deepcopy(model).requires_grad_(False)
            self._reference_digest = digest_parameters(self._reference)
        self._optimizer = self._make_optimizer()
        self._scheduler = torch.optim.lr_scheduler.LambdaLR(
            self._optimizer, LrSchedule(cfg.scheduler)
        )
        torch.manual_seed(cfg.seed + 1 + self.rank)
        self._version = 0
        self._last_step: int | None = None
        self._phase = StepPhase.IDLE
        self._open: _OpenStep | None = None

    # -- construction helpers -------------------------------------------------------

    @staticmethod
    def _resolve_device(name: str | None) -> torch.device:
        if name is None:
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(name)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        o = self.config.optimizer
        if o.kind == "sgd":
            return torch.optim.SGD(
                self._params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay
            )
        return torch.optim.AdamW(
            self._params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )

    def _rng_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)

    # -- state queries --------------------------------------------------------------

    @property
    def trainer_version(self) -> int:
        return self._version

    @property
    def phase(self) -> StepPhase:
        return self._phase

    @property
    def model(self) -> nn.Module:
        return self._model

    def weights_digest(self) -> str:
        return digest_parameters(self._model)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self._model.state_dict().items()}

    # -- the split API --------------------------------------------------------------

    def _require_idle(self, method: str) -> None:
        if self._phase is not StepPhase.IDLE:
            assert self._open is not None
            raise TrainStepStateError(
                f"{method} called while step {self._open.step} is {self._phase.value}: "
                "finish_train_step or abort_train_step it first"
            )

    def _require_open(self, method: str) -> _OpenStep:
        if self._phase is StepPhase.IDLE:
            raise TrainStepStateError(
                f"{method} called with no open step: call begin_train_step first"
            )
        assert self._open is not None
        if self._phase is StepPhase.FAILED:
            raise TrainStepStateError(
                f"{method} called on step {self._open.step}, which failed "
                f"({self._open.failure}); only abort_train_step is allowed"
            )
        return self._open

    def _fail(self, open_: _OpenStep, err: BaseException) -> None:
        open_.failure = f"{type(err).__name__}: {err}"
        self._phase = StepPhase.FAILED

    def begin_train_step(self, step: int, loss_config: LossConfig) -> None:
        self._require_idle(f"begin_train_step({step})")
        if not isinstance(loss_config, LossConfig):
            raise TypeError(f"loss_config must be a LossConfig, got {type(loss_config).__name__}")
        self._optimizer.zero_grad(set_to_none=True)
        self._open = _OpenStep(step=step, loss_config=loss_config, rng=self._rng_state())
        self._phase = StepPhase.OPEN

    def train_microbatch(self, batch: TrainBatch | None) -> MicrobatchResult:
        """Forward + backward of one microbatch with normaliser 1; None = zero-weight dummy."""
        open_ = self._require_open("train_microbatch")
        index = open_.num_microbatches + open_.num_dummy
        if batch is None:
            open_.num_dummy += 1
            return MicrobatchResult(index=index, num_sequences=0, num_tokens=0, dummy=True)
        try:
            n_seq, n_tok = valid_counts(batch.loss_mask)
            metrics = self._forward_backward(_trim(batch, self.device), open_.loss_config)
            open_.metrics.add(metrics)
        except BaseException as err:
            self._fail(open_, err)
            raise
        open_.num_microbatches += 1
        open_.num_sequences += n_seq
        open_.num_tokens += n_tok
        return MicrobatchResult(index=index, num_sequences=n_seq, num_tokens=n_tok)

    def _forward_backward(self, mb: TrainBatch, cfg: LossConfig) -> dict[str, Metric]:
        """The microbatch's loss, back-propagated into the parameters; returns its metrics."""
        out = microbatch_loss(
            model_logits(self._model, mb.input_ids), mb, cfg,
            reference_logprobs=self._reference_logprobs(mb, cfg), trainer_version=self._version,
        )
        out.loss_sum.backward()
        return out.metrics

    def _reference_logprobs(self, mb: TrainBatch, cfg: LossConfig) -> torch.Tensor | None:
        """The batch's reference logprobs, or the frozen reference model's when KL needs them."""
        ref = mb.reference_logprobs
        if ref is None and cfg.kl_coef > 0 and self._reference is not None:
            with torch.no_grad():
                ref_logits = model_logits(self._reference, mb.input_ids)
                ref = token_logprobs(ref_logits, mb.input_ids, cfg.temperature)
        return ref

    def finish_train_step(self) -> StepResult:
        """Global normalise, one gradient reduction, clip, optimizer + scheduler step."""
        open_ = self._require_open("finish_train_step")
        try:
            total, n = self._global_normaliser(open_)
            grads = []
            for p in self._params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            dd.all_reduce_sum_flat_(grads, self.config.reduce_bucket_mb << 20)
            torch._foreach_div_(grads, float(max(n, 1)))  # n = 0: every gradient is 0
            max_norm = self.config.max_grad_norm
            grad_norm = float(
                torch.nn.utils.clip_grad_norm_(
                    self._params, math.inf if max_norm is None else max_norm
                )
            )
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

    def _global_normaliser(self, open_: Any) -> tuple[Any, int]:
        """All ranks' counts and metric sums folded, and the loss normaliser N; N = 0
        when no rank had a loss-bearing token (an empty step: zero gradient, no update)."""
        local = open_.metrics.stats(
            open_.num_sequences, open_.num_tokens, open_.num_microbatches, open_.num_dummy
        )
        total = combine(dd.all_gather_objects(local))
        return total, loss_normaliser(total, open_.loss_config.aggregation)

    def _close_step(self, open_: Any, total: Any, grad_norm: float, lr: float) -> StepResult:
        """The update is applied: advance the version, go IDLE, report the step."""
        self._version += 1
        self._last_step = open_.step
        self._open = None
        self._phase = StepPhase.IDLE
        return StepResult(
            step=open_.step,
            trainer_version=self._version,
            metrics=normalise(total, open_.loss_config.aggregation),
            grad_norm=grad_norm,
            lr=lr,
            num_sequences=total.num_sequences,
            num_tokens=total.num_tokens,
            num_microbatches=total.num_microbatches,
            weights_digest=self.weights_digest() if self.config.digest_on_finish else None,
        )

    def abort_train_step(self) -> None:
        """Drop the open (or failed) step; a no-op when idle. Never touches weights."""
        if self._phase is StepPhase.IDLE:
            return
        assert self._open is not None
        self._optimizer.zero_grad(set_to_none=True)
        self._set_rng_state(self._open.rng)
        self._open = None
        self._phase = StepPhase.IDLE

    def train(
        self, batch: TrainBatch | None, loss_config: LossConfig, *, step: int | None = None
    ) -> StepResult:
        """One-shot step: begin, one microbatch, finish (aborted on any exception)."""
        self.begin_train_step(self._version if step is None else step, loss_config)
        try:
            self.train_microbatch(batch)
            return self.finish_train_step()
        except BaseException:
            self.abort_train_step()
            raise

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, which: LogprobSource = "policy", *, temperature: float = 1.0
    ) -> torch.Tensor:
        """[B, T] fp32 CPU logprobs of ``batch``'s tokens; 0 where loss_mask is False."""
        if which == "policy":
            model = self._model
        elif which == "reference":
            if self._reference is None:
                raise ValueError("no reference model: build the trainer with keep_reference=True")
            model = self._reference
        else:
            raise ValueError(f"which = {which!r}; expected 'policy' or 'reference'")
        mb = _trim(batch, self.device)
        lp = token_logprobs(model_logits(model, mb.input_ids), mb.input_ids, temperature)
        lp = torch.where(mb.loss_mask, lp, 0.0).cpu()
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        out[:, : lp.shape[1]] = lp
        return out

    # -- checkpoints ----------------------------------------------------------------

    def save_checkpoint(self, directory: str | Path) -> CheckpointInfo:
        """Durably write model/optimizer/scheduler/RNG/version (collective over ranks)."""
        self._require_idle("save_checkpoint")
        final = Path(directory)
        sha, files = ckpt.save_collective(
            final,
            rank=self.rank,
            rank_files={f"rng_rank{self.rank}.pt": self._rng_state()},
            rank0_files=lambda: {
                "model.pt": self._model.state_dict(),
                "optimizer.pt": self._optimizer.state_dict(),
                "scheduler.pt": self._scheduler.state_dict(),
            },
            meta=lambda: {
                "trainer_version": self._version,
                "step": self._last_step,
                "world_size": self.world_size,
                "weights_digest": self.weights_digest(),
                "reference_digest": self._reference_digest,
            },
        )
        return CheckpointInfo(str(final), self._version, self._last_step, sha, files)

    def load_checkpoint(self, directory: str | Path) -> CheckpointInfo:
        """Verify every file's sha256, then restore everything ``save_checkpoint`` wrote."""
        self._require_idle("load_checkpoint")
        final = Path(directory)
        got = ckpt.read_trainer_files(final, self.rank)
        meta = got.manifest["meta"]
        if self._reference_digest is not None and meta.get("reference_digest") not in (
            None,
            self._reference_digest,
        ):
            raise ckpt.CheckpointError(
                f"checkpoint {final} was trained against a different reference model"
            )
        self._model.load_state_dict(got.model)
        self._optimizer.load_state_dict(got.optimizer)
        self._scheduler.load_state_dict(got.scheduler)
        if got.rng is not None:
            self._set_rng_state(got.rng)
        else:  # a different world size: reseed deterministically
            torch.manual_seed(self.config.seed + 1 + self.rank + 7919 * meta["trainer_version"])
        self._version = int(meta["trainer_version"])
        self._last_step = meta["step"]
        if self.weights_digest() != meta["weights_digest"]:
            raise ckpt.CheckpointCorruptError(
                f"checkpoint {final}: weights digest after loading differs from the manifest"
            )
        return CheckpointInfo(str(final), self._version, self._last_step, got.sha256, got.manifest["files"])
