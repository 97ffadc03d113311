"""Every [train.loss] option against the loss written from its formula (tests/loss_reference.py):
value and gradient in float64, on batches with empty rows, a -inf generator logprob,
per-sequence and per-token advantages."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from tests.loss_reference import reference_loss
from workers.batch import TrainBatch
from workers.loss import LossOptions, grpo_loss, token_logprobs_and_entropy

B, T, V = 6, 7, 5


def random_batch(seed: int, *, per_token: bool) -> tuple[TrainBatch, torch.Tensor, torch.Tensor]:
    """(batch, trainer logprobs, reference logprobs) in float64."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[:, 0] = False
    mask[2] = False  # a row without loss-bearing tokens: never counted
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.2
    gen = (lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6).clamp(max=-0.01)
    gen[3, mask[3].nonzero()[0, 0]] = -math.inf
    ref = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.8
    adv = torch.randn((B, T) if per_token else (B,), generator=g, dtype=torch.float64)
    batch = TrainBatch(
        input_ids=torch.ones(B, T, dtype=torch.int64),
        attention_mask=torch.ones(B, T, dtype=torch.bool),
        loss_mask=mask,
        generator_logprobs=gen,
        advantages=adv,
    )
    return batch, lp, ref


#: each option alone (on top of the defaults), then combinations
CASES: dict[str, dict] = {
    "default": {},
    "sequence": {"aggregation": "sequence"},
    "seq_sum": {"aggregation": "seq-mean-token-sum"},
    "seq_sum_norm": {"aggregation": "seq-mean-token-sum-norm", "norm_length": 9},
    "generator_old": {"old_policy": "generator", "clip_low": 0.1, "clip_high": 0.15},
    "dual_clip": {"old_policy": "generator", "dual_clip": 1.5, "clip_high": 0.1},
    "gspo": {"policy_loss": "gspo", "old_policy": "generator", "aggregation": "sequence"},
    "gspo_token_agg": {"policy_loss": "gspo", "old_policy": "generator", "clip_high": 0.05},
    "cispo": {"policy_loss": "cispo", "old_policy": "generator"},
    "is_none": {"is_correction": "none"},
    "tis_min": {"is_min": 0.7, "is_cap": 1.3},
    "icepop": {"is_correction": "icepop", "is_min": 0.6, "is_cap": 1.6},
    "seq_tis": {"is_correction": "seq-tis", "is_min": 0.2, "is_cap": 3.0},
    "seq_mask_tis": {"is_correction": "seq-mask-tis", "is_min": 0.8, "is_cap": 1.25},
    "kl_k1": {"kl_coef": 0.3, "kl_estimator": "k1"},
    "kl_k2": {"kl_coef": 0.3, "kl_estimator": "k2"},
    "kl_k3": {"kl_coef": 0.3},
    "kl_k3_score": {"kl_coef": 0.3, "kl_gradient": "score", "old_policy": "generator"},
    "kl_clamps": {"kl_coef": 0.3, "kl_input_clamp": 0.4, "kl_output_clamp": 0.06},
    "kl_clamps_score": {
        "kl_coef": 0.3, "kl_gradient": "score", "kl_input_clamp": 0.4, "kl_output_clamp": 0.1,
    },
    "kl_reward": {"kl_coef": 0.5, "kl_placement": "reward", "kl_estimator": "k2"},
    "entropy": {"entropy_coef": 0.2},
    "everything": {
        "policy_loss": "gspo", "old_policy": "generator", "is_correction": "seq-mask-tis",
        "is_min": 0.2, "is_cap": 5.0, "dual_clip": 2.0, "kl_coef": 0.2,
        "kl_gradient": "score", "aggregation": "seq-mean-token-sum-norm", "norm_length": 4,
        "entropy_coef": 0.1,
    },
}


def _normaliser(batch: TrainBatch, cfg: LossOptions) -> int:
    mask = batch.loss_mask
    return int(mask.sum()) if cfg.aggregation.value == "token" else int(mask.any(1).sum())


