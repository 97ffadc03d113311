"""Megatron backend, data parallel 2: two real processes over gloo vs the world-size-1 truth.

Same scenarios as the torch backend's parity suite (``tests.trainer_helpers.DP_SCENARIOS``:
one-shot per rank, split even, split uneven with dummies, a rank with no data), for:

* the built-in ``TinyCausalLM`` wrapped in mcore DDP, with ``overlap_grad_reduce`` off
  and on -- the truth is the *torch* backend's world-size-1 one-shot ``train()``, so
  this also checks the two backends agree;
* mcore's own ``GPTModel`` -- the truth is the megatron backend's world-size-1 one-shot.

Weights must match within 1e-12 in float64 (the exactness check) and within the
tolerance its optimizer allows in float32 (see ``tests/trainer_helpers.py``). A gradient
reduced twice (start_grad_sync + finish_grad_sync with overlap off), a per-rank
normaliser or a missed reduction moves the SGD weights by ~1e-1 and fails.
GPU variants (NCCL, megatron's distributed optimizer) are marked ``gpu``.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.trainer_helpers import (  # noqa: E402
    DP_CONFIGS,
    DP_SCENARIOS,
    FACTORY,
    SEQUENCE,
    TOKEN,
    make_batch,
    max_param_diff,
    metric_tolerance,
    oneshot_reference,
    split,
    weight_tolerance,
)
from workers.trainer import distributed as dd  # noqa: E402

pytestmark = pytest.mark.integration

CONFIGS = DP_CONFIGS
LOSSES = {"token": TOKEN, "sequence": SEQUENCE}
#: model name -> (factory, MegatronOptions kwargs)
VARIANTS = {
    "tiny": ("tiny", {"overlap_grad_reduce": False}),
    "tiny_overlap": ("tiny", {"overlap_grad_reduce": True}),
    "gpt": ("gpt", {"overlap_grad_reduce": False}),
}


def _factory(name: str):
    from workers.trainer.megatron_backend import McoreGPTFactory

    if name == "tiny":
        return FACTORY
    return McoreGPTFactory(
        vocab_size=16, context_len=16, hidden_size=32, num_layers=2, num_attention_heads=2
    )


def _run(variant: str, scenario: str, cfg_name: str, loss_name: str, gpu: bool):
    from workers.trainer.megatron_backend import MegatronOptions, MegatronTrainer

    model, opts = VARIANTS[variant]
    options = MegatronOptions(use_distributed_optimizer=gpu, **opts)
    config = CONFIGS[cfg_name]
    if gpu:
        config = config.with_runtime(device="cuda")
    trainer = MegatronTrainer(_factory(model), *config, options)
    initial = trainer.export_weights()
    loss = LOSSES[loss_name]
    rank, world = dd.rank_and_world()
    if world == 2:
        sizes = DP_SCENARIOS[scenario]
    else:  # world size 1: one-shot, or the batch split in three microbatches
        sizes = [[8]] if scenario == "oneshot" else [[3, 1, 4]]
    results = []
    for step in range(2):
        batch = make_batch(100 + step)
        mine = split(batch, [sum(s) for s in sizes])[rank]
        if scenario == "oneshot":
            results.append(trainer.train(mine, loss, step=step))
            continue
        mbs = split(mine, sizes[rank]) if sizes[rank] else []
        k = max(len(s) for s in sizes)
        trainer.begin_train_step(step, loss)
        for i in range(k):
            trainer.train_microbatch(mbs[i] if i < len(mbs) else None)
        results.append(trainer.finish_train_step())
    assert trainer.parallel.forward.config.no_sync_func is not None  # hooks restored after each step
    return trainer.export_weights(), results, trainer.weights_digest(), initial


def worker(rank: int, world_size: int, port: int, out_dir: str, jobs: list, gpu: bool) -> None:
    """Spawned rank: run every job, write this rank's results to a file."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if gpu:
        torch.cuda.set_device(rank)
    dd.init_process_group(rank, world_size, "127.0.0.1", port, "nccl" if gpu else "gloo")
    from workers.trainer import megatron_shims

    try:
        out = {job: _run(*job, gpu=gpu) for job in jobs}
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(out, f)
    finally:
        megatron_shims.destroy_parallel_state()
        dd.destroy_process_group()


def run_ranks(world_size: int, out_dir: Path, jobs: list, gpu: bool = False) -> list[dict]:
    import torch.multiprocessing as mp

    port = dd.find_free_port()
    mp.start_processes(
        worker, args=(world_size, port, str(out_dir), jobs, gpu), nprocs=world_size,
        start_method="spawn",
    )
    out = []
    for r in range(world_size):
        with open(out_dir / f"rank{r}.pkl", "rb") as f:
            out.append(pickle.load(f))
    return out


