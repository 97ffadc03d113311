"""Hand-computed cases for the GRPO loss (workers/loss.py)."""

from __future__ import annotations

import math

import pytest
import torch

from workers.batch import TrainBatch
from workers.loss import (
    LOG_RATIO_MAX,
    Aggregation,
    LossOptions,
    MetricKind,
    OldPolicy,
    grpo_loss,
    token_logprobs,
    valid_counts,
)
from workers.models.config import SamplingSection

LN2, LN3 = math.log(2.0), math.log(3.0)


def batch_of(mask: list[list[bool]], gen: list[list[float]], adv: list[float], ref=None):
    m = torch.tensor(mask)
    b, t = m.shape
    return TrainBatch(
        input_ids=torch.ones(b, t, dtype=torch.int64),
        attention_mask=torch.ones(b, t, dtype=torch.bool),
        loss_mask=m,
        generator_logprobs=torch.tensor(gen),
        advantages=torch.tensor(adv),
        reference_logprobs=None if ref is None else torch.tensor(ref),
    )


def run(lp_values, batch, cfg, **kw):
    lp = torch.tensor(lp_values, requires_grad=True)
    out = grpo_loss(lp, batch, cfg, **kw)
    out.loss_sum.backward()
    object.__setattr__(out, "loss_sum", out.loss_sum.detach())
    return out, lp.grad


def close(t: torch.Tensor, expected) -> None:
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), rtol=1e-5, atol=1e-6)


def metric(out, name):
    return float(out.metrics[name].value)


# Row 0: two completion tokens with trainer/generator ratios 3 and 1/2; row 1: one
# token, ratio 1. Advantages +1 and -2.
MASK = [[False, True, True], [False, True, False]]
LP = [[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]]
GEN = [[0.0, -1.0 - LN3, -2.0 + LN2], [0.0, -0.5, 0.0]]
ADV = [1.0, -2.0]


def test_truncated_is_weight_token_level():
    cfg = LossOptions(aggregation=Aggregation.TOKEN, is_cap=2.0)
    out, grad = run(LP, batch_of(MASK, GEN, ADV), cfg)
    # w = min(3, 2) = 2, min(0.5, 2) = 0.5, 1; ratio = 1 so pg_t = -w * A
    assert float(out.loss_sum) == pytest.approx(-(2 * 1 + 0.5 * 1) - (1 * -2.0))
    close(grad, [[0.0, -2.0, -0.5], [0.0, 2.0, 0.0]])
    assert out.normaliser is MetricKind.TOKEN
    assert metric(out, "is_oob_frac") == 1.0
    assert metric(out, "is_weight_mean") == pytest.approx(3.5)
    assert out.metrics["is_weight_mean"].kind is MetricKind.TOKEN
    assert metric(out, "num_tokens") == 3.0
    assert out.metrics["num_tokens"].kind is MetricKind.COUNT
    assert metric(out, "logprob_diff_max") == pytest.approx(LN3)
    assert out.metrics["logprob_diff_max"].kind is MetricKind.MAX


def test_no_is_correction_when_cap_is_none():
    cfg = LossOptions(aggregation=Aggregation.TOKEN, is_correction="none")
    out, grad = run(LP, batch_of(MASK, GEN, ADV), cfg)
    assert float(out.loss_sum) == pytest.approx(-(1 + 1) + 2.0)
    close(grad, [[0.0, -1.0, -1.0], [0.0, 2.0, 0.0]])


