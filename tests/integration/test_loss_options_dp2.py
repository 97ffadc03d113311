"""Every loss option family at data-parallel world size 2 (two processes over gloo)
equals the world-size-1 one-shot step, in float64 (<= 1e-12), one shot per rank and
split unevenly with a dummy microbatch on the short rank."""

from __future__ import annotations

import pytest

from tests.loss_helpers import DP_CONFIGS, DP_SCENARIOS, FAMILIES, family_batch, run_dp
from tests.trainer_helpers import EXACT_F64, FACTORY, max_param_diff, metric_tolerance
from workers.trainer.torch_backend import TorchTrainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return run_dp(2, tmp_path_factory.mktemp("loss-dp2"))


@pytest.mark.parametrize("scenario", list(DP_SCENARIOS))
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("cfg_name", list(DP_CONFIGS))
def test_dp2_matches_world_size_1_one_shot(dp2, cfg_name, family, scenario):
    config, loss = DP_CONFIGS[cfg_name], FAMILIES[family]
    batches = [family_batch(300 + s, per_token=bool(s % 2)) for s in range(2)]
    truth = TorchTrainer(FACTORY, *config)
    initial = truth.export_weights()
    want = [truth.train(b, loss) for b in batches]
    (w0, res0), (w1, res1) = (r[(cfg_name, family, scenario)] for r in dp2)
    assert max_param_diff(w0, w1) == 0.0, "ranks diverged"
    assert max_param_diff(w0, truth.export_weights()) <= EXACT_F64
    assert max_param_diff(initial, truth.export_weights()) > 1e-4
    rel, abs_ = metric_tolerance(config)
    for got, ref in zip(res0, want):
        assert got.metrics.keys() == ref.metrics.keys()
        for name, value in ref.metrics.items():
            assert got.metrics[name] == pytest.approx(value, rel=rel, abs=abs_), name
        assert got.grad_norm == pytest.approx(ref.grad_norm, rel=rel)
