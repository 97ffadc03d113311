"""The peers' published unit-test figures, reproduced by workers.loss.

NeMo-RL (tests/unit/algorithms/test_loss_functions.py) and verl (tests/trainer/ppo/:
core_algos, loss aggregation, standard PPO, rollout correction) state expected numbers
for small hand-made inputs. Those inputs and numbers are used here as expectations;
the peers' own tolerance (mostly rtol 1e-3 on four printed digits) is kept where their
figure is rounded, and 1e-12 where the figure follows from a closed form.

NeMo-RL's setup: one sample of four positions, the first masked, so three tokens;
``prev_logprobs`` is our explicit ``old_logprobs``; its clip is 0.2 on both sides; its
importance-sampling correction (off by default) is our ``is_correction``.
"""

from __future__ import annotations

import math

import pytest
import torch

from workers.batch import TrainBatch
from workers.loss import LossOptions, grpo_loss
from workers.loss import kl as klmod
from workers.loss.aggregation import Reducer

NEMO = {"clip_low": 0.2, "clip_high": 0.2, "is_correction": "none"}
#: "untruncated" IS weights (NeMo-RL's use_importance_sampling_correction alone)
RAW_IS = {"is_correction": "tis", "is_cap": 1e6}
ADV = [1.0, -1.0, 2.0]
PREV = [-1.0, -1.0, -1.0]
CURR = [-1.69315, -1.0, -0.59453]  # ratios ~0.5, 1.0, 1.5 against PREV
GEN = [-0.5, -1.5, -0.8]


def nemo_batch(adv, gen=None, rows: int = 1) -> TrainBatch:
    pad = lambda row: [0.0, *row]  # noqa: E731
    gen = gen or [0.0, 0.0, 0.0]
    return TrainBatch(
        input_ids=torch.ones(rows, 4, dtype=torch.int64),
        attention_mask=torch.ones(rows, 4, dtype=torch.bool),
        loss_mask=torch.tensor([[False, True, True, True]] * rows),
        generator_logprobs=torch.tensor([pad(gen)] * rows, dtype=torch.float64),
        advantages=torch.tensor([pad(a) for a in (adv if rows > 1 else [adv])], dtype=torch.float64),
    )


def t2(rows) -> torch.Tensor:
    return torch.tensor([[0.0, *r] for r in rows], dtype=torch.float64)


def mean_loss(cfg: LossOptions, batch: TrainBatch, curr, prev=None, **kw) -> torch.Tensor:
    lp = t2(curr).requires_grad_()
    out = grpo_loss(lp, batch, cfg, old_logprobs=None if prev is None else t2(prev), **kw)
    n = batch.num_tokens if cfg.aggregation.value == "token" else int(batch.loss_mask.any(1).sum())
    return out.loss_sum.detach() / n, out, lp


def test_nemo_ppo_clipping():
    loss, _, _ = mean_loss(LossOptions(**NEMO), nemo_batch(ADV), [CURR], [PREV])
    assert float(loss) == pytest.approx(-0.6333, rel=1e-3)  # (-0.5 + 1.0 - 2.4) / 3


def test_nemo_dual_clip():
    cfg = LossOptions(**NEMO, dual_clip=3.0)
    curr, prev = [-1.69315, -1.0, -0.69741], [-1.0, -1.0, -3.0]  # ratios 0.5, 1, 10
    loss, out, _ = mean_loss(cfg, nemo_batch([1.0, -1.0, -4.0]), [curr], [prev])
    assert float(loss) == pytest.approx(4.1667, rel=1e-3)  # (-0.5 + 1.0 + 12.0) / 3
    assert float(out.metrics["dual_clip_frac"].value) == 1.0


def test_nemo_cispo_and_with_importance_weights():
    r = torch.tensor([math.exp(c - p) for c, p in zip(CURR, PREV)]).clamp(0.8, 1.2)
    per_token = [-a * float(ri) * c for a, ri, c in zip(ADV, r, CURR)]
    cfg = LossOptions(**{**NEMO, "policy_loss": "cispo"})
    loss, _, _ = mean_loss(cfg, nemo_batch(ADV), [CURR], [PREV])
    assert float(loss) == pytest.approx(sum(per_token) / 3, rel=1e-3)
    w = [math.exp(p - g) for p, g in zip(PREV, GEN)]
    cfg = LossOptions(**{**NEMO, **RAW_IS, "policy_loss": "cispo"})
    loss, _, _ = mean_loss(cfg, nemo_batch(ADV, GEN), [CURR], [PREV])
    assert float(loss) == pytest.approx(sum(x * y for x, y in zip(w, per_token)) / 3, rel=1e-3)


