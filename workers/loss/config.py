"""``[train.loss]``: the typed options of the GRPO loss, validated where they are built.

:class:`LossOptions` is the TOML table (``TrainSection.loss``); a train step runs with a
:class:`StepLoss`: those options beside the generators' ``[sampling]`` table (its
temperature; its ``max_new_tokens`` as the Dr. GRPO length). Every choice is an
``Enum`` (decoded from its string value), every bad value a ``ValueError`` that names
``train.loss.<key>``.
The formulas each option selects are in the ``workers.loss`` docstring and docs/loss.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import msgspec

from workers.loss.metrics import MetricKind
from workers.models.config import SamplingSection


class Aggregation(str, Enum):
    """How per-token losses become the step's loss (and so which count divides it)."""

    #: sum over all valid tokens / N_tokens (verl ``token-mean``)
    TOKEN = "token"
    #: mean over each sequence's tokens, summed / N_sequences (verl ``seq-mean-token-mean``)
    SEQUENCE = "sequence"
    #: sum over each sequence's tokens, summed / N_sequences (verl ``seq-mean-token-sum``)
    SEQUENCE_SUM = "seq-mean-token-sum"
    #: as SEQUENCE_SUM, each sequence also divided by the constant ``norm_length`` (Dr. GRPO)
    SEQUENCE_SUM_NORM = "seq-mean-token-sum-norm"

    @property
    def normaliser(self) -> MetricKind:
        """The global count the step's summed loss is divided by."""
        return MetricKind.TOKEN if self is Aggregation.TOKEN else MetricKind.SEQUENCE


class PolicyLoss(str, Enum):
    """The policy-gradient surrogate."""

    #: clipped ratio per token (PPO / GRPO / DAPO clip-higher)
    PPO = "ppo"
    #: one ratio per sequence, the geometric mean of its token ratios, clipped (GSPO)
    GSPO = "gspo"
    #: REINFORCE term weighted by the clipped, detached ratio (CISPO, MiniMax-M1)
    CISPO = "cispo"


class OldPolicy(str, Enum):
    """Which logprobs the PPO ratio is taken against (see the module docstring)."""

    #: sg(current trainer logprobs): ratio = 1, staleness handled by the importance weight
    TRAINER = "trainer"
    #: the generator's logprobs: ratio = pi_theta / mu, clipped; no separate IS weight
    GENERATOR = "generator"


class ISCorrection(str, Enum):
    """The importance weight that moves tokens sampled from mu towards pi_old."""

    #: every weight 1
    NONE = "none"
    #: per token, clamped to [is_min, is_cap] (truncated IS)
    TIS = "tis"
    #: per token, 0 outside [is_min, is_cap], else the raw ratio (IcePop)
    ICEPOP = "icepop"
    #: per sequence, the product of its token ratios clamped to [is_min, is_cap]
    SEQ_TIS = "seq-tis"
    #: raw token ratios; a sequence whose geometric-mean ratio leaves [is_min, is_cap] gets 0
    SEQ_MASK_TIS = "seq-mask-tis"

    @property
    def per_sequence(self) -> bool:
        return self in (ISCorrection.SEQ_TIS, ISCorrection.SEQ_MASK_TIS)


class KLEstimator(str, Enum):
    """Per-token estimator of KL(pi_theta || pi_ref) from d = log pi_ref - log pi_theta."""

    K1 = "k1"  # -d
    K2 = "k2"  # d^2 / 2
    K3 = "k3"  # e^d - d - 1 (verl low_var_kl)


class KLPlacement(str, Enum):
    """Where the KL penalty acts."""

    #: beta * KL term added to the per-token loss (verl use_kl_loss, NeMo-RL's default)
    LOSS = "loss"
    #: -beta * KL of the sampling policy added to every token's advantage (no gradient)
    REWARD = "reward"


class KLGradient(str, Enum):
    """Which gradient the in-loss KL term carries (docs/loss.md has the table)."""

    #: grad(beta * k): for k3 the expected gradient of KL(pi_ref || pi_theta) (verl)
    DIRECT = "direct"
    #: grad(beta * r * k), r = pi_theta / pi_old: the expected gradient of
    #: KL(pi_theta || pi_ref) for k1 and k3 (NeMo-RL)
    SCORE = "score"


def _bad(key: str, value: object, why: str) -> ValueError:
    return ValueError(f"train.loss.{key} = {value!r}: {why}")


class LossOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[train.loss]``: the GRPO objective (``workers.loss``); validated on construction."""

    aggregation: Aggregation = Aggregation.TOKEN
    """token | sequence | seq-mean-token-sum | seq-mean-token-sum-norm (verl's names)."""
    norm_length: int = 0
    """seq-mean-token-sum-norm's constant per-sequence divisor; 0 = sampling.max_new_tokens."""
    policy_loss: PolicyLoss = PolicyLoss.PPO
    """ppo | gspo | cispo."""
    clip_low: float = 0.2
    """The ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.28
    """The ratio is clipped above at 1 + clip_high (asymmetric: DAPO clip-higher)."""
    dual_clip: float = 0.0
    """Dual-clip PPO: for A < 0 the token loss is at most -c * A; 0 = off, else c > 1."""
    old_policy: OldPolicy = OldPolicy.TRAINER
    """trainer: pi_old = sg(pi_theta); generator: pi_old = the generator's policy mu."""
    kl_coef: float = 0.0
    """beta of the KL penalty to the frozen reference model; > 0 keeps one."""
    kl_estimator: KLEstimator = KLEstimator.K3
    """k1 | k2 | k3."""
    kl_placement: KLPlacement = KLPlacement.LOSS
    """loss | reward."""
    kl_gradient: KLGradient = KLGradient.DIRECT
    """direct (verl) | score (NeMo-RL): which KL's gradient the loss term follows."""
    kl_input_clamp: float = 20.0
    """|log pi_ref - log pi_theta| is clamped here before the estimator; 0 = off."""
    kl_output_clamp: float = 10.0
    """|per-token KL term| is clamped here; 0 = off."""
    is_correction: ISCorrection = ISCorrection.TIS
    """none | tis | icepop | seq-tis | seq-mask-tis: the weight pi_old / mu."""
    is_cap: float = 2.0
    """Upper bound of the importance weight (truncated, or masked for icepop/seq-mask-tis)."""
    is_min: float = 0.0
    """Lower bound of the importance weight (0 = none for tis)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss gets -entropy_coef * H(pi_theta) per token; 0 = metric only."""
    mismatch_kl_warn: float = 0.01
    """Warn when KL(mu || pi) at the trainer's own version exceeds this; 0 = never."""

    def __post_init__(self) -> None:
        for name, enum in (
            ("aggregation", Aggregation), ("policy_loss", PolicyLoss),
            ("old_policy", OldPolicy), ("is_correction", ISCorrection),
            ("kl_estimator", KLEstimator), ("kl_placement", KLPlacement),
            ("kl_gradient", KLGradient),
        ):
            _coerce(self, name, enum)
        for name in (
            "clip_low", "clip_high", "dual_clip", "is_min", "kl_coef", "kl_input_clamp",
            "kl_output_clamp", "entropy_coef", "mismatch_kl_warn",
        ):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise _bad(name, value, "must be a finite number >= 0")
        if self.clip_low >= 1:
            raise _bad("clip_low", self.clip_low, "must be < 1 (the lower bound is 1 - clip_low)")
        if self.dual_clip and self.dual_clip <= 1:
            raise _bad("dual_clip", self.dual_clip, "must be > 1 (or 0 = off); verl uses 3")
        if self.dual_clip and self.policy_loss is PolicyLoss.CISPO:
            raise _bad("dual_clip", self.dual_clip, "cannot combine with policy_loss = \"cispo\"")
        if not (math.isfinite(self.is_cap) and self.is_cap > 0):
            raise _bad("is_cap", self.is_cap, "must be a finite number > 0")
        if self.is_min > self.is_cap:
            raise _bad("is_min", self.is_min, f"must be <= train.loss.is_cap ({self.is_cap})")
        if not (isinstance(self.norm_length, int) and self.norm_length >= 0):
            raise _bad("norm_length", self.norm_length, "must be an integer >= 0")


@dataclass(frozen=True)
class StepLoss:
    """What one train step's loss runs with: the user's ``[train.loss]`` at the
    generators' ``[sampling]`` -- the trainer takes its logprobs at their temperature,
    and ``norm_length`` 0 means their ``max_new_tokens`` (Dr. GRPO's constant). Both
    tables as they are, so no value is a copy of either."""

    options: LossOptions = field(default_factory=LossOptions)
    sampling: SamplingSection = field(default_factory=SamplingSection)


def norm_length(cfg: LossOptions, max_new_tokens: int) -> int:
    """``train.loss.norm_length``, else the generation budget ``max_new_tokens`` (Dr.
    GRPO's constant)."""
    length = cfg.norm_length or max_new_tokens
    if cfg.aggregation is Aggregation.SEQUENCE_SUM_NORM and length <= 0:
        raise _bad(
            "norm_length", cfg.norm_length,
            "seq-mean-token-sum-norm needs a constant > 0 (set it, or give the generation "
            "budget, sampling.max_new_tokens)",
        )
    return length


def _coerce(cfg: LossOptions, name: str, enum: type[Enum]) -> None:
    """Accept an enum member or its string value; anything else names the key."""
    value = getattr(cfg, name)
    if isinstance(value, enum):
        return
    try:
        msgspec.structs.force_setattr(cfg, name, enum(value))
    except ValueError:
        choices = " | ".join(str(e.value) for e in enum)
        raise _bad(name, value, f"expected one of {choices}") from None
