"""The GRPO loss of one microbatch, as a raw sum (normaliser 1); formulas in ``workers.loss``.

:func:`microbatch_loss` is what a trainer backend calls with its logits; :func:`grpo_loss`
takes logprobs (and an optional entropy) directly, for tests and custom callers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.batch import TrainBatch
from workers.loss import kl as klmod
from workers.loss.aggregation import Reducer
from workers.loss.config import KLPlacement, LossOptions, OldPolicy, StepLoss, norm_length
from workers.loss.logprobs import token_logprobs_and_entropy
from workers.loss.metrics import Metric, MetricKind
from workers.loss.offpolicy import importance_metrics, importance_weights, mismatch_metrics
from workers.loss.policy import surrogate


@dataclass(frozen=True)
class LossOutput:
    """Result of :func:`grpo_loss` on one microbatch."""

    #: the loss numerator (normaliser 1); differentiable 0-dim tensor
    loss_sum: torch.Tensor
    #: which count the step divides ``loss_sum`` by
    normaliser: MetricKind
    metrics: dict[str, Metric] = field(default_factory=dict)


def microbatch_loss(
    logits: torch.Tensor,
    batch: TrainBatch,
    loss: StepLoss,
    *,
    reference_logprobs: torch.Tensor | None = None,
    trainer_version: int | None = None,
) -> LossOutput:
    """The loss from a causal LM's [B, T, V] ``logits`` over ``batch.input_ids``: the one
    call every trainer backend makes per microbatch. ``trainer_version`` is the version of
    the weights that produced the logits (the mismatch metrics compare tokens generated
    at that version). Logprobs are taken at the generators' temperature."""
    cfg, sampling = loss.options, loss.sampling
    lp, entropy = token_logprobs_and_entropy(
        logits, batch.input_ids, sampling.temperature, entropy_grad=cfg.entropy_coef > 0
    )
    return grpo_loss(
        lp, batch, cfg, reference_logprobs=reference_logprobs, entropy=entropy,
        trainer_version=trainer_version, max_new_tokens=sampling.max_new_tokens,
    )


def current_tokens(batch: TrainBatch, trainer_version: int | None) -> torch.Tensor:
    """[B, T] bool: tokens generated at ``trainer_version`` (per-token versions if the
    batch has them, else each sample's version; all tokens when neither is known)."""
    mask = batch.loss_mask
    if trainer_version is None:
        return mask
    if batch.token_versions is not None:
        return mask & (batch.token_versions == trainer_version)
    if batch.sample_versions is not None:
        return mask & (batch.sample_versions == trainer_version).unsqueeze(1)
    return mask


def _old_logprobs(lp, gen, usable, cfg: LossOptions, old_logprobs) -> torch.Tensor:
    if old_logprobs is not None:
        return torch.where(usable, old_logprobs.to(lp.dtype), lp.detach()).detach()
    if cfg.old_policy is OldPolicy.GENERATOR:
        # a token with no usable generator logprob takes ratio 1 (its weight is 0)
        return torch.where(usable, gen, lp.detach())
    return lp.detach()


