"""Shared pieces of the loss-option tests: one config per option family, batches that
exercise them, and the data-parallel worker (spawned processes import it by name)."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace
from pathlib import Path

import torch

from workers.batch import TrainBatch
from workers.loss import LossOptions, StepLoss
from workers.models.config import SamplingSection
from workers.trainer import distributed as dd
from workers.trainer.torch_backend import TorchTrainer
from tests import trainer_helpers
from tests.trainer_helpers import ADAMW64, FACTORY, SGD64, make_batch, split

#: one config per option family; together they switch on every [train.loss] choice
FAMILIES: dict[str, StepLoss] = {
    "gspo_seq_tis": StepLoss(LossOptions(
        policy_loss="gspo", old_policy="generator", is_correction="seq-tis", is_cap=5.0,
        aggregation="sequence", clip_low=0.3, clip_high=0.4,
    )),
    "cispo_icepop_sum_norm": StepLoss(LossOptions(
        policy_loss="cispo", old_policy="generator", is_correction="icepop", is_min=0.2,
        is_cap=3.0, aggregation="seq-mean-token-sum-norm", norm_length=8,
    )),
    "dual_clip_seq_mask_kl_score": StepLoss(LossOptions(
        dual_clip=3.0, old_policy="generator", is_correction="seq-mask-tis", is_min=0.3,
        is_cap=3.0, aggregation="seq-mean-token-sum", kl_coef=0.1, kl_gradient="score",
    )),
    "kl_reward_k1_entropy_tis_min": StepLoss(LossOptions(
        kl_coef=0.2, kl_estimator="k1", kl_placement="reward", entropy_coef=0.05,
        is_min=0.5, is_cap=1.5,
    ), SamplingSection(temperature=0.8)),
    "kl_k2_clamped_direct": StepLoss(LossOptions(
        kl_coef=0.3, kl_estimator="k2", kl_input_clamp=0.5, kl_output_clamp=0.05,
        aggregation="sequence",
    )),
}


def family_batch(seed: int, *, per_token: bool = False, batch_size: int = 8) -> TrainBatch:
    """A trainer-helpers batch plus what the options read: a -inf generator logprob,
    per-token advantages (optionally), and per-sample weight versions 0 and 1."""
    b = make_batch(seed, batch_size=batch_size)
    g = torch.Generator().manual_seed(seed + 1)
    gen = b.generator_logprobs.clone()
    first = b.loss_mask[1].nonzero()[0, 0]
    gen[1, first] = -math.inf  # a token the generator says it could not have sampled
    adv = b.advantages
    if per_token:
        adv = torch.where(b.loss_mask, torch.randn(b.loss_mask.shape, generator=g), 0.0)
    versions = torch.arange(batch_size, dtype=torch.int64) % 2
    return replace(b, generator_logprobs=gen, advantages=adv, sample_versions=versions)


# -- data parallel world size 2 (gloo) ----------------------------------------------

#: rows of each 8-row global batch per rank, then microbatch sizes per rank
DP_SCENARIOS = {"oneshot": [[4], [4]], "split_uneven": [[3, 2, 1], [2]]}
DP_CONFIGS = {"sgd64": SGD64, "adamw64": ADAMW64}


def _run(name, config, loss, batches, rank):
    sizes = DP_SCENARIOS[name]
    trainer = TorchTrainer(FACTORY, *config)
    results = []
    for step, batch in enumerate(batches):
        mine = split(batch, [sum(s) for s in sizes])[rank]
        if name == "oneshot":
            results.append(trainer.train(mine, loss, step=step))
            continue
        mbs = split(mine, sizes[rank]) if sizes[rank] else []
        trainer.begin_train_step(step, loss)
        for i in range(max(len(s) for s in sizes)):
            trainer.train_microbatch(mbs[i] if i < len(mbs) else None)
        results.append(trainer.finish_train_step())
    return trainer.export_weights(), results


def dp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawned rank: every family x optimizer x scenario; results to rank<r>.pkl."""
    torch.set_num_threads(1)
    dd.init_process_group(rank, world_size, "127.0.0.1", port, "gloo")
    try:
        batches = [family_batch(300 + s, per_token=bool(s % 2)) for s in range(2)]
        out = {
            (c, f, s): _run(s, config, loss, batches, rank)
            for c, config in DP_CONFIGS.items()
            for f, loss in FAMILIES.items()
            for s in DP_SCENARIOS
        }
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(out, f)
    finally:
        dd.destroy_process_group()


def run_dp(world_size: int, out_dir: Path) -> list[dict]:
    """The loss families' DP ranks (:func:`dp_worker`); every rank's results, in rank order."""
    return trainer_helpers.run_dp(world_size, out_dir, worker=dp_worker)
