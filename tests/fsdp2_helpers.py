"""Helpers for the FSDP2 backend tests: float64 models, spawned gloo ranks, scenarios.

Everything runs in float64 so that "equal" means equal up to summation order
(<= 1e-12), not up to float32 rounding magnified by Adam. The rank workers live here
(not in a test module) so that spawned processes can import them by name.
"""

from __future__ import annotations

import os
import pickle
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from tests.trainer_helpers import (
    ADAMW, DP_SCENARIOS, FACTORY, SEQUENCE, SGD, TOKEN, Setup, make_batch, split,
)
from workers.loss import Aggregation, LossOptions, StepLoss
from workers.trainer import distributed as dd
from workers.trainer.fsdp2_backend import Fsdp2Options, Fsdp2Trainer
from workers.trainer.torch_backend import TorchTrainer

#: tight enough that a gradient off by any factor, or a missed microbatch, fails
TOL = 1e-12

F64 = Fsdp2Options(param_dtype="float64")
#: FSDP's own default left in place: gradients averaged over the dp ranks, then
#: divided by the global N again -- what the split API must not do
WRONG_NORMALISER = replace(F64, gradient_divide_factor=None)

CONFIGS: dict[str, Setup] = {"sgd": SGD, "adamw": ADAMW}
TOKEN_KL = StepLoss(LossOptions(aggregation=Aggregation.TOKEN, kl_coef=0.1, is_cap=1.5))
#: token without KL, sequence with KL, token with KL (the reference model's forward)
LOSSES: dict[str, StepLoss] = {"token": TOKEN, "sequence_kl": SEQUENCE, "token_kl": TOKEN_KL}


def fsdp2(config: Setup, **train: Any) -> Setup:
    """``config`` with ``[train]`` keys of the fsdp2 backend (mesh, gradient reduction)."""
    return config.with_train(backend="fsdp2", **train)


@dataclass(frozen=True)
class DoubleFactory:
    """Picklable: the wrapped factory's model in float64 (the torch backend's truth)."""

    inner: Callable[[], nn.Module]

    def __call__(self) -> nn.Module:
        return self.inner().double()


def batches() -> list:
    return [make_batch(100 + s) for s in range(2)]


def torch_oneshot(config: Setup, loss: StepLoss) -> tuple[dict, list, dict]:
    """World-size-1 torch backend, one-shot train() per global batch, float64."""
    t = TorchTrainer(DoubleFactory(FACTORY), *config)
    initial = t.export_weights()
    results = [t.train(b, loss) for b in batches()]
    return t.export_weights(), results, initial


def run_scenario(name: str, config: Setup, loss: StepLoss,
                 options: Fsdp2Options = F64) -> tuple[dict, list, str]:
    """One DP_SCENARIOS entry on this rank; returns (weights on rank 0, results, digest)."""
    rank, world = dd.rank_and_world()
    sizes = DP_SCENARIOS[name] if world > 1 else [[3, 1, 4]] if name != "oneshot" else [[8]]
    trainer = Fsdp2Trainer(FACTORY, *config, options)
    results = []
    for step, batch in enumerate(batches()):
        mine = split(batch, [sum(s) for s in sizes])[rank]
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