def test_nemo_importance_weighted_ppo():
    cfg = LossOptions(**{**NEMO, **RAW_IS})
    loss, _, _ = mean_loss(cfg, nemo_batch(ADV, GEN), [CURR], [PREV])
    assert float(loss) == pytest.approx(-0.2065, rel=1e-3)


@pytest.mark.parametrize("seq_level, figure", [(False, -0.4744), (True, -0.4846)])
def test_nemo_truncated_importance_sampling(seq_level, figure):
    extra = (
        {"policy_loss": "gspo", "is_correction": "seq-tis", "aggregation": "sequence"}
        if seq_level
        else {"is_correction": "tis"}
    )
    cfg = LossOptions(**{**NEMO, **extra, "is_cap": 0.8})
    loss, _, _ = mean_loss(cfg, nemo_batch(ADV, GEN), [CURR], [PREV])
    assert float(loss) == pytest.approx(figure, rel=1e-3)


def test_nemo_icepop_drops_the_stale_token():
    cfg = LossOptions(**{**NEMO, "is_correction": "icepop", "is_min": 0.5, "is_cap": 5.0})
    gen = [-0.5, -3.5, -0.8]  # weights 0.6065, 12.18 (dropped), 0.8187
    loss, out, _ = mean_loss(cfg, nemo_batch(ADV, gen), [PREV], [PREV])
    want = (-math.exp(-0.5) * 1.0 + 0.0 - math.exp(-0.2) * 2.0) / 3
    assert float(loss) == pytest.approx(want, rel=1e-12)
    assert float(out.metrics["is_oob_frac"].value) == 1.0


def test_nemo_tis_reports_out_of_bounds_tokens():
    cfg = LossOptions(**{**NEMO, "is_correction": "tis", "is_cap": 2.0})
    prev = [math.log(1.0), math.log(3.0), math.log(0.5)]
    _, out, _ = mean_loss(cfg, nemo_batch([1.0] * 3, [0.0] * 3), [[0.0] * 3], [prev])
    assert float(out.metrics["is_oob_frac"].value) / 3 == pytest.approx(1 / 3)


@pytest.mark.parametrize("tis_min, weights, oob", [(0.0, [0.1, 1.0, 2.0], 1), (0.5, [0.5, 1.0, 2.0], 2)])
def test_nemo_tis_lower_bound(tis_min, weights, oob):
    # force_on_policy_ratio is our default old_policy = "trainer" (ratio 1)
    cfg = LossOptions(clip_low=0.2, clip_high=0.2, is_min=tis_min, is_cap=2.0)
    curr = [math.log(0.1), 0.0, math.log(3.0)]
    loss, out, _ = mean_loss(cfg, nemo_batch([1.0] * 3, [0.0] * 3), [curr])
    assert float(loss) == pytest.approx(-sum(weights) / 3, rel=1e-12)
    assert float(out.metrics["is_oob_frac"].value) == oob


def test_nemo_seq_mask_tis_and_a_neg_inf_generator_logprob():
    cfg = LossOptions(**{**NEMO, "is_correction": "seq-mask-tis", "is_min": 0.999, "is_cap": 1.002})
    gen = [-1.0005] * 3
    loss, _, _ = mean_loss(cfg, nemo_batch(ADV, gen), [PREV], [PREV])
    assert float(loss) == pytest.approx(math.exp(0.0005) * -2.0 / 3, rel=1e-3)
    loss, out, _ = mean_loss(cfg, nemo_batch(ADV, [-1.0005, -1.0005, -math.inf]), [PREV], [PREV])
    assert math.isfinite(float(loss))
    assert float(out.metrics["gen_logprob_invalid"].value) == 1.0


