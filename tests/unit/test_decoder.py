"""The step-at-a-time decoder: per-token versions, refits between steps, resuming."""

from __future__ import annotations

import pytest
import torch

from workers.models.config import ModelSection, SamplingSection
from workers.models.decoder import Decoder, RowPrefix
from workers.models.factory import build_model
from workers.models.sampling import sequence_logprobs
from workers.models.tokenizer import EOS_ID

CFG = ModelSection(context_len=48, d_model=32, n_heads=2)
SEED = 1
SAMPLING = SamplingSection(max_new_tokens=14)


@pytest.fixture(scope="module")
def models():
    old, tok = build_model(CFG, SEED)
    new, _ = build_model(CFG, 7)
    return old, new, tok


def _decoder(model, prompt, n=6, seed=0, **kw):
    return Decoder(model, prompt, n, SAMPLING, torch.Generator().manual_seed(seed), EOS_ID, **kw)


def _full_forward(model, prompt, tokens):
    """Each completion token's logprob under one full forward of ``model``."""
    return sequence_logprobs(model, torch.tensor(prompt + tokens))[len(prompt):]


def _run_with_refit(models, kv_on_refit, refit_after=4):
    """Steps with ``old`` weights, loads ``new`` into the same module, steps on."""
    old, new, tok = models
    model, _ = build_model(CFG, SEED)
    prompt = tok.encode("abcd>")
    dec = _decoder(model, prompt, kv_on_refit=kv_on_refit)
    while not dec.done:
        if dec.steps == refit_after:
            model.load_state_dict(new.state_dict())
        dec.step(0 if dec.steps < refit_after else 1)
    return dec, prompt


def test_refit_with_recompute_gives_each_token_its_versions_own_logprob(models):
    old, new, _ = models
    dec, prompt = _run_with_refit(models, "recompute")
    assert dec.prefills == 2  # the first one and the one after the refit
    spanning = 0
    for c in dec.completions():
        versions = c.versions.tolist()
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        k = versions.count(0)
        assert k == min(4, len(c.tokens))
        ref_old = _full_forward(old, prompt, c.tokens)[:k]
        ref_new = _full_forward(new, prompt, c.tokens)[k:]
        torch.testing.assert_close(c.logprobs, torch.cat([ref_old, ref_new]), atol=1e-5, rtol=0)
        spanning += k < len(c.tokens)
    assert spanning > 0  # the refit landed inside some samples


def test_refit_keeping_the_cache_is_no_versions_own_distribution(models):
    _, new, _ = models
    dec, prompt = _run_with_refit(models, "keep")
    assert dec.prefills == 1
    worst = 0.0
    for c in dec.completions():
        k = c.versions.tolist().count(0)
        if k < len(c.tokens):
            ref_new = _full_forward(new, prompt, c.tokens)[k:]
            worst = max(worst, float((c.logprobs[k:] - ref_new).abs().max()))
    # the old weights' keys/values are still in the prefix: a real difference
    assert worst > 1e-2


def test_resume_keeps_recorded_tokens_and_continues_them(models):
    old, _, tok = models
    prompt = tok.encode("dcba>")
    first = _decoder(old, prompt, seed=3)
    for _ in range(5):
        first.step(2)
    prefixes = [RowPrefix(list(r.tokens), list(r.logprobs), list(r.versions), r.stopped)
                for r in first.rows]
    resumed = _decoder(old, prompt, seed=11, prefixes=prefixes)
    while not resumed.done:
        resumed.step(3)
    for before, c in zip(prefixes, resumed.completions()):
        k = len(before.tokens)
        assert c.tokens[:k] == before.tokens  # recorded tokens are never sampled again
        assert c.versions.tolist() == [2] * k + [3] * (len(c.tokens) - k)
        if before.stopped:
            assert len(c.tokens) == k
        torch.testing.assert_close(c.logprobs, _full_forward(old, prompt, c.tokens), atol=1e-5, rtol=0)


def test_resume_refuses_live_samples_of_different_lengths(models):
    old, _, tok = models
    prefixes = [RowPrefix([5], [-1.0], [0]), RowPrefix([5, 6], [-1.0, -1.0], [0, 0])]
    with pytest.raises(ValueError, match="equal lengths"):
        _decoder(old, tok.encode("ab>"), n=2, prefixes=prefixes)
    with pytest.raises(ValueError, match="2 tokens, 1 logprobs"):
        RowPrefix([5, 6], [-1.0], [0, 0])


def test_kv_on_refit_is_validated(models):
    old, _, tok = models
    with pytest.raises(ValueError, match="kv_on_refit"):
        _decoder(old, tok.encode("ab>"), kv_on_refit="sometimes")
