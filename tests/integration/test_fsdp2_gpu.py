"""FSDP2 backend on a CUDA device: NCCL at world size 1 (mesh dp 1 x tp 1), float64.

The CPU suite (``test_fsdp2_dp2.py``) runs this backend over gloo; this file runs the
same code on a GPU: the model sharded by ``fully_shard`` over a ``cuda`` device mesh,
parameters and gradients in GPU memory, every collective (the FSDP all-gathers and
reduce-scatters, the metric all-gather, the norm's all-reduce, DCP) through NCCL. One
spawned rank does the work and writes its results to a file; the test process compares
them against:

* the torch backend's one-shot ``train()`` on the same GPU (``tests.fsdp2_helpers
  .torch_oneshot``), and the FSDP2 backend's own one-shot;
* the torch backend's one-shot on the CPU, computed in the test process: the GPU paths
  compute the same weights as the CPU paths CI runs.

All in float64, so "equal" is <= 1e-12 (see ``tests/trainer_helpers.py``), for SGD and
AdamW (clipped), token- and sequence-level losses, with and without the KL term (the
sharded reference model). ``abort_train_step`` must leave every shard, the optimizer,
the scheduler and the RNG bitwise unchanged, in both ``grad_reduce`` modes, and
``weights_digest()`` must equal the torch backend's digest of the same weights.

Skipped where no CUDA device (or no NCCL) is visible, as on CI. Data parallel 2 is not
tried here: NCCL refuses two ranks of one communicator on the same GPU, so dp 2 over
NCCL needs two devices.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from tests.fsdp2_helpers import (
    CONFIGS,
    F64,
    LOSSES,
    TOKEN_KL,
    TOL,
    DoubleFactory,
    abort_scenario,
    batches,
    fsdp2,
    checkpoint_scenario,
    leave_rank,
    max_diff,
    run_scenario,
    torch_oneshot,
    write_results,
)
from tests.trainer_helpers import (
    ADAMW,
    FACTORY,
    SEQUENCE,
    SGD,
    SGD64,
    make_batch,
    metric_tolerance,
    split,
)
from workers.trainer import distributed as dd
from workers.trainer.torch_backend import TorchTrainer

pytestmark = [
    pytest.mark.integration,
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()),
        reason="needs a CUDA device and NCCL (FSDP2 over NCCL on one GPU)",
    ),
]

#: run_scenario's names at world size 1: one train() on the whole batch, or the batch
#: split in three microbatches (3, 1, 4 rows)
SCENARIOS = ("oneshot", "split")
#: real microbatches per step in each of this file's scenarios
MICROBATCHES = {"oneshot": 1, "split": 3, "split_dummies": 2}


def _split_with_dummies(config, loss) -> tuple[dict, list, str]:
    """Split steps with a dummy first and last: the dummy's one-row forward/backward is
    built on the trainer's device (here, the GPU) and must add exactly nothing."""
    from workers.trainer.fsdp2_backend import Fsdp2Trainer

    t = Fsdp2Trainer(FACTORY, *config, F64)
    results = []
    for step, batch in enumerate(batches()):
        t.begin_train_step(step, loss)
        for mb in (None, *split(batch, [5, 3]), None):
            t.train_microbatch(mb)
        results.append(t.finish_train_step())
    return t.export_weights(), results, t.weights_digest()


def _placement() -> dict:
    """Where a freshly built trainer of each backend lives, and their initial digests."""
    from torch.distributed.tensor import DTensor

    from workers.trainer.fsdp2_backend import Fsdp2Trainer

    f = Fsdp2Trainer(FACTORY, *SGD, F64)
    t = TorchTrainer(DoubleFactory(FACTORY), *SGD)
    return {
        "backend": dist.get_backend(),
        "mesh_device": f.parallel.placement.mesh.device_type,
        "mesh_shape": tuple(f.parallel.placement.mesh.shape),
        "fsdp2_devices": sorted({p.device.type for p in f.model.parameters()}),
        "fsdp2_dtensors": all(isinstance(p, DTensor) for p in f.model.parameters()),
        "torch_devices": sorted({p.device.type for p in t.model.parameters()}),
        "fsdp2_digest": f.weights_digest(),
        "torch_digest": t.weights_digest(),
    }


def _checkpoint(out_dir: str) -> dict:
    """DCP over NCCL: save at v2, then a fresh trainer loads it and continues."""
    from workers.trainer.fsdp2_backend import Fsdp2Trainer

    saved = checkpoint_scenario(out_dir)
    t = Fsdp2Trainer(FACTORY, *ADAMW, F64)
    before = t.weights_digest()
    loaded = t.load_checkpoint(saved["info"].path)
    digest = t.weights_digest()
    t.train(split(make_batch(300), [4, 4])[0], SEQUENCE, step=2)  # as the saver did
    return {
        "saved": saved, "before": before, "loaded": loaded, "digest": digest,
        "after": t.export_weights(), "version": t.trainer_version,
    }


