"""Data parallel world size 2: two real processes over gloo vs the world-size-1 truth.

The ground truth is world-size-1 one-shot ``train()`` on each full global batch. Every DP2
scenario -- one-shot per rank, split even, split uneven (dummies on the short rank), a rank
with no data at all -- must land on the same weights with identical step results on both ranks: within 1e-12
in float64 (the exactness check), and within the tolerance its optimizer allows in
float32 (see tests/trainer_helpers.py). A gradient reduced twice, a per-rank normaliser
or a missed reduction moves the SGD weights by ~1e-1 and fails this test; the
deliberately wrong per-rank normaliser is run as a scenario to prove it.
"""

from __future__ import annotations

import pytest

from tests.trainer_helpers import (
    DP_CONFIGS,
    DP_SCENARIOS,
    SEQUENCE,
    TOKEN,
    WRONG_NORMALISER,
    make_batch,
    max_param_diff,
    metric_tolerance,
    oneshot_reference,
    run_dp,
    weight_tolerance,
)

pytestmark = pytest.mark.integration

CONFIGS = DP_CONFIGS
LOSSES = {"token": TOKEN, "sequence": SEQUENCE}


@pytest.fixture(scope="module")
def dp2_results(tmp_path_factory):
    return run_dp(2, tmp_path_factory.mktemp("dp2"))


@pytest.mark.parametrize("scenario", list(DP_SCENARIOS))
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_dp2_matches_world_size_1_oneshot(dp2_results, cfg_name, loss_name, scenario):
    batches = [make_batch(100 + s) for s in range(2)]
    want, want_results, initial = oneshot_reference(CONFIGS[cfg_name], LOSSES[loss_name], batches)
    (w0, res0, digest0), (w1, res1, digest1) = (
        r[(cfg_name, loss_name, scenario)] for r in dp2_results
    )
    assert digest0 == digest1, "ranks diverged"
    assert res0 == res1, "ranks reported different step results"
    config = CONFIGS[cfg_name]
    assert max_param_diff(w0, want) <= weight_tolerance(config, len(batches))
    assert max_param_diff(initial, want) > 1e-3  # a wrong gradient would be visible
    rel, abs_ = metric_tolerance(config)
    for got, ref in zip(res0, want_results):
        assert got.grad_norm == pytest.approx(ref.grad_norm, rel=rel)
        assert got.lr == ref.lr
        assert (got.num_tokens, got.num_sequences) == (ref.num_tokens, ref.num_sequences)
        for name in ref.metrics:
            assert got.metrics[name] == pytest.approx(ref.metrics[name], rel=rel, abs=abs_), name
        assert got.num_microbatches == sum(len(s) for s in DP_SCENARIOS[scenario])


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("cfg_name", ["sgd64", "sgd32"])
def test_a_rank_local_normaliser_fails_the_parity_check(dp2_results, cfg_name, loss_name):
    """The check above can fail: the classic DP bug misses the truth by far more than
    its tolerance. (Adam is invariant to a gradient's scale, so only the SGD runs show
    it in the weights; for AdamW the grad-norm comparison catches it.)"""
    batches = [make_batch(100 + s) for s in range(2)]
    config = CONFIGS[cfg_name]
    want, want_results, _ = oneshot_reference(config, LOSSES[loss_name], batches)
    (w0, res0, _), _ = (r[(cfg_name, loss_name, WRONG_NORMALISER)] for r in dp2_results)
    assert max_param_diff(w0, want) > 1e3 * weight_tolerance(config, len(batches))


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_a_rank_local_normaliser_changes_the_grad_norm(dp2_results, cfg_name):
    batches = [make_batch(100 + s) for s in range(2)]
    want, want_results, _ = oneshot_reference(CONFIGS[cfg_name], TOKEN, batches)
    (_, res0, _), _ = (r[(cfg_name, "token", WRONG_NORMALISER)] for r in dp2_results)
    rel, _ = metric_tolerance(CONFIGS[cfg_name])
    assert res0[0].grad_norm != pytest.approx(want_results[0].grad_norm, rel=1e3 * rel)
