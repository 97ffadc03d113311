"""The policy-gradient surrogates: PPO (with dual clip), GSPO and CISPO, per token.

All take lp (with grad), old (detached) and per-token advantages A and return the
per-token loss before the importance weight; the formulas are in the ``workers.loss``
docstring. Log-ratios are clamped at +-LOG_RATIO_MAX before ``exp`` (verl does the same):
beyond it the true gradient of a clipped term is 0, and exp would overflow float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.loss.aggregation import Reducer
from workers.loss.config import LossOptions, PolicyLoss
from workers.loss.logprobs import LOG_RATIO_MAX


@dataclass(frozen=True)
class Surrogate:
    """The per-token policy loss and what the metrics need about it."""

    #: [B, T] per-token loss before the importance weight (differentiable)
    loss: torch.Tensor
    #: [B, T] the ratio the surrogate used (detached); per sequence for GSPO
    ratio: torch.Tensor
    #: [B, T] bool: the lower / upper clip bound is active
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    #: [B, T] bool: the dual-clip bound -c * A is active
    dual_clipped: torch.Tensor


def _bounded_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX))


def surrogate(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, red: Reducer, cfg: LossOptions
) -> Surrogate:
    """The per-token surrogate ``cfg.policy_loss`` selects."""
    if cfg.policy_loss is PolicyLoss.GSPO:
        # s = exp(mean_t(lp - old)) per sequence, written per token as
        # sg(s) * exp(lp - sg(lp)) (GSPO-token, verl's form): the value is s on every
        # token and, with one advantage per sequence and the sequence mean, the gradient
        # is GSPO's s * mean_t grad(lp); it also takes per-token advantages.
        seq_log = red.per_sequence_mean(lp - old).detach().unsqueeze(1)
        ratio = _bounded_exp(seq_log + lp - lp.detach())
    else:
        ratio = _bounded_exp(lp - old)
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    clipped = ratio.clamp(lo, hi)
    r = ratio.detach()
    if cfg.policy_loss is PolicyLoss.CISPO:
        loss = -clipped.detach() * adv * lp
        none = torch.zeros_like(r, dtype=torch.bool)
        return Surrogate(loss, r, r < lo, r > hi, none)
    loss = torch.maximum(-ratio * adv, -clipped * adv)
    dual = torch.zeros_like(r, dtype=torch.bool)
    if cfg.dual_clip:
        bound = -cfg.dual_clip * adv
        dual = (adv < 0) & (loss.detach() > bound)
        loss = torch.where(dual, bound, loss)
    return Surrogate(loss, r, (adv < 0) & (r < lo), (adv > 0) & (r > hi), dual)