def grpo_loss(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    cfg: LossOptions,
    *,
    reference_logprobs: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    trainer_version: int | None = None,
    max_new_tokens: int = 0,
) -> LossOutput:
    """Raw-sum GRPO loss of one microbatch (see the ``workers.loss`` docstring).

    ``logprobs`` are the trainer's [B, T] logprobs (with grad), aligned like the batch.
    ``reference_logprobs`` (else ``batch.reference_logprobs``) is needed when kl_coef > 0.
    ``old_logprobs`` overrides ``cfg.old_policy``. ``entropy`` ([B, T]) feeds the entropy
    metric and bonus (the bonus needs it). ``max_new_tokens`` (the generators') is the
    Dr. GRPO length when ``cfg.norm_length`` is 0.
    """
    mask = batch.loss_mask
    red = Reducer(mask, cfg.aggregation, logprobs.dtype, norm_length(cfg, max_new_tokens))
    # Zero every per-token input outside the mask so that no inf/nan can arise there
    # (exp of a large masked difference) and leak into the sum or the gradient.
    lp = torch.where(mask, logprobs, 0.0)
    raw_gen = batch.generator_logprobs.to(lp.dtype)
    usable = mask & torch.isfinite(raw_gen)
    gen = torch.where(usable, raw_gen, 0.0)
    old = _old_logprobs(lp, gen, usable, cfg, old_logprobs)
    ref = _reference(batch, reference_logprobs, cfg, lp.dtype)
    adv = _advantages(batch, old, ref, cfg, lp.dtype)

    iw = importance_weights(old, gen, usable, red, cfg)
    sur = surrogate(lp, old, adv, red, cfg)
    pg = sur.loss * iw.weight
    kl_term = None if ref is None else klmod.loss_term(lp, old, ref, cfg)
    loss_sum = red.aggregate(_per_token_loss(pg, kl_term, entropy, mask, cfg))

    with torch.no_grad():
        metrics = _metrics(red, loss_sum, pg, sur, adv, old, gen, usable, cfg)
        metrics.update(importance_metrics(iw, red, usable))
        sel = usable & current_tokens(batch, trainer_version)
        metrics.update(mismatch_metrics(lp.detach(), gen, sel, red))
        if kl_term is not None:
            metrics["kl"] = Metric(red.aggregate(kl_term), MetricKind.LOSS)
        if entropy is not None:
            metrics["entropy"] = Metric(red.token_sum(entropy.detach()), MetricKind.TOKEN)
    return LossOutput(loss_sum=loss_sum, normaliser=cfg.aggregation.normaliser, metrics=metrics)


def _reference(batch: TrainBatch, given, cfg: LossOptions, dtype) -> torch.Tensor | None:
    """The reference logprobs (the argument, else the batch's), zero off the mask."""
    ref = given if given is not None else batch.reference_logprobs
    if cfg.kl_coef > 0 and ref is None:
        raise ValueError(
            "train.loss.kl_coef > 0 needs reference logprobs (TrainBatch.reference_logprobs "
            "or a trainer with a reference model)"
        )
    return None if ref is None else torch.where(batch.loss_mask, ref.to(dtype), 0.0)


def _advantages(batch: TrainBatch, old, ref, cfg: LossOptions, dtype) -> torch.Tensor:
    """[B, T] advantages; with the KL in the reward, less beta times its per-token KL."""
    mask = batch.loss_mask
    adv = torch.where(mask, batch.token_advantages().to(dtype), 0.0)
    if ref is not None and cfg.kl_coef > 0 and cfg.kl_placement is KLPlacement.REWARD:
        adv = adv - cfg.kl_coef * torch.where(mask, klmod.reward_penalty(old, ref, cfg), 0.0)
    return adv


def _per_token_loss(pg, kl_term, entropy, mask, cfg: LossOptions) -> torch.Tensor:
    """pg plus the in-loss KL term, less the entropy bonus."""
    out = pg
    if kl_term is not None and cfg.kl_coef > 0 and cfg.kl_placement is KLPlacement.LOSS:
        out = out + cfg.kl_coef * kl_term
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("train.loss.entropy_coef > 0 needs the entropy (microbatch_loss)")
        out = out - cfg.entropy_coef * torch.where(mask, entropy, 0.0)
    return out


def _metrics(red: Reducer, loss_sum, pg, sur, adv, old, gen, usable, cfg) -> dict[str, Metric]:
    ratio = sur.ratio
    return {
        "loss": Metric(loss_sum.detach(), MetricKind.LOSS),
        "pg_loss": Metric(red.aggregate(pg), MetricKind.LOSS),
        "clip_low_frac": Metric(red.token_sum(sur.clipped_low), MetricKind.TOKEN),
        "clip_high_frac": Metric(red.token_sum(sur.clipped_high), MetricKind.TOKEN),
        "dual_clip_frac": Metric(red.token_sum(sur.dual_clipped), MetricKind.TOKEN),
        "ratio_min": Metric(red.extreme(ratio, MetricKind.MIN), MetricKind.MIN),
        "ratio_max": Metric(red.extreme(ratio, MetricKind.MAX), MetricKind.MAX),
        "logprob_diff_max": Metric(
            red.extreme((old - gen).abs(), MetricKind.MAX, where=usable), MetricKind.MAX
        ),
        "advantage_mean": Metric(
            red.sequence_sum(red.per_sequence_mean(adv)), MetricKind.SEQUENCE
        ),
        "num_tokens": Metric(red.maskf.sum(), MetricKind.COUNT),
        "num_sequences": Metric(red.seq_valid.sum(), MetricKind.COUNT),
    }