def gpu_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawned rank on CUDA device ``rank`` with an NCCL group: run everything, write a file."""
    torch.cuda.set_device(rank)
    dd.init_process_group(rank, world_size, "127.0.0.1", port, "nccl")
    out: dict = {}
    try:
        out["placement"] = _placement()
        for cfg_name, config in CONFIGS.items():
            for loss_name, loss in LOSSES.items():
                out[("torch_gpu", cfg_name, loss_name)] = torch_oneshot(config, loss)
                for scenario in SCENARIOS:
                    out[(scenario, cfg_name, loss_name)] = run_scenario(scenario, config, loss)
                out[("split_dummies", cfg_name, loss_name)] = _split_with_dummies(config, loss)
        out["gathered"] = run_scenario("split", fsdp2(ADAMW, fsdp2_grad_reduce="gathered"), TOKEN_KL)
        out["abort"] = abort_scenario()
        out["checkpoint"] = _checkpoint(out_dir)
        write_results(out, out_dir, rank)
    finally:
        dd.destroy_process_group()
    leave_rank()


@pytest.fixture(scope="module")
def gpu(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    out_dir = tmp_path_factory.mktemp("fsdp2-gpu")
    port = dd.find_free_port()
    mp.start_processes(gpu_rank, args=(1, port, str(out_dir)), nprocs=1, start_method="spawn")
    with open(out_dir / "rank0.pkl", "rb") as f:
        return pickle.load(f)


@pytest.fixture(scope="module")
def cpu_truth() -> dict:
    """The torch backend's one-shot on the CPU (no process group), float64."""
    out = {}
    for cfg_name, config in CONFIGS.items():
        for loss_name, loss in LOSSES.items():
            t = TorchTrainer(DoubleFactory(FACTORY), *config.with_runtime(device="cpu"))
            initial_digest = t.weights_digest()
            results = [t.train(b, loss) for b in batches()]
            out[(cfg_name, loss_name)] = (t.export_weights(), results, initial_digest)
    return out


def test_everything_ran_on_the_gpu_over_nccl(gpu):
    p = gpu["placement"]
    assert p["backend"] == "nccl"
    assert (p["mesh_device"], p["mesh_shape"]) == ("cuda", (1, 1))
    assert p["fsdp2_devices"] == ["cuda"] and p["fsdp2_dtensors"]
    assert p["torch_devices"] == ["cuda"]


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_split_equals_oneshot_and_torch_backend(gpu, cpu_truth, cfg_name, loss_name):
    want, want_results, initial = gpu[("torch_gpu", cfg_name, loss_name)]
    cpu_want, cpu_results, _ = cpu_truth[(cfg_name, loss_name)]
    assert max_diff(initial, want) > 1e-3  # the steps move the weights: a wrong one shows
    assert max_diff(want, cpu_want) <= TOL  # the torch backend: GPU == CPU
    own_oneshot = gpu[("oneshot", cfg_name, loss_name)][0]
    rel, abs_ = metric_tolerance(SGD64)
    for scenario, n_mb in MICROBATCHES.items():
        weights, results, _ = gpu[(scenario, cfg_name, loss_name)]
        assert max_diff(weights, want) <= TOL, scenario
        assert max_diff(weights, own_oneshot) <= TOL, scenario
        assert max_diff(weights, cpu_want) <= TOL, scenario
        for got, ref, on_cpu in zip(results, want_results, cpu_results):
            assert got.grad_norm == pytest.approx(ref.grad_norm, rel=1e-12)
            assert got.grad_norm == pytest.approx(on_cpu.grad_norm, rel=rel)
            assert got.lr == ref.lr
            assert (got.num_tokens, got.num_sequences) == (ref.num_tokens, ref.num_sequences)
            assert got.num_microbatches == n_mb
            for name in ref.metrics:
                assert got.metrics[name] == pytest.approx(ref.metrics[name], rel=1e-12, abs=1e-14)
        if "kl" in loss_name:
            assert results[-1].metrics["kl"] > 0  # the reference model took part


def test_gathered_reduction_equals_torch_backend(gpu, cpu_truth):
    want = gpu[("torch_gpu", "adamw", "token_kl")][0]
    assert max_diff(gpu["gathered"][0], want) <= TOL
    assert max_diff(gpu["gathered"][0], cpu_truth[("adamw", "token_kl")][0]) <= TOL


def test_weights_digest_equals_torch_backend_digest_of_the_same_weights(gpu, cpu_truth):
    p = gpu["placement"]
    initial_cpu = cpu_truth[("sgd", "token")][2]
    assert p["fsdp2_digest"] == p["torch_digest"] == initial_cpu
    for scenario in (*SCENARIOS, "split_dummies"):
        weights, _, digest = gpu[(scenario, "adamw", "token_kl")]
        t = TorchTrainer(DoubleFactory(FACTORY), *SGD.with_runtime(device="cpu"))
        t.model.load_state_dict(weights)
        assert t.weights_digest() == digest, scenario


def test_abort_leaves_every_shard_bitwise_unchanged(gpu):
    for mode in ("per_microbatch", "gathered"):
        assert gpu["abort"][mode] == {"unchanged": True, "next_step_equal": True}, mode


def test_checkpoint_saved_and_loaded_over_nccl_continues_the_run(gpu):
    c = gpu["checkpoint"]
    info = c["saved"]["info"]
    assert (c["loaded"].sha256, c["loaded"].trainer_version) == (info.sha256, 2)
    assert c["before"] != c["saved"]["saved_digest"] == c["digest"]
    assert max_diff(c["after"], c["saved"]["after"]) <= TOL and c["version"] == 3
