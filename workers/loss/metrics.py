"""How a microbatch reports a metric: a sum (or min/max) and what it is later divided by.

Nothing is averaged inside a microbatch: ``workers.trainer.metrics`` folds every
microbatch's and rank's contributions first, then divides each by its own global count,
so a step split into microbatches and data-parallel ranks reports what one shot would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at run time: the config imports MetricKind
    import torch


class MetricKind(str, Enum):
    """What a metric's accumulated sum is divided by when a step finishes."""

    #: sum over valid tokens; divided by the global valid-token count
    TOKEN = "token"
    #: sum over valid sequences; divided by the global valid-sequence count
    SEQUENCE = "sequence"
    #: aggregated like the loss; divided by the loss's normaliser (tokens or sequences)
    LOSS = "loss"
    #: a raw count; summed, never divided
    COUNT = "count"
    #: minimum over microbatches and ranks; never averaged
    MIN = "min"
    #: maximum over microbatches and ranks; never averaged
    MAX = "max"
    #: sum over a subset of tokens; divided by the global sum of the COUNT metric named
    #: by :attr:`Metric.per` (e.g. the mismatch metrics over current-version tokens)
    RATIO = "ratio"


@dataclass(frozen=True)
class Metric:
    """One microbatch's contribution to a metric: a detached 0-dim tensor and its kind."""

    value: torch.Tensor
    kind: MetricKind
    #: RATIO only: the name of the COUNT metric this sum is divided by
    per: str | None = None


#: names of the train/inference mismatch metrics (over tokens generated at the trainer's
#: own weight version; see ``workers.loss.offpolicy.mismatch_metrics``)
MISMATCH_KL = "mismatch_kl"
MISMATCH_TOKENS = "mismatch_tokens"
MISMATCH_DIFF_MEAN = "mismatch_logprob_diff_mean"
MISMATCH_DIFF_MAX = "mismatch_logprob_diff_max"


def mismatch_warning(metrics: dict[str, float], threshold: float) -> str | None:
    """One line when a step's KL(mu || pi) at the trainer's own version exceeds
    ``threshold`` (``train.loss.mismatch_kl_warn``; 0 = never), else None."""
    kl = metrics.get(MISMATCH_KL)
    if not threshold or kl is None or not math.isfinite(kl) or kl <= threshold:
        return None
    return (
        f"train/inference mismatch: KL(generator || trainer) = {kl:.3g} over "
        f"{metrics.get(MISMATCH_TOKENS, 0):.0f} tokens at the trainer's version "
        f"(max |logprob diff| {metrics.get(MISMATCH_DIFF_MAX, math.nan):.3g}) exceeds "
        f"train.loss.mismatch_kl_warn = {threshold:g}"
    )
