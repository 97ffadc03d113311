"""Metric normalisation rules for a step split into microbatches and data-parallel ranks.

Each microbatch contributes *sums* (or a min/max); nothing is averaged until the step
finishes and the global counts are known. Then each metric is divided by its own
normaliser (:class:`workers.loss.MetricKind`):

==========  ==========================================================
TOKEN       global sum / global valid tokens
SEQUENCE    global sum / global valid sequences
LOSS        global sum / the loss's normaliser (tokens for token-level
            aggregation, sequences for sequence-level)
COUNT       global sum, never divided
MIN / MAX   global min / max, never averaged
RATIO       global sum / the global sum of the COUNT metric it names
            (``Metric.per``: e.g. the tokens at the trainer's version)
==========  ==========================================================

A metric with nothing to average over (a divisor of 0, a min/max over no token) is
left out rather than reported as nan/inf: the log's JSON has neither. A step with no
loss-bearing token at all reports ``empty_step = 1`` (its gradient is exactly 0).

A metric reported without a kind (a plain float or tensor) takes the kind registered in
:data:`KNOWN_KINDS`; **an unknown name defaults to LOSS** (:data:`DEFAULT_KIND`) --
most ad-hoc metrics are auxiliary losses, which must be normalised exactly like the loss
for split and one-shot steps to agree.

Cross-rank combination is done in rank order on plain Python numbers gathered from every
rank, so the result is identical on all ranks and deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from workers.loss import Aggregation, Metric, MetricKind

#: kind given to a metric name reported without one and absent from KNOWN_KINDS
DEFAULT_KIND = MetricKind.LOSS

#: kinds of well-known metric names, used when a metric arrives untagged
KNOWN_KINDS: dict[str, MetricKind] = {
    "loss": MetricKind.LOSS,
    "pg_loss": MetricKind.LOSS,
    "kl": MetricKind.LOSS,
    "clip_low_frac": MetricKind.TOKEN,
    "clip_high_frac": MetricKind.TOKEN,
    "is_weight_mean": MetricKind.TOKEN,
    "is_oob_frac": MetricKind.TOKEN,
    "dual_clip_frac": MetricKind.TOKEN,
    "entropy": MetricKind.TOKEN,
    "gen_logprob_invalid": MetricKind.COUNT,
    "mismatch_tokens": MetricKind.COUNT,
    "mismatch_logprob_diff_max": MetricKind.MAX,
    "advantage_mean": MetricKind.SEQUENCE,
    "num_tokens": MetricKind.COUNT,
    "num_sequences": MetricKind.COUNT,
    "ratio_min": MetricKind.MIN,
    "ratio_max": MetricKind.MAX,
    "logprob_diff_max": MetricKind.MAX,
}


def kind_of(name: str) -> MetricKind:
    """The kind of an untagged metric: registered kind, else :data:`DEFAULT_KIND`."""
    return KNOWN_KINDS.get(name, DEFAULT_KIND)


@dataclass
class StepStats:
    """One rank's (or the global) totals for a step: plain Python values, picklable."""

    num_sequences: int = 0
    num_tokens: int = 0
    num_microbatches: int = 0
    num_dummy_microbatches: int = 0
    values: dict[str, float] = field(default_factory=dict)
    kinds: dict[str, MetricKind] = field(default_factory=dict)
    #: RATIO metrics: the COUNT metric each is divided by
    per: dict[str, str] = field(default_factory=dict)


def _fold(kind: MetricKind, a: float, b: float) -> float:
    if kind is MetricKind.MIN:
        return min(a, b)
    if kind is MetricKind.MAX:
        return max(a, b)
    return a + b


class MetricAccumulator:
    """Accumulates one rank's metric contributions on the metrics' device (no syncs)."""

    def __init__(self) -> None:
        self._values: dict[str, torch.Tensor] = {}
        self._kinds: dict[str, MetricKind] = {}
        self._per: dict[str, str] = {}

    def add(self, metrics: Mapping[str, Metric | torch.Tensor | float]) -> None:
        for name, m in metrics.items():
            if isinstance(m, Metric):
                value, kind = m.value, m.kind
                if m.per is not None:
                    self._per[name] = m.per
            else:
                value, kind = m, kind_of(name)
            value = torch.as_tensor(value).detach().to(torch.float64)
            known = self._kinds.setdefault(name, kind)
            if known is not kind:
                raise ValueError(f"metric {name!r} reported as {kind.value} and {known.value}")
            if name not in self._values:
                self._values[name] = value
            elif kind is MetricKind.MIN:
                self._values[name] = torch.minimum(self._values[name], value)
            elif kind is MetricKind.MAX:
                self._values[name] = torch.maximum(self._values[name], value)
            else:
                self._values[name] = self._values[name] + value

    def stats(
        self, num_sequences: int, num_tokens: int, num_microbatches: int, num_dummy: int
    ) -> StepStats:
        names = sorted(self._values)
        values = torch.stack([self._values[n].cpu() for n in names]).tolist() if names else []
        return StepStats(
            num_sequences=num_sequences,
            num_tokens=num_tokens,
            num_microbatches=num_microbatches,
            num_dummy_microbatches=num_dummy,
            values=dict(zip(names, values)),
            kinds={n: self._kinds[n] for n in names},
            per={n: self._per[n] for n in names if n in self._per},
        )


def combine(per_rank: Sequence[StepStats]) -> StepStats:
    """Global totals from every rank's stats, folded in rank order (deterministic)."""
    out = StepStats()
    for s in per_rank:
        out.num_sequences += s.num_sequences
        out.num_tokens += s.num_tokens
        out.num_microbatches += s.num_microbatches
        out.num_dummy_microbatches += s.num_dummy_microbatches
        for name in sorted(s.values):
            kind = s.kinds[name]
            known = out.kinds.setdefault(name, kind)
            if known is not kind:
                raise ValueError(
                    f"metric {name!r} is {kind.value} on one rank, {known.value} on another"
                )
            v = s.values[name]
            out.values[name] = _fold(kind, out.values[name], v) if name in out.values else v
        out.per.update(s.per)
    return out


def loss_normaliser(stats: StepStats, aggregation: Aggregation) -> int:
    """The global N the step's summed gradient is divided by (0 for an empty step)."""
    if aggregation.normaliser is MetricKind.SEQUENCE:
        return stats.num_sequences
    return stats.num_tokens


def normalise(stats: StepStats, aggregation: Aggregation) -> dict[str, float]:
    """Each global metric divided by its own normaliser (see the module table)."""
    by_kind = {
        MetricKind.TOKEN: stats.num_tokens,
        MetricKind.SEQUENCE: stats.num_sequences,
        MetricKind.LOSS: loss_normaliser(stats, aggregation),
    }
    out: dict[str, float] = {}
    for name in sorted(stats.values):
        kind, value = stats.kinds[name], stats.values[name]
        if kind is MetricKind.RATIO:
            divisor = stats.values.get(stats.per.get(name, ""), 0.0)
        elif kind in by_kind:
            divisor = by_kind[kind]
        else:  # COUNT, MIN, MAX as folded; a min/max over nothing is the +-inf identity
            if not math.isinf(value):
                out[name] = value
            continue
        if divisor:
            out[name] = value / divisor
    if not by_kind[MetricKind.LOSS]:
        out["empty_step"] = 1.0
    return out