@pytest.mark.parametrize("per_token", [False, True], ids=["per_seq_adv", "per_token_adv"])
@pytest.mark.parametrize("case", list(CASES))
def test_value_and_gradient_match_the_formula(case, per_token):
    cfg = LossOptions(**CASES[case])
    for seed in range(3):
        batch, lp0, ref = random_batch(seed, per_token=per_token)
        entropy = (torch.rand(B, T, dtype=torch.float64) + 0.5).requires_grad_()
        lp = lp0.clone().requires_grad_()
        out = grpo_loss(lp, batch, cfg, reference_logprobs=ref, entropy=entropy)
        got = out.loss_sum / _normaliser(batch, cfg)
        got.backward()
        lp_want = lp0.clone().requires_grad_()
        ent_want = entropy.detach().clone().requires_grad_()
        want = reference_loss(lp_want, batch, cfg, ref=ref, entropy=ent_want)
        want.backward()
        torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(lp.grad, lp_want.grad, rtol=1e-12, atol=1e-14)
        if cfg.entropy_coef:
            torch.testing.assert_close(entropy.grad, ent_want.grad, rtol=1e-12, atol=1e-14)
        assert float(lp.grad.abs().sum()) > 0  # the case exercises a gradient


def test_explicit_old_logprobs_override_the_old_policy():
    cfg = LossOptions(policy_loss="gspo", is_correction="seq-tis", is_cap=4.0)
    batch, lp0, ref = random_batch(7, per_token=False)
    old = lp0 + 0.3 * torch.sin(torch.arange(B * T, dtype=torch.float64).view(B, T))
    lp = lp0.clone().requires_grad_()
    got = grpo_loss(lp, batch, cfg, old_logprobs=old).loss_sum / _normaliser(batch, cfg)
    got.backward()
    lp_want = lp0.clone().requires_grad_()
    want = reference_loss(lp_want, batch, cfg, old=old)
    want.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lp.grad, lp_want.grad, rtol=1e-12, atol=1e-14)


def test_gspo_token_form_has_the_sequence_level_gradient():
    """With one advantage and one weight per sequence (seq-tis, no unusable token) the
    per-token form has exactly the gradient of GSPO's sequence-level objective."""
    cfg = LossOptions(policy_loss="gspo", old_policy="generator", is_correction="seq-tis",
                     is_cap=9.0, aggregation="sequence", clip_low=0.25, clip_high=0.3)
    for seed in range(3):
        batch, lp0, _ = random_batch(seed, per_token=False)
        gen = batch.generator_logprobs
        batch = TrainBatch(**{**_fields(batch), "generator_logprobs": gen.clamp(min=-5.0)})
        lp = lp0.clone().requires_grad_()
        (grpo_loss(lp, batch, cfg).loss_sum / _normaliser(batch, cfg)).backward()
        lp_want = lp0.clone().requires_grad_()
        reference_loss(lp_want, batch, cfg, gspo_sequence=True).backward()
        torch.testing.assert_close(lp.grad, lp_want.grad, rtol=1e-12, atol=1e-14)
        assert float(lp.grad.abs().sum()) > 0


def test_entropy_is_the_vocabulary_entropy_and_its_gradient():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, V, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (2, 4), generator=g)
    lp, ent = token_logprobs_and_entropy(logits, ids, 0.7, entropy_grad=True)
    p = torch.softmax(logits[:, :-1] / 0.7, dim=-1)
    want = -(p * torch.log(p)).sum(-1)
    torch.testing.assert_close(ent[:, 1:], want, rtol=1e-12, atol=1e-14)
    assert torch.all(ent[:, 0] == 0)
    (g1,) = torch.autograd.grad(ent.sum(), logits)
    (g2,) = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-13)
    _, detached = token_logprobs_and_entropy(logits, ids, 0.7)
    assert not detached.requires_grad


def test_a_neg_inf_generator_logprob_gets_weight_zero_and_is_counted():
    batch, lp0, _ = random_batch(1, per_token=False)
    b, t = 3, int(batch.loss_mask[3].nonzero()[0, 0])
    for cfg in (LossOptions(), LossOptions(old_policy="generator", is_correction="none")):
        lp = lp0.clone().requires_grad_()
        out = grpo_loss(lp, batch, cfg)
        out.loss_sum.backward()
        assert lp.grad[b, t] == 0.0  # not the cap: the token cannot be reweighted
        assert float(out.metrics["gen_logprob_invalid"].value) == 1.0
        assert all(math.isfinite(float(m.value)) for m in out.metrics.values())
        # it still counts in the normaliser, like a token IcePop drops
        assert float(out.metrics["num_tokens"].value) == int(batch.loss_mask.sum())