def test_sequence_level_aggregation_means_within_each_sequence():
    mask = MASK + [[False, False, False]]  # a sequence without loss tokens is not counted
    gen, adv = GEN + [[0.0, 0.0, 0.0]], ADV + [5.0]
    cfg = LossOptions(aggregation=Aggregation.SEQUENCE, is_correction="none")
    out, grad = run(LP + [[0.0, 0.0, 0.0]], batch_of(mask, gen, adv), cfg)
    # row 0: mean(-1, -1) = -1; row 1: +2; raw sum over sequences = 1
    assert float(out.loss_sum) == pytest.approx(1.0)
    close(grad, [[0, -0.5, -0.5], [0, 2.0, 0], [0, 0, 0]])
    assert out.normaliser is MetricKind.SEQUENCE
    assert metric(out, "num_sequences") == 2.0
    assert metric(out, "advantage_mean") == pytest.approx(1.0 - 2.0)
    assert valid_counts(torch.tensor(mask)) == (2, 3)


# One token per row at t = 1, old logprob -1, ratios 1.5 / 0.5 with both advantage signs.
RATIOS = [1.5, 0.5, 0.5, 1.5]
CLIP_ADV = [1.0, 1.0, -1.0, -1.0]
CLIP_MASK = [[False, True]] * 4
CLIP_OLD = [[0.0, -1.0]] * 4
CLIP_LP = [[0.0, -1.0 + math.log(r)] for r in RATIOS]
# A>0, r=1.5 > 1.28: clipped high, -1.28, no grad
# A>0, r=0.5:        -0.5, grad -r*A = -0.5
# A<0, r=0.5 < 0.8:  clipped low, -min(-0.5, -0.8) = 0.8, no grad
# A<0, r=1.5:        -min(-1.5, -1.28) = 1.5, grad -r*A = 1.5
CLIP_LOSS = -1.28 - 0.5 + 0.8 + 1.5
CLIP_GRAD = [[0.0, 0.0], [0.0, -0.5], [0.0, 0.0], [0.0, 1.5]]


def check_clipping(out, grad):
    assert float(out.loss_sum) == pytest.approx(CLIP_LOSS)
    close(grad, CLIP_GRAD)
    assert metric(out, "clip_high_frac") == 1.0
    assert metric(out, "clip_low_frac") == 1.0
    assert metric(out, "ratio_min") == pytest.approx(0.5)
    assert metric(out, "ratio_max") == pytest.approx(1.5)


def test_asymmetric_clipping_both_sides_with_explicit_old_logprobs():
    cfg = LossOptions(clip_low=0.2, clip_high=0.28, is_cap=2.0)
    batch = batch_of(CLIP_MASK, CLIP_OLD, CLIP_ADV)  # gen == old: IS weight 1
    out, grad = run(CLIP_LP, batch, cfg, old_logprobs=torch.tensor(CLIP_OLD))
    check_clipping(out, grad)


def test_generator_as_old_policy_clips_the_behaviour_ratio():
    cfg = LossOptions(clip_low=0.2, clip_high=0.28, old_policy=OldPolicy.GENERATOR)
    out, grad = run(CLIP_LP, batch_of(CLIP_MASK, CLIP_OLD, CLIP_ADV), cfg)
    check_clipping(out, grad)
    assert metric(out, "is_weight_mean") == pytest.approx(4.0)  # w = 1 on every token


def test_trainer_old_policy_makes_clipping_inert():
    cfg = LossOptions(clip_low=0.2, clip_high=0.28, is_correction="none")
    out, grad = run(CLIP_LP, batch_of(CLIP_MASK, CLIP_OLD, CLIP_ADV), cfg)
    # ratio = exp(lp - sg(lp)) = 1: plain -A * grad(lp) on every token
    close(grad, [[0.0, -a] for a in CLIP_ADV])
    assert metric(out, "clip_high_frac") == 0.0 and metric(out, "clip_low_frac") == 0.0
    assert metric(out, "ratio_min") == metric(out, "ratio_max") == 1.0


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_overflowing_importance_ratio_keeps_gradients_finite(adv):
    # lp - old = 100 > 88: exp overflows float32. For A > 0 the token is clipped high
    # (value -1.28 * A, true gradient 0); for A < 0 the ratio is bounded at e^LOG_RATIO_MAX.
    cfg = LossOptions(clip_low=0.2, clip_high=0.28, is_cap=2.0)
    batch = batch_of([[False, True]], [[0.0, -1.0]], [adv])
    out, grad = run([[0.0, 99.0]], batch, cfg, old_logprobs=torch.tensor([[0.0, -1.0]]))
    assert torch.isfinite(grad).all()
    close(grad, [[0.0, 0.0]])
    assert math.isfinite(float(out.loss_sum))
    if adv > 0:
        assert float(out.loss_sum) == pytest.approx(-1.28)
    else:
        assert float(out.loss_sum) == pytest.approx(math.exp(LOG_RATIO_MAX), rel=1e-5)
    assert all(math.isfinite(float(m.value)) for m in out.metrics.values())


