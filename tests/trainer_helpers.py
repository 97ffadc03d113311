"""Shared helpers for the trainer tests: tiny models, synthetic batches, DP workers.

The data-parallel workers live here (not in a test module) so spawned processes can
import them by name.
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import torch

from workers.batch import TrainBatch
from workers.loss import Aggregation, LossOptions, StepLoss
from workers.models.config import SamplingSection
from workers.models.tiny import TinyConfig
from workers.trainer import distributed as dd
from workers.trainer.config import OptimizerConfig, TinyModelFactory, TrainerRuntime, TrainSection
from workers.trainer.torch_backend import TorchTrainer

VOCAB = 16
MAX_LEN = 12
FACTORY = TinyModelFactory(
    TinyConfig(vocab_size=VOCAB, context_len=16, d_model=32, n_layers=2, n_heads=2)
)



class Setup(NamedTuple):
    """A trainer's two inputs, passed around the tests as one: the user's ``[train]``
    table and the run's runtime (``TorchTrainer(FACTORY, *setup)``)."""

    train: TrainSection
    runtime: TrainerRuntime

    def with_train(self, **changes: Any) -> Setup:
        return self._replace(train=msgspec.structs.replace(self.train, **changes))

    def with_runtime(self, **changes: Any) -> Setup:
        return self._replace(runtime=replace(self.runtime, **changes))


#: SGD without clipping: a one-step update is linear in the gradient, so a gradient that
#: is off by any factor (reduced twice, divided by the wrong N) shows up in the weights.
SGD = Setup(
    TrainSection(lr=0.5, grad_clip=0.0),
    TrainerRuntime(optimizer=OptimizerConfig(kind="sgd"), keep_reference=True, digest_on_finish=False),
)
ADAMW = Setup(
    TrainSection(lr=1e-3, weight_decay=0.01, grad_clip=1.0),
    TrainerRuntime(optimizer=OptimizerConfig(kind="adamw"), keep_reference=True),
)

# -- how close "equal" is ------------------------------------------------------------
#
# Split-vs-one-shot (and DP2-vs-DP1) differ only in the order of floating-point sums,
# so the weights differ by rounding. What that rounding becomes depends on the
# optimizer and the dtype:
#
# * float64, any optimizer: the gradients differ by ~1e-16 relative. Adam divides by
#   sqrt(v) + eps with eps = 1e-8, magnifying a gradient error d by at most 1/eps, so
#   a weight moves by at most lr * d / eps ~ 1e-3 * 1e-18 / 1e-8 per step: <= 1e-12
#   holds with orders of magnitude to spare on any CPU. This is the exactness check.
# * float32 SGD: the update lr * g is linear in the gradient, so the weights differ by
#   lr * (gradient rounding) plus the rounding of the weights themselves: a few float32
#   ulps of the largest weight (LayerNorm gains, ~1).
# * float32 AdamW: a gradient coordinate near zero (~1e-8, like eps) is magnified by up
#   to 1/eps, so float32 rounding of a near-cancelling sum (d ~ 1e-11, which summation
#   order on a given CPU decides) moves that weight by lr * d / eps ~ 1e-3 * lr per
#   step: 1.6e-6 was seen on an AVX-512 EPYC at lr 1e-3, and no tolerance below lr per
#   step is guaranteed by arithmetic. ``adamw_f32_tolerance`` allows 1% of lr per step
#   (six times the worst seen) -- still 50x less than one step moves the weights, so a
#   trainer that skips, repeats or mis-orders a step fails it.

#: float64 twins of the two configs: the exactness checks run on these
SGD64 = SGD.with_runtime(dtype="float64")
ADAMW64 = ADAMW.with_runtime(dtype="float64")
#: max weight difference for float64 runs (any optimizer)
EXACT_F64 = 1e-12
#: max weight difference for float32 SGD runs: 4 float32 ulps at 1.0 (2**-21)
SGD_F32 = 4 * 2.0**-23