def local_state(t: Fsdp2Trainer) -> dict[str, Any]:
    """This rank's shards of everything abort must leave bitwise unchanged."""
    def local(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return (x.to_local() if hasattr(x, "to_local") else x).clone()
        if isinstance(x, dict):
            return {k: local(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [local(v) for v in x]
        return x

    return {
        "params": [local(p.detach()) for p in t.model.parameters()],
        "optimizer": local(t.optimizer.state_dict()),
        "scheduler": t.scheduler.state_dict(),
        "version": t.trainer_version,
        "rng": torch.get_rng_state(),
        "grads": [p.grad is None for p in t.model.parameters()],
    }


def bitwise_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))
    return a == b


def abort_scenario() -> dict[str, Any]:
    """Per ``grad_reduce`` mode: train, open a step with uneven microbatches (rank 1 a
    dummy), abort; compare."""
    return {mode: _abort_in(fsdp2(ADAMW, fsdp2_grad_reduce=mode))
            for mode in ("per_microbatch", "gathered")}


def _abort_in(config: Setup) -> dict[str, Any]:
    rank, _ = dd.rank_and_world()
    t = Fsdp2Trainer(FACTORY, *config, F64)
    b0, b1 = batches()
    t.train(split(b0, [4, 4])[rank], TOKEN)  # optimizer state exists
    before = local_state(t)
    t.begin_train_step(1, SEQUENCE)
    mine = split(b1, [5, 3])[rank]
    mbs = split(mine, [2, 3]) if rank == 0 else [mine, None]
    for mb in mbs:
        t.train_microbatch(mb)
    torch.rand(3)  # randomness consumed inside the step is restored by abort
    t.abort_train_step()
    t.abort_train_step()
    unchanged = bitwise_equal(local_state(t), before)
    after_abort = t.train(split(b1, [4, 4])[rank], TOKEN).weights_digest
    fresh = Fsdp2Trainer(FACTORY, *config, F64)
    fresh.train(split(b0, [4, 4])[rank], TOKEN)
    no_abort = fresh.train(split(b1, [4, 4])[rank], TOKEN).weights_digest
    return {"unchanged": unchanged, "next_step_equal": after_abort == no_abort}


def checkpoint_scenario(ckpt_dir: str) -> dict[str, Any]:
    """Two AdamW steps, save (sharded) at v2, one more step; digests for the parent."""
    rank, _ = dd.rank_and_world()
    t = Fsdp2Trainer(FACTORY, *ADAMW, F64)
    for step, b in enumerate(batches()):
        t.train(split(b, [4, 4])[rank], SEQUENCE, step=step)
    info = t.save_checkpoint(Path(ckpt_dir) / "v2")
    saved = t.weights_digest()
    t.train(split(make_batch(300), [4, 4])[rank], SEQUENCE, step=2)
    return {"info": info, "saved_digest": saved, "after": t.export_weights()}


def hf_factory(path: str):
    from workers.models.config import ModelSection
    from workers.trainer.config import BuiltModelFactory

    return BuiltModelFactory(ModelSection(kind="hf", path=path))


def hf_tp_scenario(path: str, tp: int) -> dict[str, Any]:
    """HF Llama (tied embeddings) over a (dp, tp) mesh: split steps with a dummy."""
    rank, world = dd.rank_and_world()
    dp_index = rank // tp
    out: dict[str, Any] = {}
    for cfg_name, loss_name in (("sgd", "token"), ("adamw", "sequence_kl")):
        config = fsdp2(CONFIGS[cfg_name], tensor_parallel=tp)
        t = Fsdp2Trainer(hf_factory(path), *config, F64)
        for step, batch in enumerate(batches()):
            mine = split(batch, [8 // (world // tp)] * (world // tp))[dp_index]
            t.begin_train_step(step, LOSSES[loss_name])
            for mb in split(mine, [3, mine.num_sequences - 3]):
                t.train_microbatch(mb)
            t.train_microbatch(None)
            t.finish_train_step()
        out[(cfg_name, loss_name)] = (t.export_weights(), t.weights_digest())
    return out


def residency_scenario() -> dict[str, Any]:
    """Which parameters are gathered (plain tensors) vs sharded (DTensors) mid-step and
    after finish / abort, per ``grad_reduce`` mode: the gathered mode's speed rests on
    keeping the all-gathered parameters from the first microbatch to finish."""
    from torch.distributed.tensor import DTensor

    rank, _ = dd.rank_and_world()

    def sharded(t: Fsdp2Trainer) -> list[bool]:
        return [isinstance(p, DTensor) for p in t.model.parameters()]

    out: dict[str, Any] = {}
    for mode in ("gathered", "per_microbatch"):
        t = Fsdp2Trainer(FACTORY, *fsdp2(ADAMW, fsdp2_grad_reduce=mode), F64)
        mine = split(batches()[0], [4, 4])[rank]
        seen = {"before": sharded(t)}
        for end in ("finish", "abort"):
            t.begin_train_step(t.trainer_version, TOKEN_KL)
            t.train_microbatch(split(mine, [2, 2])[0])
            seen[f"mid_{end}"] = sharded(t)
            t.train_microbatch(split(mine, [2, 2])[1])
            t.finish_train_step() if end == "finish" else t.abort_train_step()
            seen[f"after_{end}"] = sharded(t)
        out[mode] = seen
    return out


def dp_worker(rank: int, world_size: int, port: int, out_dir: str, jobs: list[str]) -> None:
    """Spawned rank: run the named jobs, write this rank's results to a file."""
    torch.set_num_threads(1)
    dd.init_process_group(rank, world_size, "127.0.0.1", port, "gloo")
    out: dict[Any, Any] = {}
    try:
        for job in jobs:
            if job == "parity":
                for cfg_name, config in CONFIGS.items():
                    for loss_name, loss in LOSSES.items():
                        for scenario in DP_SCENARIOS:
                            out[(cfg_name, loss_name, scenario)] = run_scenario(
                                scenario, config, loss
                            )
            elif job == "wrong_normaliser":
                out[job] = run_scenario("split_uneven", SGD, TOKEN, WRONG_NORMALISER)
            elif job == "gathered":  # the non-default gradient reduction stays exact
                out[job] = run_scenario(
                    "split_uneven", fsdp2(ADAMW, fsdp2_grad_reduce="gathered"), TOKEN_KL
                )
            elif job == "residency":
                out[job] = residency_scenario()
            elif job == "determinism":
                out[job] = run_scenario("split_uneven", ADAMW, SEQUENCE)[2]
            elif job == "abort":
                out[job] = abort_scenario()
            elif job == "checkpoint":
                out[job] = checkpoint_scenario(out_dir)
            elif job.startswith("hf_tp"):  # "hf_tp<k>:<model dir>"
                head, path = job.split(":", 1)
                out["hf_tp"] = hf_tp_scenario(path, int(head[len("hf_tp"):]))
        write_results(out, out_dir, rank)
    finally:
        dd.destroy_process_group()
    leave_rank()


def write_results(out: dict, out_dir: str, rank: int) -> None:
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(out, f)


def leave_rank() -> None:
    """End a spawned rank whose results are on disk, without interpreter teardown.

    Teardown after FSDP2 sometimes aborts in a C++ destructor ("terminate called without
    an active exception": a device mesh still holds the destroyed process group when
    static objects are torn down), which would fail a run whose results are complete,
    by chance."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world_size: int, out_dir: Path, jobs: list[str]) -> list[dict]:
    """Run ``jobs`` on ``world_size`` fresh gloo ranks; every rank's results in order."""
    import torch.multiprocessing as mp

    port = dd.find_free_port()
    mp.start_processes(
        dp_worker, args=(world_size, port, str(out_dir), jobs), nprocs=world_size,
        start_method="spawn",
    )
    out = []
    for r in range(world_size):
        with open(out_dir / f"rank{r}.pkl", "rb") as f:
            out.append(pickle.load(f))
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