def test_nemo_gspo_batch_of_one_and_two():
    cfg = LossOptions(**{**NEMO, "policy_loss": "gspo", "aggregation": "sequence"})
    loss, _, _ = mean_loss(cfg, nemo_batch(ADV), [CURR], [PREV])
    assert float(loss) == pytest.approx(-0.6057, rel=1e-3)
    loss, _, _ = mean_loss(cfg, nemo_batch([ADV, ADV], rows=2), [CURR, CURR], [PREV, [-2.0] * 3])
    assert float(loss) == pytest.approx(-0.4912, rel=1e-3)


def test_nemo_gspo_with_sequence_importance_weight():
    cfg = LossOptions(**{**NEMO, **RAW_IS, "policy_loss": "gspo", "is_correction": "seq-tis",
                        "aggregation": "sequence"})
    loss, _, _ = mean_loss(cfg, nemo_batch(ADV, GEN), [CURR], [PREV])
    assert float(loss) == pytest.approx(-0.4959, rel=1e-3)


def test_nemo_kl_penalty_value():
    cfg = LossOptions(**NEMO, kl_coef=0.1)
    ref = t2([[-1.0, -1.0, -1.0]])
    loss, out, _ = mean_loss(cfg, nemo_batch([0.0] * 3), [[0.0, -1.0, -2.0]], [[0.0] * 3],
                             reference_logprobs=ref)
    assert float(loss) == pytest.approx(0.0362, rel=1e-3)
    assert float(out.metrics["kl"].value) / 3 == pytest.approx(0.362, rel=1e-3)


@pytest.mark.parametrize("on_policy_approx", [False, True])
def test_nemo_kl_gradient_includes_the_sampling_term(on_policy_approx):
    """NeMo-RL's KL term is ratio-weighted (our kl_gradient = "score"): its gradient is
    beta * w * (k3 + 1 - e^{ref - curr}) / N, w = 1 or pi / mu (old = the generator)."""
    curr, gen, ref = [-1.2, -0.7], [-1.5, -0.4], [-0.9, -1.1]
    batch = TrainBatch(
        input_ids=torch.zeros(1, 3, dtype=torch.int64),
        attention_mask=torch.ones(1, 3, dtype=torch.bool),
        loss_mask=torch.tensor([[False, True, True]]),
        generator_logprobs=t2([gen]),
        advantages=t2([[0.4, -0.2]]),
    )
    old_policy = "generator" if on_policy_approx else "trainer"

    def grad(beta: float) -> torch.Tensor:
        cfg = LossOptions(kl_coef=beta, kl_gradient="score", old_policy=old_policy)
        lp = t2([curr]).requires_grad_()
        (grpo_loss(lp, batch, cfg, reference_logprobs=t2([ref])).loss_sum / 2).backward()
        return lp.grad[0, 1:]

    c, r, g = (torch.tensor(x, dtype=torch.float64) for x in (curr, ref, gen))
    k3 = torch.exp(r - c) - 1 - (r - c)
    w = torch.exp(c - g) if on_policy_approx else torch.ones(2, dtype=torch.float64)
    want = 0.3 * w * (k3 + 1 - torch.exp(r - c)) / 2
    torch.testing.assert_close(grad(0.3) - grad(0.0), want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_nemo_kl_estimators_and_clamps(estimator):
    lp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -15.0, -30.0]], dtype=torch.float64)
    unclamped = {"k1": [-1.0, 14.0, 29.0], "k2": [0.5, 98.0, 420.5], "k3": [0.7183, 13.0, 28.0]}
    clamped = {"k1": [-1.0, 10.0, 10.0], "k2": [0.5, 10.0, 10.0], "k3": [0.7183, 10.0, 10.0]}
    for clamps, want in (((0.0, 0.0), unclamped), ((20.0, 10.0), clamped)):
        cfg = LossOptions(kl_coef=1.0, kl_estimator=estimator, kl_input_clamp=clamps[0],
                         kl_output_clamp=clamps[1])
        got = klmod.loss_term(lp, lp, ref, cfg)
        torch.testing.assert_close(got, torch.tensor([want[estimator]], dtype=torch.float64),
                                   rtol=1e-3, atol=0)


