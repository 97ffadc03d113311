"""One data-parallel rank of the trainer: the split-API train step, written once.

Every backend runs this class; what differs between them is applied by composition
(``workers.trainer.parallel``): a backend's ``Parallelize`` function builds the model
under its parallelism and hands back a placement, a reduction and a checkpoint
format. The step is the same whatever those are::

    begin      check IDLE; zero grads; capture RNG; reduction.begin         -> OPEN
    micro*     forward (reference first, when KL needs it), the loss with
               normaliser 1, reduction.backward; count valid sequences/tokens.
               None = a zero-weight dummy: nothing, or (collective forward) a
               real one-row pass with an empty loss mask
    finish     gather every rank's counts -> global N; reduction.reduce (ONE
               cross-DP reduction, grads /= N); clip; non-finite check; read the
               LR; optimizer step; scheduler step; release; version += 1    -> IDLE
    abort      release; restore the RNG captured at begin                  -> IDLE
    any error inside begin..finish                                         -> FAILED

Invariant: weights, optimizer and scheduler state change only at the end of
``finish_train_step``, after every check that can fail (collectives, the empty-step
and non-finite-gradient checks), so an abort only drops gradients and restores RNG.

Determinism: deterministic algorithms on, dropout off (models are kept in eval
mode), a seeded init shared by every rank, rank-ordered metric folding; with a fixed
``num_threads`` the same calls give bitwise-equal weights in two processes on CPU.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.batch import TrainBatch
from workers.loss import Metric, StepLoss, microbatch_loss, token_logprobs, valid_counts
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
    train_one_shot,
)
from workers.trainer.config import ModelFactory, TrainerRuntime, TrainSection
from workers.trainer.metrics import MetricAccumulator, StepStats, combine, loss_normaliser, normalise
from workers.trainer.parallel import CheckpointParts, Parallelize, Parallelized
from workers.trainer.tensors import _trim, dummy_batch, model_logits, resolve_device

__all__ = ["RankTrainer"]


@dataclass
class _OpenStep:
    step: int
    loss_config: StepLoss
    rng: dict[str, Any]
    metrics: MetricAccumulator = field(default_factory=MetricAccumulator)
    num_sequences: int = 0
    num_tokens: int = 0
    num_microbatches: int = 0
    num_dummy: int = 0
    failure: str | None = None


class RankTrainer:
    """One rank (the default process group, if initialised, spans the ranks) of any
    backend; implements :class:`workers.trainer.api.Trainer`. It runs the user's
    ``[train]`` table as it is, with the run's ``runtime`` beside it."""

    def __init__(
        self,
        model_factory: ModelFactory,
        train: TrainSection | None,
        runtime: TrainerRuntime | None,
        parallelize: Parallelize,
    ) -> None:
        #: the ``[train]`` table this rank runs (``self.train`` is the one-shot step)
        self.config = train = train or TrainSection()
        self.runtime = cfg = runtime or TrainerRuntime()
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        if cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.device = resolve_device(cfg.device)
        #: the backend's modules, optimizer and strategies (built in its process group)
        self.parallel: Parallelized = parallelize(model_factory, train, cfg, self.device)
        self.rank, self.world_size = dd.rank_and_world()
        p = self.parallel
        self._reference_digest = None if p.reference is None else p.placement.digest(p.reference)
        torch.manual_seed(cfg.seed + 1 + self.rank)
        self._version = 0
        self._last_step: int | None = None
        self._phase = StepPhase.IDLE
        self._open: _OpenStep | None = None

    # -- state queries --------------------------------------------------------------

    @property
    def trainer_version(self) -> int:
        return self._version

    @property
    def phase(self) -> StepPhase:
        return self._phase

    @property
    def model(self) -> nn.Module:
        return self.parallel.model

    @property
    def optimizer(self) -> Any:
        return self.parallel.optimizer

    @property
    def scheduler(self) -> Any:
        return self.parallel.scheduler

    def weights_digest(self) -> str:
        return self.parallel.placement.digest(self.parallel.model)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full CPU tensors (sharded placements: on rank 0, an empty dict elsewhere;
        call it on every rank)."""
        return self.parallel.placement.export(self.parallel.model)

    def close(self) -> None:
        """Nothing to free: the rank's process group belongs to its caller."""

    def _rng_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)

    # -- phase checks -----------------------------------------------------------------

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
        try:  # e.g. the caller's sync hooks are back at once, not only at abort
            self._release()
        except Exception as cleanup:  # the step's own error is the one to report
            err.add_note(f"releasing the failed step also failed: {cleanup!r}")

    def _release(self) -> None:
        self.parallel.reduction.release()
        self.parallel.optimizer.zero_grad(set_to_none=True)

    # -- the split API --------------------------------------------------------------

    def begin_train_step(self, step: int, loss_config: StepLoss) -> None:
        self._require_idle(f"begin_train_step({step})")
        if not isinstance(loss_config, StepLoss):
            raise TypeError(f"loss_config must be a StepLoss, got {type(loss_config).__name__}")
        self.parallel.optimizer.zero_grad(set_to_none=True)
        self._open = _OpenStep(step=step, loss_config=loss_config, rng=self._rng_state())
        self._phase = StepPhase.OPEN
        self.parallel.reduction.begin()

    def train_microbatch(self, batch: TrainBatch | None) -> MicrobatchResult:
        """Forward + backward of one microbatch with normaliser 1; None = zero-weight dummy."""
        open_ = self._require_open("train_microbatch")
        index = open_.num_microbatches + open_.num_dummy
        n_seq = n_tok = 0
        try:
            if batch is None:
                if self.parallel.placement.collective_forward:
                    self._forward_backward(dummy_batch(self.device), open_.loss_config)
            else:
                n_seq, n_tok = valid_counts(batch.loss_mask)
                metrics = self._forward_backward(_trim(batch, self.device), open_.loss_config)
                open_.metrics.add(metrics)
        except BaseException as err:
            self._fail(open_, err)
            raise
        if batch is None:
            open_.num_dummy += 1
            return MicrobatchResult(index=index, num_sequences=0, num_tokens=0, dummy=True)
        open_.num_microbatches += 1
        open_.num_sequences += n_seq
        open_.num_tokens += n_tok
        return MicrobatchResult(index=index, num_sequences=n_seq, num_tokens=n_tok)

    def _forward_backward(self, mb: TrainBatch, cfg: StepLoss) -> dict[str, Metric]:
        """The microbatch's loss (the one call of ``microbatch_loss``), back-propagated;
        the mismatch metrics compare the tokens generated at this rank's version."""
        ref = self._reference_logprobs(mb, cfg)
        with self.parallel.reduction.microbatch():
            logits = model_logits(self.parallel.forward, mb.input_ids)
            out = microbatch_loss(
                logits, mb, cfg, reference_logprobs=ref, trainer_version=self._version
            )
            self.parallel.reduction.backward(out.loss_sum)
        return out.metrics

    def _reference_logprobs(self, mb: TrainBatch, cfg: StepLoss) -> torch.Tensor | None:
        """The batch's reference logprobs, else the frozen reference model's when KL
        needs them. With a collective forward the reference runs whenever KL is on (its
        all-gathers must align on every rank), even if the batch brings its own."""
        given, reference = mb.reference_logprobs, self.parallel.reference
        if cfg.options.kl_coef <= 0 or reference is None:
            return given
        if given is not None and not self.parallel.placement.collective_forward:
            return given
        with torch.no_grad():
            computed = token_logprobs(
                model_logits(reference, mb.input_ids), mb.input_ids, cfg.sampling.temperature
            )
        return computed if given is None else given

    def finish_train_step(self) -> StepResult:
        """Global normalise, one gradient reduction, clip, optimizer + scheduler step."""
        open_ = self._require_open("finish_train_step")
        p = self.parallel
        try:
            total, n = self._global_normaliser(open_)
            p.reduction.reduce(  # n = 0 (an empty step): every gradient is 0 already
                max(n, 1), total,
                lambda: self._forward_backward(dummy_batch(self.device), open_.loss_config),
            )
            grad_norm = p.reduction.clip(self.config.grad_clip or None)
            if not math.isfinite(grad_norm):
                raise NonFiniteGradientError(
                    f"step {open_.step}: gradient norm is {grad_norm}; no update applied"
                )
            lr = float(p.optimizer.param_groups[0]["lr"])
            if n:  # an empty step (no loss-bearing token) moves no weight
                p.reduction.step()
                p.scheduler.step()
        except BaseException as err:
            self._fail(open_, err)
            raise
        self._release()
        return self._close_step(open_, total, grad_norm, lr)

    def _global_normaliser(self, open_: _OpenStep) -> tuple[StepStats, int]:
        """All ranks' counts and metric sums folded, and the loss normaliser N; N = 0 when
        no rank had a loss-bearing token (an empty step: zero gradient, no update).

        Ranks that trained the same rows (tensor parallel) are counted once: counting
        them ``replicas`` times would scale N by that much."""
        local = open_.metrics.stats(
            open_.num_sequences, open_.num_tokens, open_.num_microbatches, open_.num_dummy
        )
        per_rank = dd.all_gather_objects(local)
        total = combine(per_rank[:: self.parallel.placement.replicas])
        return total, loss_normaliser(total, open_.loss_config.options.aggregation)

    def _close_step(
        self, open_: _OpenStep, total: StepStats, grad_norm: float, lr: float
    ) -> StepResult:
        """The update is applied: advance the version, go IDLE, report the step."""
        self._version += 1
        self._last_step = open_.step
        self._open = None
        self._phase = StepPhase.IDLE
        return StepResult(
            step=open_.step,
            trainer_version=self._version,
            metrics=normalise(total, open_.loss_config.options.aggregation),
            grad_norm=grad_norm,
            lr=lr,
            num_sequences=total.num_sequences,
            num_tokens=total.num_tokens,
            num_microbatches=total.num_microbatches,
            weights_digest=self.weights_digest() if self.runtime.digest_on_finish else None,
        )

    def abort_train_step(self) -> None:
        """Drop the open (or failed) step; a no-op when idle. Never touches weights."""
        if self._phase is StepPhase.IDLE:
            return
        assert self._open is not None
        self._release()
        self._set_rng_state(self._open.rng)
        self._open = None
        self._phase = StepPhase.IDLE

    def train(
        self, batch: TrainBatch | None, loss_config: StepLoss, *, step: int | None = None
    ) -> StepResult:
        """One-shot step: begin, one microbatch, finish (aborted on any exception)."""
        return train_one_shot(self, batch, loss_config, step)

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch | None, which: LogprobSource = "policy", *, temperature: float = 1.0
    ) -> torch.Tensor:
        """[B, T] fp32 CPU logprobs of ``batch``'s tokens; 0 where loss_mask is False.

        None (a rank with no rows, under a collective forward): a forward that keeps
        the ranks' collectives aligned, returning [0, 0]."""
        if which not in ("policy", "reference"):
            raise ValueError(f"which = {which!r}; expected 'policy' or 'reference'")
        model = self.parallel.model if which == "policy" else self.parallel.reference
        if model is None:
            raise ValueError("no reference model: build the trainer with keep_reference=True")
        if batch is None:
            if self.parallel.placement.collective_forward:
                model_logits(model, dummy_batch(self.device).input_ids)
            return torch.zeros(0, 0)
        mb = _trim(batch, self.device)
        lp = token_logprobs(model_logits(model, mb.input_ids), mb.input_ids, temperature)
        lp = torch.where(mb.loss_mask, lp, 0.0).cpu()
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        out[:, : lp.shape[1]] = lp
        return out

    # -- checkpoints ----------------------------------------------------------------

    def _parts(self) -> CheckpointParts:
        p = self.parallel
        return CheckpointParts(p.model, p.optimizer, p.scheduler, self.rank, self.world_size)

    def _meta(self) -> dict[str, Any]:
        return {
            "trainer_version": self._version,
            "step": self._last_step,
            "world_size": self.world_size,
            "weights_digest": self.weights_digest(),
            "reference_digest": self._reference_digest,
        }

    def save_checkpoint(self, directory: str | Path) -> CheckpointInfo:
        """Durably write model/optimizer/scheduler/RNG/version (collective over ranks)."""
        self._require_idle("save_checkpoint")
        final = Path(directory)
        sha, files = self.parallel.checkpoint.save(final, self._parts(), self._rng_state(), self._meta)
        return CheckpointInfo(str(final), self._version, self._last_step, sha, files)

    def _check_reference(self, final: Path, meta: Mapping[str, Any]) -> None:
        """Refuse a checkpoint trained against another KL reference (before restoring)."""
        if self._reference_digest is not None and meta.get("reference_digest") not in (
            None,
            self._reference_digest,
        ):
            raise ckpt.CheckpointError(
                f"checkpoint {final} was trained against a different reference model"
            )

    def load_checkpoint(self, directory: str | Path) -> CheckpointInfo:
        """Verify every file's sha256, then restore everything ``save_checkpoint`` wrote."""
        self._require_idle("load_checkpoint")
        final = Path(directory)
        got = self.parallel.checkpoint.load(
            final, self._parts(), functools.partial(self._check_reference, final)
        )
        version = int(got.meta["trainer_version"])
        if got.rng is not None:
            self._set_rng_state(got.rng)
        else:  # written at another world size: reseed deterministically
            torch.manual_seed(self.runtime.seed + 1 + self.rank + 7919 * version)
        self._version = version
        self._last_step = got.meta["step"]
        if self.weights_digest() != got.meta["weights_digest"]:
            raise ckpt.CheckpointCorruptError(
                f"checkpoint {final}: weights digest after loading differs from the manifest"
            )
        return CheckpointInfo(str(final), self._version, self._last_step, got.sha256, dict(got.files))
