"""Data parallel world size 2: two real processes over gloo vs the world-size-1 truth.

The ground truth is world-size-1 one-shot ``train()`` on each full global batch. Every DP2
scenario -- one-shot per rank, split even, split uneven (dummies on the short rank), a rank
with no data at all -- must land on the same weights (<= 1e-6) with identical step results
on both ranks. A gradient reduced twice, a per-rank normaliser or a missed reduction moves
the SGD weights by ~1e-1 and fails this test.
"""

from __future__ import annotations

import pytest

from tests.trainer_helpers import (
    ADAMW,
    DP_SCENARIOS,
    SEQUENCE,
    SGD,
    TOKEN,
    make_batch,
    max_param_diff,
    oneshot_reference,
    run_dp,
)

pytestmark = pytest.mark.integration

CONFIGS = {"sgd": SGD, "adamw": ADAMW}
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
    assert max_param_diff(w0, want) <= 1e-6
    assert max_param_diff(initial, want) > 1e-3  # a wrong gradient would be visible
    for got, ref in zip(res0, want_results):
        assert got.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)
        assert got.lr == ref.lr
        assert (got.num_tokens, got.num_sequences) == (ref.num_tokens, ref.num_sequences)
        for name in ref.metrics:
            assert got.metrics[name] == pytest.approx(ref.metrics[name], rel=1e-5, abs=1e-6), name
        assert got.num_microbatches == sum(len(s) for s in DP_SCENARIOS[scenario])