def test_kl_k3_penalty():
    # ref - lp = ln 2 at the only token: k3 = 2 - ln 2 - 1; d k3 / d lp = 1 - e^{ln 2} = -1
    cfg = LossOptions(kl_coef=0.1, is_correction="none")
    batch = batch_of([[False, True]], [[0.0, -1.0]], [0.0], ref=[[0.0, -1.0 + LN2]])
    out, grad = run([[0.0, -1.0]], batch, cfg)
    assert float(out.loss_sum) == pytest.approx(0.1 * (1 - LN2))
    close(grad, [[0.0, -0.1]])
    assert metric(out, "kl") == pytest.approx(1 - LN2)
    assert out.metrics["kl"].kind is MetricKind.LOSS
    # an explicit reference_logprobs argument wins over the batch field; k3(0) = 0
    out2, grad2 = run([[0.0, -1.0]], batch, cfg, reference_logprobs=torch.tensor([[0.0, -1.0]]))
    assert float(out2.loss_sum) == 0.0
    close(grad2, [[0.0, 0.0]])


def test_kl_without_reference_is_an_error():
    batch = batch_of([[False, True]], [[0.0, -1.0]], [1.0])
    with pytest.raises(ValueError, match="reference logprobs"):
        grpo_loss(torch.zeros(1, 2), batch, LossOptions(kl_coef=0.1))


def test_masked_positions_cannot_leak_nan_or_inf():
    mask = [[False, True, False]]
    batch = batch_of(mask, [[-1e9, -1.0, float("nan")]], [1.0], ref=[[1e9, -1.0, -1e9]])
    cfg = LossOptions(kl_coef=0.5)
    out, grad = run([[float("nan"), -1.0, float("inf")]], batch, cfg)
    assert math.isfinite(float(out.loss_sum))
    close(grad, [[0.0, -1.0, 0.0]])
    assert all(math.isfinite(float(m.value)) for m in out.metrics.values())


def test_token_logprobs_alignment_and_temperature():
    logits = torch.tensor([[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0], [2.0, 2.0, 2.0]]])
    ids = torch.tensor([[2, 1, 2]])
    for temp in (1.0, 2.0):
        lp = token_logprobs(logits, ids, temp)
        want = torch.log_softmax(logits / temp, dim=-1)
        assert lp.shape == (1, 3)
        assert lp[0, 0] == 0.0  # nothing predicts position 0
        assert float(lp[0, 1]) == pytest.approx(float(want[0, 0, 1]))
        assert float(lp[0, 2]) == pytest.approx(float(want[0, 1, 2]))


def test_loss_config_validation_names_the_field():
    assert LossOptions(aggregation="sequence").aggregation is Aggregation.SEQUENCE
    with pytest.raises(ValueError, match="aggregation"):
        LossOptions(aggregation="mean")
    with pytest.raises(ValueError, match="clip_low"):
        LossOptions(clip_low=-0.1)
    with pytest.raises(ValueError, match="is_cap"):
        LossOptions(is_cap=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingSection(temperature=0.0)  # the loss's temperature is the generators'
    with pytest.raises(ValueError, match="old_policy"):
        LossOptions(old_policy="behaviour")
