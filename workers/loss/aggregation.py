"""Masked reductions of one microbatch's [B, T] per-token values.

Every reduction is a *sum* whose divisor is a global count (tokens or sequences,
``Aggregation.normaliser``) or a constant: what a sequence contributes depends only on
that sequence, so the microbatches and ranks of a step add up to the one-shot loss.
"""

from __future__ import annotations

import math

import torch

from workers.loss.config import Aggregation
from workers.loss.metrics import MetricKind


class Reducer:
    """Masked sums over the valid tokens (``mask``) of one microbatch."""

    def __init__(
        self, mask: torch.Tensor, aggregation: Aggregation, dtype: torch.dtype, norm_length: int = 0
    ) -> None:
        self.mask = mask
        self.maskf = mask.to(dtype)
        self.tokens_per_seq = self.maskf.sum(dim=1)
        #: 1.0 for a sequence with at least one valid token (only those are counted)
        self.seq_valid = (self.tokens_per_seq > 0).to(dtype)
        self.aggregation = aggregation
        self.norm_length = norm_length

    def per_sequence_sum(self, x: torch.Tensor) -> torch.Tensor:
        """[B]: the sum of ``x`` over each sequence's valid tokens."""
        return (x * self.maskf).sum(dim=1)

    def per_sequence_mean(self, x: torch.Tensor) -> torch.Tensor:
        """[B]: the mean of ``x`` over each sequence's valid tokens (0 for an empty one)."""
        return self.per_sequence_sum(x) / self.tokens_per_seq.clamp(min=1.0)

    def aggregate(self, x: torch.Tensor) -> torch.Tensor:
        """The numerator of the loss-style mean of ``x`` (normaliser 1)."""
        agg = self.aggregation
        if agg is Aggregation.TOKEN:
            return self.per_sequence_sum(x).sum()
        if agg is Aggregation.SEQUENCE:
            return self.per_sequence_mean(x).sum()
        summed = self.per_sequence_sum(x).sum()
        if agg is Aggregation.SEQUENCE_SUM_NORM:
            # a constant, never this microbatch's padded length: that would differ
            # between microbatches and break split == one-shot
            return summed / self.norm_length
        return summed

    def token_sum(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(self.maskf.dtype) * self.maskf).sum()

    def sequence_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of a [B] per-sequence value over the counted sequences."""
        return (x.to(self.maskf.dtype) * self.seq_valid).sum()

    def extreme(self, x: torch.Tensor, kind: MetricKind, where: torch.Tensor | None = None):
        """Min/max over valid tokens (+inf / -inf when there is none: the fold identity)."""
        sel = self.mask if where is None else self.mask & where
        if kind is MetricKind.MIN:
            return torch.where(sel, x, math.inf).amin()
        return torch.where(sel, x, -math.inf).amax()