DP2_JOBS = [
    (v, s, c, lo) for v in VARIANTS for s in DP_SCENARIOS for c in CONFIGS for lo in LOSSES
    if v != "gpt" or c == "sgd64"  # GPTModel: SGD (linear in the gradient) keeps the run short
]
WS1_JOBS = [("gpt", "oneshot", "sgd64", lo) for lo in LOSSES]


@pytest.fixture(scope="module")
def dp2_results(tmp_path_factory):
    return run_ranks(2, tmp_path_factory.mktemp("megatron-dp2"), DP2_JOBS)


@pytest.fixture(scope="module")
def ws1_results(tmp_path_factory):
    return run_ranks(1, tmp_path_factory.mktemp("megatron-ws1"), WS1_JOBS)[0]


def _check(res0, res1, want_results, want, initial, scenario, config):
    (w0, r0, d0, _), (w1, r1, d1, _) = res0, res1
    assert d0 == d1, "ranks diverged"
    assert r0 == r1, "ranks reported different step results"
    assert max_param_diff(w0, want) <= weight_tolerance(config, len(want_results))
    assert max_param_diff(initial, want) > 1e-3  # a wrong gradient would be visible
    rel, abs_ = metric_tolerance(config)
    for got, ref in zip(r0, want_results):
        assert got.grad_norm == pytest.approx(ref.grad_norm, rel=rel)
        assert got.lr == ref.lr
        assert (got.num_tokens, got.num_sequences) == (ref.num_tokens, ref.num_sequences)
        for name in ref.metrics:
            assert got.metrics[name] == pytest.approx(ref.metrics[name], rel=rel, abs=abs_), name
        assert got.num_microbatches == sum(len(s) for s in DP_SCENARIOS[scenario])


@pytest.mark.parametrize("job", [j for j in DP2_JOBS if j[0] != "gpt"], ids="-".join)
def test_dp2_tiny_model_matches_torch_backend_oneshot(dp2_results, job):
    variant, scenario, cfg_name, loss_name = job
    batches = [make_batch(100 + s) for s in range(2)]
    config = CONFIGS[cfg_name]
    want, want_results, initial = oneshot_reference(config, LOSSES[loss_name], batches)
    _check(dp2_results[0][job], dp2_results[1][job], want_results, want, initial, scenario, config)


@pytest.mark.parametrize("job", [j for j in DP2_JOBS if j[0] == "gpt"], ids="-".join)
def test_dp2_mcore_gpt_matches_world_size_1_oneshot(dp2_results, ws1_results, job):
    variant, scenario, cfg_name, loss_name = job
    want, want_results, _, initial = ws1_results[("gpt", "oneshot", cfg_name, loss_name)]
    _check(
        dp2_results[0][job], dp2_results[1][job], want_results, want, initial, scenario,
        CONFIGS[cfg_name],
    )



# AdamW: megatron-core 0.16 builds its distributed optimizer for Adam/AdamW on float32/bf16
# only (SGD and float64 are refused: see megatron_backend._distributed_optimizer).
GPU_JOBS = [("tiny", s, "adamw32", lo) for s in DP_SCENARIOS for lo in LOSSES]


@pytest.mark.gpu
def test_dp2_gpu_distributed_optimizer_split_matches_oneshot(tmp_path):
    """NCCL + megatron's distributed optimizer: every split scenario equals one-shot."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    out = run_ranks(2, tmp_path, GPU_JOBS, gpu=True)
    for job in GPU_JOBS:
        want, want_results, _, initial = out[0][("tiny", "oneshot", job[2], job[3])]
        _check(out[0][job], out[1][job], want_results, want, initial, job[1], CONFIGS[job[2]])


@pytest.mark.gpu
def test_ws1_gpu_distributed_optimizer_split_matches_oneshot(tmp_path):
    """One GPU, NCCL, megatron's distributed optimizer: split in three == one-shot."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    jobs = [("tiny", s, "adamw32", lo) for s in ("oneshot", "split_even") for lo in LOSSES]
    out = run_ranks(1, tmp_path, jobs, gpu=True)[0]
    for lo in LOSSES:
        (w, r, _, initial), (want, want_r, _, _) = (
            out[("tiny", s, "adamw32", lo)] for s in ("split_even", "oneshot")
        )
        tolerance = weight_tolerance(CONFIGS["adamw32"], 2)
        assert max_param_diff(w, want) <= tolerance and max_param_diff(initial, want) > 1e-3
        assert [x.grad_norm for x in r] == pytest.approx([x.grad_norm for x in want_r], rel=1e-5)
