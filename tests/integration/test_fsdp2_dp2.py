"""FSDP2 backend at data parallel 2: two real processes over gloo, float64.

Ground truth: the torch backend's world-size-1 one-shot ``train()`` on each full global
batch, and the FSDP2 backend's own one-shot (``train()`` per rank). Every split scenario
-- even, uneven (the short rank runs real zero-weight forward/backwards), a rank with
no data at all -- with SGD and AdamW (clipped), token- and sequence-level losses, with
and without the KL term (the sharded reference model), must land within 1e-12 of both.

The guards: SGD without clipping makes a one-step update linear in the gradient, so a
gradient off by the world size moves weights by ~1e-1; ``test_average_by_world_size_is
_caught`` runs FSDP's default reduction (average over dp ranks) and shows this suite
would catch it. A missed or doubled microbatch fails the same way.
"""

from __future__ import annotations

import pytest

from tests.fsdp2_helpers import (
    CONFIGS,
    LOSSES,
    TOL,
    max_diff,
    spawn,
    torch_oneshot,
)
from tests.trainer_helpers import DP_SCENARIOS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOBS = ["parity", "gathered", "residency", "wrong_normaliser", "determinism", "abort", "checkpoint"]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return spawn(2, tmp_path_factory.mktemp("fsdp2-dp2"), JOBS)


@pytest.fixture(scope="module")
def truth():
    return {
        (c, l): torch_oneshot(CONFIGS[c], LOSSES[l]) for c in CONFIGS for l in LOSSES
    }


@pytest.mark.parametrize("scenario", list(DP_SCENARIOS))
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_dp2_matches_torch_oneshot_and_own_oneshot(dp2, truth, cfg_name, loss_name, scenario):
    want, want_results, initial = truth[(cfg_name, loss_name)]
    (w0, res0, digest0), (w1, res1, digest1) = (r[(cfg_name, loss_name, scenario)] for r in dp2)
    assert w1 == {}, "only rank 0 keeps exported weights"
    assert digest0 == digest1 and res0 == res1, "ranks disagree"
    assert max_diff(w0, want) <= TOL
    own_oneshot = dp2[0][(cfg_name, loss_name, "oneshot")][0]
    assert max_diff(w0, own_oneshot) <= TOL
    assert max_diff(initial, want) > 1e-3  # the steps move the weights: a wrong one shows
    for got, ref in zip(res0, want_results):
        assert got.grad_norm == pytest.approx(ref.grad_norm, rel=1e-12)
        assert got.lr == ref.lr
        assert (got.num_tokens, got.num_sequences) == (ref.num_tokens, ref.num_sequences)
        for name in ref.metrics:
            assert got.metrics[name] == pytest.approx(ref.metrics[name], rel=1e-12, abs=1e-14)
        assert got.num_microbatches == sum(len(s) for s in DP_SCENARIOS[scenario])
    if "kl" in loss_name:
        assert res0[-1].metrics["kl"] > 0  # the reference model took part


def test_average_by_world_size_is_caught(dp2, truth):
    """Guards the normaliser: FSDP's default divides the reduce-scatter by the dp world
    size; with the split API dividing by the global N again the gradient is halved."""
    want = truth[("sgd", "token")][0]
    wrong = dp2[0]["wrong_normaliser"][0]
    assert max_diff(wrong, want) > 1e-3


def test_gathered_reduction_matches_torch_oneshot(dp2, truth):
    """The non-default mode (one reduce-scatter at finish) is as exact as the default."""
    want = truth[("adamw", "token_kl")][0]
    assert max_diff(dp2[0]["gathered"][0], want) <= TOL
    assert dp2[1]["gathered"][0] == {} and dp2[0]["gathered"][2] == dp2[1]["gathered"][2]


def test_gathered_mode_keeps_parameters_gathered_through_the_step_only(dp2):
    """Guards the gathered mode's speed (one all-gather per step, not per microbatch)
    and that every step ends with the parameters sharded again, finish or abort."""
    for rank in dp2:
        gathered, per_mb = rank["residency"]["gathered"], rank["residency"]["per_microbatch"]
        for seen in (gathered, per_mb):
            for key in ("before", "after_finish", "after_abort"):
                assert all(seen[key]), key
        assert not any(gathered["mid_finish"]) and not any(gathered["mid_abort"])
        assert all(per_mb["mid_finish"]) and all(per_mb["mid_abort"])


def test_two_fresh_process_groups_give_bitwise_equal_weights(dp2, tmp_path):
    again = spawn(2, tmp_path, ["determinism"])
    assert again[0]["determinism"] == dp2[0]["determinism"] == dp2[1]["determinism"]


def test_abort_leaves_every_shard_bitwise_unchanged(dp2):
    for rank in dp2:
        for mode in ("per_microbatch", "gathered"):
            assert rank["abort"][mode] == {"unchanged": True, "next_step_equal": True}, mode


@pytest.fixture
def world1():
    """A world-size-1 gloo group in this process, destroyed afterwards."""
    import torch.distributed as dist

    from workers.trainer.fsdp2_shard import ensure_process_group

    ensure_process_group()
    yield
    dist.destroy_process_group()


def test_checkpoint_saved_at_dp2_loads_at_dp1_and_continues(dp2, world1):
    from tests.fsdp2_helpers import F64
    from tests.trainer_helpers import ADAMW, FACTORY, SEQUENCE, make_batch
    from workers.trainer.fsdp2_backend import Fsdp2Trainer

    saved = dp2[0]["checkpoint"]
    assert dp2[1]["checkpoint"]["info"] == saved["info"]
    info = saved["info"]
    t = Fsdp2Trainer(FACTORY, *ADAMW, F64)
    assert t.weights_digest() != saved["saved_digest"]
    loaded = t.load_checkpoint(info.path)
    assert (loaded.sha256, loaded.trainer_version) == (info.sha256, 2)
    assert t.weights_digest() == saved["saved_digest"]
    t.train(make_batch(300), SEQUENCE, step=2)  # the whole batch on the one rank
    assert max_diff(t.export_weights(), saved["after"]) <= TOL
    assert t.trainer_version == 3
