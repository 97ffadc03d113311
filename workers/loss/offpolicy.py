"""Off-policy corrections for tokens sampled by the generator (mu), and the
train/inference mismatch metrics.

The importance weight moves a token sampled from mu towards pi_old; it is detached and
multiplies the surrogate. With l_t = old_t - g_t (0 on a token whose generator logprob
is not finite) and [a, b] = [is_min, is_cap]:

    tis           w_t = clamp(e^{l_t}, a, b)
    icepop        w_t = e^{l_t} if a <= e^{l_t} <= b else 0
    seq-tis       w_t = clamp(e^{sum_t l_t}, a, b)                 (one weight per sequence)
    seq-mask-tis  w_t = e^{l_t} if a <= e^{mean_t l_t} <= b else 0  (whole sequences masked)

A token whose generator logprob is -inf / nan gets w = 0 (it cannot be reweighted) and
is counted in ``gen_logprob_invalid``. Exponents are clamped at +-LOG_RATIO_MAX.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.loss.aggregation import Reducer
from workers.loss.config import ISCorrection, LossOptions
from workers.loss.logprobs import LOG_RATIO_MAX
from workers.loss.metrics import (
    MISMATCH_DIFF_MAX,
    MISMATCH_DIFF_MEAN,
    MISMATCH_KL,
    MISMATCH_TOKENS,
    Metric,
    MetricKind,
)


@dataclass(frozen=True)
class ImportanceWeights:
    #: [B, T] detached weights (0 on unusable tokens)
    weight: torch.Tensor
    #: out-of-bounds flags: [B, T] per token, or [B] per sequence (``per_sequence``)
    out_of_bounds: torch.Tensor
    per_sequence: bool


def _exp(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX))


def importance_weights(
    old: torch.Tensor, gen: torch.Tensor, usable: torch.Tensor, red: Reducer, cfg: LossOptions
) -> ImportanceWeights:
    """The weight ``cfg.is_correction`` selects (see the module docstring)."""
    with torch.no_grad():
        log_w = torch.where(usable, old - gen, 0.0)
        lo, hi, kind = cfg.is_min, cfg.is_cap, cfg.is_correction
        raw = _exp(log_w)
        if kind is ISCorrection.NONE:
            weight, oob = torch.ones_like(raw), torch.zeros_like(usable)
        elif kind is ISCorrection.TIS:
            weight, oob = raw.clamp(lo, hi), (raw < lo) | (raw > hi)
        elif kind is ISCorrection.ICEPOP:
            oob = (raw < lo) | (raw > hi)
            weight = torch.where(oob, 0.0, raw)
        elif kind is ISCorrection.SEQ_TIS:
            seq = _exp(red.per_sequence_sum(log_w))
            oob = (seq < lo) | (seq > hi)
            weight = seq.clamp(lo, hi).unsqueeze(1).expand_as(raw)
        else:  # SEQ_MASK_TIS
            geo = _exp(red.per_sequence_mean(log_w))
            oob = (geo < lo) | (geo > hi)
            weight = torch.where(oob.unsqueeze(1), 0.0, raw)
        weight = torch.where(usable, weight, 0.0)
    return ImportanceWeights(weight, oob, kind.per_sequence)


def importance_metrics(iw: ImportanceWeights, red: Reducer, usable: torch.Tensor) -> dict:
    """Mean weight, out-of-bounds fraction and the count of unusable generator logprobs."""
    oob = (
        Metric(red.sequence_sum(iw.out_of_bounds), MetricKind.SEQUENCE)
        if iw.per_sequence
        else Metric(red.token_sum(iw.out_of_bounds), MetricKind.TOKEN)
    )
    return {
        "is_weight_mean": Metric(red.token_sum(iw.weight), MetricKind.TOKEN),
        "is_oob_frac": oob,
        "gen_logprob_invalid": Metric(red.token_sum(red.mask & ~usable), MetricKind.COUNT),
    }


def mismatch_metrics(
    lp: torch.Tensor, gen: torch.Tensor, sel: torch.Tensor, red: Reducer
) -> dict[str, Metric]:
    """Generator vs trainer at the same weight version, over the tokens ``sel``.

    With d = log pi - log mu on tokens sampled from mu: KL(mu || pi) is estimated by
    k3 = e^d - d - 1 (non-negative, unbiased), plus the mean and max of |d|.
    """
    with torch.no_grad():
        # float64 and expm1: a fresh generator differs by ~1e-7, whose k3 (~d^2 / 2)
        # float32's exp(d) - d - 1 would round to exactly 0
        d = torch.where(sel, lp - gen, 0.0).double().clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)
        k3 = torch.expm1(d) - d
        return {
            MISMATCH_TOKENS: Metric(red.token_sum(sel), MetricKind.COUNT),
            MISMATCH_KL: Metric(red.token_sum(k3), MetricKind.RATIO, per=MISMATCH_TOKENS),
            MISMATCH_DIFF_MEAN: Metric(
                red.token_sum(d.abs()), MetricKind.RATIO, per=MISMATCH_TOKENS
            ),
            MISMATCH_DIFF_MAX: Metric(
                red.extreme(d.abs(), MetricKind.MAX, where=sel), MetricKind.MAX
            ),
        }
