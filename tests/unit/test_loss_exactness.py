"""A step split into microbatches equals the one-shot step, for every option family, in
float64 (<= 1e-12): the loss's own sums first, then the torch trainer's weights.

Includes the options whose normaliser spans microbatches (sequence counts for GSPO and
the seq-mean-* aggregations, Dr. GRPO's constant length). Data parallel world size 2 is
tests/integration/test_loss_options_dp2.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.loss_helpers import FAMILIES, family_batch
from tests.trainer_helpers import (
    ADAMW64,
    EXACT_F64,
    FACTORY,
    SGD64,
    max_param_diff,
    metric_tolerance,
    split,
)
from workers.loss import grpo_loss
from workers.trainer.torch_backend import TorchTrainer

PARTITIONS = {"uneven3": [3, 1, 4], "singletons": [1] * 8}


def _loss_and_grad(batch, cfg, lp0, ref, parts):
    """(L, dL/dlp) with L summed over microbatches and divided once by the global N."""
    mask = batch.loss_mask
    n = int(mask.sum()) if cfg.aggregation.value == "token" else int(mask.any(1).sum())
    lp = lp0.clone().requires_grad_()
    total = 0.0
    start = 0
    for size in parts:
        rows = slice(start, start + size)
        out = grpo_loss(lp[rows], batch.select(rows), cfg, reference_logprobs=ref[rows],
                        entropy=torch.ones_like(lp0[rows]), trainer_version=1)
        total = total + out.loss_sum
        start += size
    loss = total / n
    loss.backward()
    return loss.detach(), lp.grad


@pytest.mark.parametrize("per_token", [False, True], ids=["per_seq_adv", "per_token_adv"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_sums_split_like_one_shot(family, per_token):
    cfg = FAMILIES[family].options
    batch = family_batch(11, per_token=per_token)
    g = torch.Generator().manual_seed(5)
    lp0 = torch.where(batch.loss_mask, -torch.rand(batch.loss_mask.shape, generator=g,
                                                   dtype=torch.float64) * 3 - 0.5, 0.0)
    ref = lp0 + torch.randn(lp0.shape, generator=g, dtype=torch.float64) * 0.5
    want, want_grad = _loss_and_grad(batch, cfg, lp0, ref, [8])
    assert float(want_grad.abs().sum()) > 0
    for parts in PARTITIONS.values():
        got, grad = _loss_and_grad(batch, cfg, lp0, ref, parts)
        assert abs(float(got - want)) <= 1e-12 * max(1.0, abs(float(want)))
        assert float((grad - want_grad).abs().max()) <= 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("partition", list(PARTITIONS))
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("config", [SGD64, ADAMW64], ids=["sgd64", "adamw64"])
def test_trainer_split_matches_one_shot(config, family, partition):
    loss = FAMILIES[family]
    batches = [family_batch(40 + s, per_token=bool(s % 2)) for s in range(2)]
    one = TorchTrainer(FACTORY, *config)
    initial = one.export_weights()
    want = [one.train(b, loss) for b in batches]
    two = TorchTrainer(FACTORY, *config)
    got = []
    for step, b in enumerate(batches):
        two.begin_train_step(step, loss)
        for mb in split(b, PARTITIONS[partition]):
            two.train_microbatch(mb)
        got.append(two.finish_train_step())
    assert max_param_diff(two.export_weights(), one.export_weights()) <= EXACT_F64
    assert max_param_diff(initial, one.export_weights()) > 1e-4  # the steps moved weights
    rel, abs_ = metric_tolerance(config)
    for g, w in zip(got, want):
        assert g.metrics.keys() == w.metrics.keys()
        for name, value in w.metrics.items():
            assert g.metrics[name] == pytest.approx(value, rel=rel, abs=abs_), name
        assert all(math.isfinite(v) for v in g.metrics.values())
        assert g.grad_norm == pytest.approx(w.grad_norm, rel=rel)


def test_mismatch_metrics_cover_the_trainers_own_version():
    """Step 0 (trainer version 0) compares the even rows (version 0), step 1 the odd
    rows; the -inf token of row 1 is never compared."""
    loss = FAMILIES["kl_k2_clamped_direct"]
    t = TorchTrainer(FACTORY, *SGD64)
    batch = family_batch(50)
    counts = []
    for step in range(2):
        own = batch.loss_mask & (batch.sample_versions == step).unsqueeze(1)
        own &= torch.isfinite(batch.generator_logprobs)
        lp = t.compute_logprobs(batch).double()
        d = (lp - batch.generator_logprobs.double())[own]
        r = t.train(batch, loss)
        counts.append(r.metrics["mismatch_tokens"])
        assert r.metrics["mismatch_tokens"] == int(own.sum()) > 0
        k3 = torch.exp(d) - d - 1
        assert r.metrics["mismatch_kl"] == pytest.approx(float(k3.mean()), rel=1e-5)
        assert r.metrics["mismatch_logprob_diff_mean"] == pytest.approx(float(d.abs().mean()), rel=1e-5)
        assert r.metrics["mismatch_logprob_diff_max"] == pytest.approx(float(d.abs().max()), rel=1e-5)
    assert counts[0] + counts[1] == int((batch.loss_mask & torch.isfinite(batch.generator_logprobs)).sum())
