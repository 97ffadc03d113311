"""The KL penalty to the frozen reference model: estimators, clamps and placement.

With d = clamp(log pi_ref - log pi, +-kl_input_clamp) per token:

    k1 = -d,    k2 = d^2 / 2,    k3 = e^d - d - 1

The in-loss term is clamp(w * k, +-kl_output_clamp) with w = 1 (``KLGradient.DIRECT``) or
w = r = pi_theta / pi_old (``SCORE``: value r, gradient r * grad log pi_theta); where the
input clamp is active the weight is detached, so a clamped token carries no gradient
through either factor. Both clamps are NeMo-RL's (verl clamps k3 alike).
"""

from __future__ import annotations

import torch

from workers.loss.config import KLEstimator, KLGradient, LossOptions
from workers.loss.logprobs import LOG_RATIO_MAX


def estimate(
    logprobs: torch.Tensor, reference: torch.Tensor, estimator: KLEstimator, input_clamp: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token k(d), whether the input clamp changed d) for d = reference - logprobs."""
    d = reference - logprobs
    clamped = torch.zeros_like(d, dtype=torch.bool)
    if input_clamp:
        bounded = d.clamp(-input_clamp, input_clamp)
        clamped = bounded != d
        d = bounded
    if estimator is KLEstimator.K1:
        return -d, clamped
    if estimator is KLEstimator.K2:
        return 0.5 * d * d, clamped
    return torch.exp(d) - d - 1.0, clamped


def loss_term(
    lp: torch.Tensor, old: torch.Tensor, reference: torch.Tensor, cfg: LossOptions
) -> torch.Tensor:
    """The per-token KL term added (times kl_coef) to the loss; see the module docstring."""
    k, clamped = estimate(lp, reference, cfg.kl_estimator, cfg.kl_input_clamp)
    if cfg.kl_gradient is KLGradient.SCORE:
        weight = torch.exp((lp - old).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX))
        k = torch.where(clamped, weight.detach(), weight) * k
    if cfg.kl_output_clamp:
        k = k.clamp(-cfg.kl_output_clamp, cfg.kl_output_clamp)
    return k


def reward_penalty(old: torch.Tensor, reference: torch.Tensor, cfg: LossOptions) -> torch.Tensor:
    """Per-token KL of the sampling policy (pi_old) to the reference, as a reward: no
    gradient; ``KLPlacement.REWARD`` subtracts kl_coef times it from every advantage."""
    k, _ = estimate(old.detach(), reference, cfg.kl_estimator, cfg.kl_input_clamp)
    if cfg.kl_output_clamp:
        k = k.clamp(-cfg.kl_output_clamp, cfg.kl_output_clamp)
    return k.detach()
