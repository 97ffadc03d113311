"""The Ray shell: two rank actors over gloo, driven by TrainerGroup, vs in-process truth."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from workers.trainer import MicrobatchResult, TrainStepStateError
from tests.trainer_helpers import (
    FACTORY,
    SGD64,
    TOKEN,
    make_batch,
    max_param_diff,
    metric_tolerance,
    oneshot_reference,
    split,
    weight_tolerance,
)

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.integration

REPO_ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def ray_cluster():
    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
    )
    yield
    ray.shutdown()


def test_two_rank_actors_match_in_process_oneshot(ray_cluster, tmp_path):
    from workers.trainer.actor import TrainerGroup

    batch = make_batch(100)
    want, want_results, initial = oneshot_reference(SGD64, TOKEN, [batch])
    group = TrainerGroup(2, FACTORY, *SGD64)
    try:
        with pytest.raises(TrainStepStateError):
            group.finish_train_step()  # rejected by the driver before any fan-out
        group.begin_train_step(0, TOKEN)
        rank0, rank1 = split(batch, [5, 3])
        results = group.train_microbatches([split(rank0, [2, 3]), [rank1]])
        assert [r.dummy for r in results[1]] == [False, True]
        res = group.finish_train_step()
        assert res.trainer_version == group.trainer_version == 1
        assert res.grad_norm == pytest.approx(
            want_results[0].grad_norm, rel=metric_tolerance(SGD64)[0]
        )
        assert max_param_diff(group.export_weights(), want) <= weight_tolerance(SGD64, 1)
        assert max_param_diff(initial, want) > 1e-3  # a wrong gradient would be visible
        group.weights_digest()  # raises if the ranks diverged
        info = group.save_checkpoint(tmp_path / "v1")
        assert info.trainer_version == 1
        # a Trainer like one rank: one global microbatch, its global counts
        group.begin_train_step(1, TOKEN)
        got = group.train_microbatch(batch)
        assert isinstance(got, MicrobatchResult) and not got.dummy and got.index == 0
        assert (got.num_sequences, got.num_tokens) == (batch.num_sequences, batch.num_tokens)
        group.abort_train_step()
    finally:
        group.close()


def _live(actors) -> int:
    """How many of these actors still answer a call."""
    alive = 0
    for actor in actors:
        try:
            ray.get(actor.address.remote(), timeout=60)
            alive += 1
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
    return alive


def test_trainer_worker_reset_stops_its_rank_actors(ray_cluster, tmp_path):
    """``TrainerWorker.reset`` (recovery's way back to the initial weights) builds a new
    data-parallel group; the old group's rank actors must be stopped, not leaked."""
    from controller.config import load_config
    from controller.wiring import worker_spec
    from workers.dataplane import make_dataplane
    from workers.service import TrainerWorker

    cfg = load_config(None, [
        "dataplane.kind=memory", "dataplane.spill=false", "train.data_parallel=2",
        "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
    ])
    spec = worker_spec(cfg, "reset-test", tmp_path)
    worker = TrainerWorker(spec, make_dataplane(spec.dataplane, spec.dataplane_runtime))
    try:
        old = list(worker.trainer._ranks)
        assert _live(old) == 2
        worker.reset()
        new = list(worker.trainer._ranks)
        assert _live(old + new) == 2, "the old group's rank actors are still alive"
        assert _live(new) == 2
    finally:
        worker.trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize("trainer_backend", ["megatron", "fsdp2"])
def test_rank_actors_run_every_backend(ray_cluster, trainer_backend):
    """The same rank actors build megatron (mcore DDP) and fsdp2 (sharded) ranks; an
    uneven split step over two actors equals the world-size-1 torch one-shot."""
    if trainer_backend == "megatron":
        pytest.importorskip("megatron.core")
    from workers.trainer.actor import TrainerGroup

    batch = make_batch(101)
    want, want_results, _ = oneshot_reference(SGD64, TOKEN, [batch])
    group = TrainerGroup(2, FACTORY, *SGD64, trainer_backend=trainer_backend)
    try:
        group.begin_train_step(0, TOKEN)
        rank0, rank1 = split(batch, [5, 3])
        group.train_microbatches([split(rank0, [2, 3]), [rank1]])
        res = group.finish_train_step()
        assert res.grad_norm == pytest.approx(
            want_results[0].grad_norm, rel=metric_tolerance(SGD64)[0]
        )
        assert max_param_diff(group.export_weights(), want) <= weight_tolerance(SGD64, 1)
        assert group.weights_digest() == res.weights_digest or res.weights_digest is None
        logprobs = group.compute_logprobs(batch)
        assert logprobs.shape == batch.loss_mask.shape
    finally:
        group.close()