def test_nemo_input_clamp_detaches_the_score_weight():
    lp = torch.tensor([[-3.0, -1.0]], dtype=torch.float64, requires_grad=True)
    cfg = LossOptions(kl_coef=1.0, kl_gradient="score", kl_input_clamp=2.0, kl_output_clamp=0.0)
    kl = klmod.loss_term(lp, lp.detach(), torch.zeros_like(lp), cfg)
    torch.testing.assert_close(kl.detach(), torch.tensor([[4.389056, 0.7182818]], dtype=torch.float64))
    kl.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1.0]], dtype=torch.float64))


def test_nemo_output_clamp_includes_the_score_weight():
    lp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    cfg = LossOptions(kl_coef=1.0, kl_gradient="score", kl_input_clamp=0.0, kl_output_clamp=1.0)
    old = lp.detach() - math.log(100.0)  # score weight pi / pi_old = 100 in value
    kl = klmod.loss_term(lp, old, torch.zeros_like(lp), cfg)
    assert float(kl.detach()) == 1.0
    kl.sum().backward()
    assert float(lp.grad) == 0.0


# -- verl ----------------------------------------------------------------------------


def test_verl_standard_and_dual_clip_ppo():
    batch = TrainBatch(
        input_ids=torch.ones(1, 2, dtype=torch.int64),
        attention_mask=torch.ones(1, 2, dtype=torch.bool),
        loss_mask=torch.tensor([[False, True]]),
        generator_logprobs=torch.zeros(1, 2, dtype=torch.float64),
        advantages=torch.tensor([-1.0], dtype=torch.float64),
    )
    lp = torch.tensor([[0.0, math.log(10.0)]], dtype=torch.float64)
    old = torch.zeros(1, 2, dtype=torch.float64)
    for dual, figure in ((0.0, 10.0), (3.0, 3.0)):
        cfg = LossOptions(clip_low=0.2, clip_high=0.2, dual_clip=dual, is_correction="none")
        assert float(grpo_loss(lp, batch, cfg, old_logprobs=old).loss_sum) == pytest.approx(figure)


VERL_LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]],
                         dtype=torch.float64)
VERL_MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("norm_length, figure", [(4, 2.5), (10, 1.0)])
def test_verl_seq_mean_token_sum_norm(norm_length, figure):
    from workers.loss import Aggregation

    red = Reducer(VERL_MASK, Aggregation.SEQUENCE_SUM_NORM, torch.float64, norm_length)
    assert float(red.aggregate(VERL_LOSS) / red.seq_valid.sum()) == pytest.approx(figure, rel=1e-12)


def test_verl_seq_mean_token_sum_norm_gradient():
    from workers.loss import Aggregation

    x = VERL_LOSS.clone().requires_grad_()
    red = Reducer(VERL_MASK, Aggregation.SEQUENCE_SUM_NORM, torch.float64, 8)
    (red.aggregate(x) / red.seq_valid.sum()).backward()
    torch.testing.assert_close(x.grad, VERL_MASK.double() / (3 * 8), rtol=1e-12, atol=0)


def test_verl_rollout_correction_mask_mode():
    """verl's mask mode: ratios ~0.37 (rejected by [0.5, 2.0]) and ~1.65 (kept); half
    the tokens masked. Our icepop drops the same tokens."""
    old = torch.full((2, 6), -2.0, dtype=torch.float64)
    gen = torch.tensor([[0.0] + [-1.0] * 5, [0.0] + [-2.5] * 5], dtype=torch.float64)
    batch = TrainBatch(
        input_ids=torch.ones(2, 6, dtype=torch.int64),
        attention_mask=torch.ones(2, 6, dtype=torch.bool),
        loss_mask=torch.tensor([[False] + [True] * 5] * 2),
        generator_logprobs=gen,
        advantages=torch.ones(2, dtype=torch.float64),
    )
    tis = LossOptions(is_cap=1e6)
    w = grpo_loss(old, batch, tis, old_logprobs=old).metrics["is_weight_mean"].value / 10
    assert float(w) == pytest.approx((0.368 + 1.649) / 2, abs=0.01)
    pop = LossOptions(is_correction="icepop", is_min=0.5, is_cap=2.0)
    out = grpo_loss(old, batch, pop, old_logprobs=old)
    assert float(out.metrics["is_oob_frac"].value) / 10 == pytest.approx(0.5)
    assert float(out.metrics["is_weight_mean"].value) / 5 == pytest.approx(math.exp(0.5))