def adamw_f32_tolerance(config: Setup, steps: int) -> float:
    """Max weight difference for float32 AdamW runs after ``steps`` steps (see above)."""
    assert config.runtime.optimizer.kind == "adamw" and config.runtime.dtype != "float64"
    return 1e-2 * config.train.lr * steps


def metric_tolerance(config: Setup) -> tuple[float, float]:
    """(rel, abs) for grad norms and metrics: sums of many terms, rounding only."""
    return (1e-9, 1e-12) if config.runtime.dtype == "float64" else (1e-5, 1e-6)


def weight_tolerance(config: Setup, steps: int) -> float:
    """The tolerance that fits ``config``'s optimizer and dtype (see above)."""
    if config.runtime.dtype == "float64":
        return EXACT_F64
    if config.runtime.optimizer.kind == "sgd":
        return SGD_F32
    return adamw_f32_tolerance(config, steps)

TOKEN = StepLoss(LossOptions(aggregation=Aggregation.TOKEN, is_cap=1.5))
SEQUENCE = StepLoss(
    LossOptions(aggregation=Aggregation.SEQUENCE, kl_coef=0.05), SamplingSection(temperature=0.8)
)


def make_batch(seed: int, batch_size: int = 8, max_len: int = MAX_LEN) -> TrainBatch:
    """Right-padded prompt+completion rows with random lengths, logprobs and advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(batch_size, max_len, dtype=torch.int64)
    att = torch.zeros(batch_size, max_len, dtype=torch.bool)
    mask = torch.zeros(batch_size, max_len, dtype=torch.bool)
    for i in range(batch_size):
        prompt = int(torch.randint(2, 5, (1,), generator=g))
        completion = int(torch.randint(1, max_len - prompt + 1, (1,), generator=g))
        n = prompt + completion
        ids[i, :n] = torch.randint(2, VOCAB, (n,), generator=g)
        att[i, :n] = True
        mask[i, prompt:n] = True
    gen = torch.where(mask, -torch.rand(batch_size, max_len, generator=g) * 3 - 1.0, 0.0)
    adv = torch.randn(batch_size, generator=g)
    return TrainBatch(
        input_ids=ids, attention_mask=att, loss_mask=mask, generator_logprobs=gen, advantages=adv
    )


def split(batch: TrainBatch, sizes: list[int]) -> list[TrainBatch]:
    """Consecutive row ranges of the given sizes."""
    assert sum(sizes) == batch.num_sequences, (sizes, batch.num_sequences)
    out, start = [], 0
    for n in sizes:
        out.append(batch.select(slice(start, start + n)))
        start += n
    return out


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def oneshot_reference(
    config: Setup, loss: StepLoss, batches: list[TrainBatch]
) -> tuple[dict[str, torch.Tensor], list, dict[str, torch.Tensor]]:
    """World-size-1 one-shot train() on each full global batch: the ground truth.

    Returns (final weights, step results, initial weights).
    """
    t = TorchTrainer(FACTORY, *config)
    initial = t.export_weights()
    results = [t.train(b, loss) for b in batches]
    return t.export_weights(), results, initial


# -- data-parallel scenarios (run on every rank of a real process group) ------------

#: rows of each 8-row global batch per rank, then microbatch sizes per rank
DP_SCENARIOS: dict[str, list[list[int]]] = {
    "oneshot": [[4], [4]],  # train(): one microbatch per rank
    "split_even": [[2, 2], [1, 3]],
    "split_uneven": [[3, 2, 1], [2]],  # rank 1 runs two dummies
    "split_idle_rank": [[2, 2, 4], []],  # rank 1 runs only dummies
}


#: the classic data-parallel bug, run deliberately: each rank divides the summed
#: gradient by its own count instead of the global one. The DP2 test asserts that this
#: scenario misses the truth by far more than the tolerance (it must be able to fail).
WRONG_NORMALISER = "wrong_normaliser"
DP_NEGATIVE: dict[str, list[list[int]]] = {WRONG_NORMALISER: [[3, 2, 1], [2]]}

#: configs the DP workers run, by name
DP_CONFIGS = {"sgd64": SGD64, "adamw64": ADAMW64, "sgd32": SGD, "adamw32": ADAMW}


def _use_rank_local_normaliser(trainer: TorchTrainer) -> None:
    right = trainer._global_normaliser

    def wrong(open_):
        total, _ = right(open_)
        token = open_.loss_config.options.aggregation is Aggregation.TOKEN
        return total, max(1, open_.num_tokens if token else open_.num_sequences)

    trainer._global_normaliser = wrong  # type: ignore[method-assign]


def run_dp_scenario(
    name: str, config: Setup, loss: StepLoss, batches: list[TrainBatch]
) -> tuple[dict[str, torch.Tensor], list, str]:
    rank, world = dd.rank_and_world()
    sizes = {**DP_SCENARIOS, **DP_NEGATIVE}[name]
    trainer = TorchTrainer(FACTORY, *config)
    if name == WRONG_NORMALISER:
        _use_rank_local_normaliser(trainer)
    results = []
    for step, batch in enumerate(batches):
        shards = split(batch, [sum(s) for s in sizes])
        mine = shards[rank]
        if name == "oneshot":
            results.append(trainer.train(mine, loss, step=step))
            continue
        mbs = split(mine, sizes[rank]) if sizes[rank] else []
        k = max(len(s) for s in sizes)
        trainer.begin_train_step(step, loss)
        for i in range(k):
            trainer.train_microbatch(mbs[i] if i < len(mbs) else None)
        results.append(trainer.finish_train_step())
    return trainer.export_weights(), results, trainer.weights_digest()


def dp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawned rank: run every scenario for both losses, write rank's results to a file."""
    torch.set_num_threads(1)
    dd.init_process_group(rank, world_size, "127.0.0.1", port, "gloo")
    try:
        batches = [make_batch(100 + s) for s in range(2)]
        out = {}
        for cfg_name, config in DP_CONFIGS.items():
            for loss_name, loss in (("token", TOKEN), ("sequence", SEQUENCE)):
                for scenario in DP_SCENARIOS:
                    out[(cfg_name, loss_name, scenario)] = run_dp_scenario(
                        scenario, config, loss, batches
                    )
                out[(cfg_name, loss_name, WRONG_NORMALISER)] = run_dp_scenario(
                    WRONG_NORMALISER, config, loss, batches
                )
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(out, f)
    finally:
        dd.destroy_process_group()


def run_dp(world_size: int, out_dir: Path, worker=None) -> list[dict]:
    """Spawn ``world_size`` ranks over gloo running ``worker(rank, world_size, port,
    out_dir)`` (default :func:`dp_worker`); every rank's results, in rank order."""
    import torch.multiprocessing as mp

    port = dd.find_free_port()
    mp.start_processes(
        worker or dp_worker, args=(world_size, port, str(out_dir)), nprocs=world_size,
        start_method="spawn",
    )
    out = []
    for r in range(world_size):
        with open(out_dir / f"rank{r}.pkl", "rb") as f:
            out.append(pickle.load(f))
    return out


# -- determinism across processes ---------------------------------------------------


def determinism_run() -> None:
    """Print the weights digest after a fixed sequence of split-API calls (subprocess)."""
    config = ADAMW.with_runtime(num_threads=2)
    t = TorchTrainer(FACTORY, *config)
    for step in range(3):
        batch = make_batch(200 + step)
        t.begin_train_step(step, SEQUENCE if step % 2 else TOKEN)
        for mb in split(batch, [3, 1, 4]):
            t.train_microbatch(mb)
        t.finish_train_step()
    sys.stdout.write(t.weights_digest() + "\n")