def test_nan_generator_logprob_is_treated_like_neg_inf():
    batch, lp0, _ = random_batch(2, per_token=False)
    gen = batch.generator_logprobs.clone()
    b, t = 1, int(batch.loss_mask[1].nonzero()[0, 0])
    gen[b, t] = math.nan
    bad = TrainBatch(**{**_fields(batch), "generator_logprobs": gen})
    lp = lp0.clone().requires_grad_()
    out = grpo_loss(lp, bad, LossOptions(policy_loss="gspo", old_policy="generator"))
    out.loss_sum.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[b, t] == 0.0
    assert float(out.metrics["gen_logprob_invalid"].value) == 2.0  # with row 3's -inf


def _fields(batch: TrainBatch) -> dict:
    names = ("input_ids", "attention_mask", "loss_mask", "generator_logprobs", "advantages")
    return {n: getattr(batch, n) for n in names}


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"aggregation": "mean"}, "aggregation"),
        ({"policy_loss": "ppo2"}, "policy_loss"),
        ({"old_policy": "behaviour"}, "old_policy"),
        ({"is_correction": "truncate"}, "is_correction"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"kl_placement": "advantage"}, "kl_placement"),
        ({"kl_gradient": "forward"}, "kl_gradient"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"dual_clip": 0.9}, "dual_clip"),
        ({"dual_clip": 3.0, "policy_loss": "cispo"}, "dual_clip"),
        ({"is_cap": 0.0}, "is_cap"),
        ({"is_min": 2.5}, "is_min"),
        ({"kl_coef": math.nan}, "kl_coef"),
        ({"kl_input_clamp": -1.0}, "kl_input_clamp"),
        ({"kl_output_clamp": math.inf}, "kl_output_clamp"),
        ({"entropy_coef": -0.1}, "entropy_coef"),
        ({"mismatch_kl_warn": -1.0}, "mismatch_kl_warn"),
        ({"norm_length": -3}, "norm_length"),
    ],
)
def test_a_bad_value_names_its_key(kwargs, key):
    with pytest.raises(ValueError, match=rf"^train\.loss\.{key} = "):
        LossOptions(**kwargs)


def test_options_resolve_norm_length_from_the_generation_budget():
    from workers.loss.config import norm_length

    opts = msgspec.convert({"aggregation": "seq-mean-token-sum-norm"}, LossOptions)
    assert norm_length(opts, max_new_tokens=6) == 6
    pinned = msgspec.convert({"aggregation": "seq-mean-token-sum-norm", "norm_length": 32}, LossOptions)
    assert norm_length(pinned, max_new_tokens=6) == 32
    # no constant and no generation budget: the loss names the key instead of dividing by 0
    batch, lp, _ = random_batch(0, per_token=False)
    with pytest.raises(ValueError, match=r"^train\.loss\.norm_length = 0: "):
        grpo_loss(lp, batch, opts)
    sums = [grpo_loss(lp, batch, o, max_new_tokens=6).loss_sum for o in (opts, pinned)]
    torch.testing.assert_close(sums[0] * 6, sums[1] * 32, rtol=1e-12, atol=1e-14)


def test_token_versions_decide_which_tokens_the_mismatch_covers():
    """Per-token versions (from the rows) win over the sample's version; without either,
    every token counts."""
    from workers.batch import collate
    from workers.loss import current_tokens

    def row(n, versions):
        return {
            "input_ids": torch.arange(1, n + 1), "loss_mask": torch.arange(n) > 0,
            "generator_logprobs": -torch.ones(n), "token_versions": torch.tensor(versions),
        }

    batch = collate([row(4, [0, 2, 3, 3]), row(3, [0, 3, 3])], [1.0, -1.0], [2, 3])
    assert batch.token_versions[0].tolist() == [0, 2, 3, 3]
    assert batch.token_versions[1, :3].tolist() == [0, 3, 3]  # then padding
    assert current_tokens(batch, 3).tolist() == [[False, False, True, True], [False, True, True, False]]
    plain = collate([{k: v for k, v in row(3, [0, 1, 1]).items() if k != "token_versions"}],
                    [1.0], [1])
    assert current_tokens(plain, 1).tolist() == [[False, True, True]]
    assert current_tokens(plain, 2).tolist() == [[False, False, False]]
    unknown = collate([{k: v for k, v in row(3, [0, 1, 1]).items() if k != "token_versions"}], [1.0])
    assert current_tokens(unknown, 7).tolist() == [[False, True, True]]
