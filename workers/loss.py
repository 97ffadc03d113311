"""GRPO loss: clipped policy gradient with truncated importance sampling and a k3 KL penalty.

Notation, per completion token t of sample b (only where ``loss_mask`` is True):

* ``lp``  = log pi_theta(y_t | y_<t), the trainer's logprob at temperature tau
  (logits / tau, the same scaling the generator sampled with);
* ``g``   = log mu(y_t | y_<t), the generator's logprob (``TrainBatch.generator_logprobs``);
  mu is the behaviour policy: possibly a few weight versions stale, and a different
  kernel/precision even when fresh;
* ``old`` = log pi_old(y_t | y_<t), the policy the PPO ratio is taken against;
* ``A``   = the sample's advantage (one value per sequence, GRPO-style).

What "old" means here. The controller trains each batch with exactly one optimizer step,
so the policy at the start of that step *is* the current policy: pi_old = sg(pi_theta)
(``OldPolicy.TRAINER``, the default). Then the ratio r = exp(lp - sg(lp)) equals 1 in
value, its gradient is grad(lp), and clipping is inert (it would only act on a second
update of the same batch, which never happens). Staleness and the generator/trainer
numeric mismatch are corrected separately by a truncated importance weight

    w = min(exp(old - g), C)          (detached; C = ``is_truncation_cap``)

which reweights samples drawn from mu towards pi_old without the variance blow-up of an
unbounded ratio: a token whose ratio exceeds C is weighted C (truncated, neither dropped
nor reset to 1). Only ``is_truncation_cap=None`` turns the correction off (w = 1). The
per-token policy loss is the decoupled clipped surrogate

    pg_t = -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A),   r = exp(lp - old)

The log-ratio is clamped at ``LOG_RATIO_MAX`` before ``exp``: with explicit old logprobs
lp - old can exceed 88, where exp overflows float32 and the backward pass computes
0 * inf = nan even for a clipped token whose true gradient is 0. A ratio of e^20 is far
beyond any clip bound, so clipped terms keep their value; an unclipped A < 0 term is
bounded there (like dual-clip PPO) and carries no gradient past it.

With ``OldPolicy.GENERATOR`` the generator is taken as pi_old (old = g): r = pi_theta/mu
is clipped asymmetrically and w = exp(g - g) = 1, i.e. classic PPO against the behaviour
policy; clipping then bounds how far stale tokens can push. Callers can also pass an
explicit ``old_logprobs`` tensor (e.g. logprobs recomputed before several updates).

KL penalty to a frozen reference (``kl_coef`` = beta > 0), with the k3 estimator
(non-negative, unbiased for KL(pi_theta || pi_ref) on samples from pi_theta):

    k3_t = exp(ref - lp) - (ref - lp) - 1,      loss_t = pg_t + beta * k3_t

It is not importance-weighted (common practice; it is a regulariser, not the objective).

Aggregation (a typed choice, :class:`Aggregation`):

* ``TOKEN``:    L = sum_{b,t} loss_bt / N_tokens            (all valid tokens weigh equally)
* ``SEQUENCE``: L = sum_b mean_t(loss_bt) / N_sequences     (each sequence weighs equally;
  a sequence with no valid token is not counted)

:func:`grpo_loss` returns the *raw sum* -- the numerator with the normaliser set to 1 --
so a step split into microbatches and data-parallel ranks divides once by the global N
(see ``workers.trainer``). Every metric comes back as a sum (or min/max) tagged with the
:class:`MetricKind` that says what it must later be divided by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import torch

from workers.batch import TrainBatch

#: the importance log-ratio lp - old is clamped here before exp (see the module docstring)
LOG_RATIO_MAX = 20.0


class Aggregation(str, Enum):
    """How per-token losses are averaged (and so which count is the step's normaliser)."""

    TOKEN = "token"
    SEQUENCE = "sequence"


class OldPolicy(str, Enum):
    """Which logprobs the PPO ratio is taken against (see the module docstring)."""

    #: sg(current trainer logprobs): ratio = 1, staleness handled by the truncated IS weight
    TRAINER = "trainer"
    #: the generator's logprobs: ratio = pi_theta / mu, clipped; no separate IS weight
    GENERATOR = "generator"


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


@dataclass(frozen=True)
class Metric:
    """One microbatch's contribution to a metric: a detached 0-dim tensor and its kind."""

    value: torch.Tensor
    kind: MetricKind


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of the GRPO loss. Validated on construction."""

    #: lower clip epsilon: the ratio is clipped below at 1 - clip_low
    clip_low: float = 0.2
    #: upper clip epsilon (asymmetric, "clip-higher"): clipped above at 1 + clip_high
    clip_high: float = 0.28
    #: token-level or sequence-level averaging
    aggregation: Aggregation = Aggregation.TOKEN
    #: weight of the k3 KL penalty to the frozen reference model; 0 disables it
    kl_coef: float = 0.0
    #: cap C of the truncated IS weight min(pi_old/mu, C): a larger ratio is weighted C;
    #: None disables the correction (every weight 1)
    is_truncation_cap: float | None = 2.0
    #: sampling temperature; the trainer scales logits by 1/temperature like the generator
    temperature: float = 1.0
    #: the policy the PPO ratio is taken against
    old_policy: OldPolicy = OldPolicy.TRAINER

    def __post_init__(self) -> None:
        for name, enum in (("aggregation", Aggregation), ("old_policy", OldPolicy)):
            value = getattr(self, name)
            if not isinstance(value, enum):
                try:
                    object.__setattr__(self, name, enum(value))
                except ValueError:
                    choices = [e.value for e in enum]
                    raise ValueError(
                        f"LossConfig.{name} = {value!r}; expected one of {choices}"
                    ) from None
        for name in ("clip_low", "clip_high", "kl_coef"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"LossConfig.{name} = {value!r}; must be finite and >= 0")
        if self.clip_low >= 1:
            raise ValueError(f"LossConfig.clip_low = {self.clip_low!r}; must be < 1")
        cap = self.is_truncation_cap
        if cap is not None and not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"LossConfig.is_truncation_cap = {cap!r}; must be > 0 or None")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"LossConfig.temperature = {self.temperature!r}; must be > 0")


@dataclass(frozen=True)
class LossOutput:
    """Result of :func:`grpo_loss` on one microbatch."""

    #: the loss numerator (normaliser 1); differentiable 0-dim tensor
    loss_sum: torch.Tensor
    #: which count the step divides ``loss_sum`` by
    normaliser: MetricKind
    metrics: dict[str, Metric] = field(default_factory=dict)


def valid_counts(loss_mask: torch.Tensor) -> tuple[int, int]:
    """(valid sequences, valid tokens): a sequence is valid if it has a loss-bearing token."""
    return int(loss_mask.any(dim=1).sum()), int(loss_mask.sum())


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """[B, T] log p(input_ids[t] | input_ids[<t]) at ``temperature``; position 0 is 0.

    Follows the ``workers.batch`` alignment: logits at t - 1 predict token t. Computed in
    at least fp32 whatever the model's dtype (bf16/fp16 are upcast, fp64 is kept).
    """
    scaled = logits[:, :-1]
    scaled = scaled.to(torch.promote_types(scaled.dtype, torch.float32))
    if temperature != 1.0:
        scaled = scaled / temperature
    target = input_ids[:, 1:].unsqueeze(-1)
    lp = scaled.gather(-1, target).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return torch.nn.functional.pad(lp, (1, 0))


class _Reducer:
    """Masked reductions of [B, T] per-token values for one microbatch."""

    def __init__(self, mask: torch.Tensor, aggregation: Aggregation, dtype: torch.dtype) -> None:
        self.mask = mask
        self.maskf = mask.to(dtype)
        self.tokens_per_seq = self.maskf.sum(dim=1)
        self.aggregation = aggregation

    def aggregate(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over tokens (TOKEN) or sum over sequences of per-sequence means (SEQUENCE)."""
        summed = (x * self.maskf).sum(dim=1)
        if self.aggregation is Aggregation.SEQUENCE:
            return (summed / self.tokens_per_seq.clamp(min=1.0)).sum()
        return summed.sum()

    def token_sum(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(self.maskf.dtype) * self.maskf).sum()

    def extreme(self, x: torch.Tensor, kind: MetricKind) -> torch.Tensor:
        """Min/max over valid tokens (+inf / -inf when there is none: the fold identity)."""
        if kind is MetricKind.MIN:
            return torch.where(self.mask, x, math.inf).amin()
        return torch.where(self.mask, x, -math.inf).amax()


def grpo_loss(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    cfg: LossConfig,
    *,
    reference_logprobs: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> LossOutput:
    """Raw-sum GRPO loss of one microbatch (see the module docstring for the math).

    ``logprobs`` are the trainer's [B, T] logprobs (with grad), aligned like the batch.
    ``reference_logprobs`` (else ``batch.reference_logprobs``) is needed when kl_coef > 0.
    ``old_logprobs`` overrides ``cfg.old_policy``.
    """
    mask = batch.loss_mask
    red = _Reducer(mask, cfg.aggregation, logprobs.dtype)
    # Zero every per-token input outside the mask so that no inf/nan can arise there
    # (exp of a large masked difference) and leak into the sum or the gradient.
    lp = torch.where(mask, logprobs, 0.0)
    gen = torch.where(mask, batch.generator_logprobs.to(lp.dtype), 0.0)
    if old_logprobs is not None:
        old = torch.where(mask, old_logprobs.to(lp.dtype), 0.0).detach()
    elif cfg.old_policy is OldPolicy.GENERATOR:
        old = gen
    else:
        old = lp.detach()

    adv = batch.advantages.to(lp.dtype).unsqueeze(1)
    ratio = torch.exp((lp - old).clamp(max=LOG_RATIO_MAX))
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    raw_w = torch.exp(old - gen).detach()
    cap = cfg.is_truncation_cap
    weight = torch.ones_like(raw_w) if cap is None else raw_w.clamp(max=cap)
    pg = -torch.minimum(ratio * adv, clipped * adv) * weight

    ref = reference_logprobs if reference_logprobs is not None else batch.reference_logprobs
    if cfg.kl_coef > 0 and ref is None:
        raise ValueError(
            "LossConfig.kl_coef > 0 needs reference logprobs (TrainBatch.reference_logprobs "
            "or a trainer with a reference model)"
        )
    kl = None
    per_token = pg
    if ref is not None:
        delta = torch.where(mask, ref.to(lp.dtype), 0.0) - lp
        kl = torch.exp(delta) - delta - 1.0
        if cfg.kl_coef > 0:
            per_token = pg + cfg.kl_coef * kl
    loss_sum = red.aggregate(per_token)

    with torch.no_grad():
        seq_valid = (red.tokens_per_seq > 0).to(lp.dtype)
        metrics = {
            "loss": Metric(loss_sum.detach(), MetricKind.LOSS),
            "pg_loss": Metric(red.aggregate(pg), MetricKind.LOSS),
            "clip_low_frac": Metric(
                red.token_sum((adv < 0) & (ratio < 1.0 - cfg.clip_low)), MetricKind.TOKEN
            ),
            "clip_high_frac": Metric(
                red.token_sum((adv > 0) & (ratio > 1.0 + cfg.clip_high)), MetricKind.TOKEN
            ),
            "is_weight_mean": Metric(red.token_sum(weight), MetricKind.TOKEN),
            "is_truncated_frac": Metric(
                red.token_sum(raw_w > (math.inf if cap is None else cap)), MetricKind.TOKEN
            ),
            "ratio_min": Metric(red.extreme(ratio, MetricKind.MIN), MetricKind.MIN),
            "ratio_max": Metric(red.extreme(ratio, MetricKind.MAX), MetricKind.MAX),
            "logprob_diff_max": Metric(
                red.extreme((old - gen).abs(), MetricKind.MAX), MetricKind.MAX
            ),
            "advantage_mean": Metric((adv.squeeze(1) * seq_valid).sum(), MetricKind.SEQUENCE),
            "num_tokens": Metric(red.maskf.sum(), MetricKind.COUNT),
            "num_sequences": Metric(seq_valid.sum(), MetricKind.COUNT),
        }
        if kl is not None:
            metrics["kl"] = Metric(red.aggregate(kl), MetricKind.LOSS)
    normaliser = (
        MetricKind.SEQUENCE if cfg.aggregation is Aggregation.SEQUENCE else MetricKind.TOKEN
    )
    return LossOutput(loss_sum=loss_sum, normaliser=normaliser, metrics=metrics)
