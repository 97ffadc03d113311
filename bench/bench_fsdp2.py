"""FSDP2 backend at data parallel 2 vs the torch backend, side by side in one run.

Two gloo processes; per backend (torch: replicated ranks + one flat all-reduce;
fsdp2 ``gathered``: parameters all-gathered once at the step's first forward and kept
to finish, gradients reduced once at finish; fsdp2 ``per_microbatch``, the default:
all-gathered and reduce-scattered every microbatch) it prints:

* per-rank bytes of parameters + gradients + optimizer state (AdamW) at rest (between
  steps) and at the peak inside an open step after the microbatches (gathered
  parameters and unsharded gradients count in full), with the ratios to the torch
  backend's (target for fsdp2: <= 0.6);
* the median step time of the split API (begin / K microbatches / finish) at K = 1
  (the API's own cost; target <= 1.10) and K = --microbatches, and of the same
  backend's one-shot ``train()`` on the same rows, interleaved step by step, with the
  ratios, and the split step against fsdp2's default-resharding one-shot (what FSDP
  does without the split API). Resharding modes all-gather each block's parameters in
  every microbatch's forward and backward (and per_microbatch reduce-scatters each
  time): K microbatches pay those collectives K times; ``gathered`` pays them once.

The per-microbatch collectives are a fixed cost, so the K-microbatch ratio depends on
the tokens per microbatch per rank (printed in the header): sweep the shape with

    python bench/bench_fsdp2.py --iters 10 --microbatches 4
    python bench/bench_fsdp2.py --iters 5 --seq-len 128 --batch 256   # ~3k tokens
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_trainer_split import make_batch, rows  # noqa: E402
from workers.loss import StepLoss  # noqa: E402
from workers.models.tiny import TinyConfig  # noqa: E402
from workers.trainer import distributed as dd  # noqa: E402
from workers.trainer.config import TinyModelFactory, TrainerRuntime, TrainSection  # noqa: E402
from workers.trainer.fsdp2_backend import Fsdp2Options, Fsdp2Trainer  # noqa: E402
from workers.trainer.torch_backend import TorchTrainer  # noqa: E402

BACKENDS = ("torch", "fsdp2 gathered", "fsdp2 per_microbatch")
#: FSDP's own behaviour without the split API: the one-shot the others are held to
FSDP_REFERENCE = "fsdp2 per_microbatch"


def _bytes(tensors) -> int:
    from workers.trainer.fsdp2_shard import local_bytes

    return local_bytes(tensors)


def memory(trainer) -> int:
    """Parameter + gradient + optimizer-state bytes held by this rank right now.

    Gradients include any unsharded accumulation FSDP keeps out of the module's sight
    (read from its internals: the bench may look; the trainer does not).
    """
    params = list(trainer.model.parameters())
    state = [t for s in trainer.optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    unsharded = []
    p = trainer.parallel
    for m in p.reduction.fsdp_modules if p.backend == "fsdp2" else []:
        for group in m._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                unsharded.append(fp.unsharded_accumulated_grad)
                unsharded.append(getattr(getattr(fp, "_unsharded_param", None), "grad", None))
    seen: set[int] = set()  # while gathered, the module's parameters ARE the unsharded ones

    def once(tensors):
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                yield t

    grads = [p.grad for p in params]
    return _bytes(once(params)) + _bytes(once(grads)) + _bytes(state) + _bytes(once(unsharded))


def build(name: str, args: argparse.Namespace):
    factory = TinyModelFactory(TinyConfig(
        vocab_size=args.vocab, context_len=args.seq_len, d_model=args.d_model,
        n_layers=args.layers, n_heads=4,
    ))
    runtime = TrainerRuntime(digest_on_finish=False)
    if name == "torch":
        return TorchTrainer(factory, TrainSection(lr=1e-4), runtime)
    mode = name.split()[1]
    train = TrainSection(backend="fsdp2", lr=1e-4, fsdp2_grad_reduce=mode)  # type: ignore[arg-type]
    return Fsdp2Trainer(factory, train, runtime, Fsdp2Options())


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    torch.set_num_threads(args.threads)
    dd.init_process_group(rank, world, "127.0.0.1", port, "gloo")
    loss = StepLoss()
    batch = rows(make_batch(args, 0), world)[rank]
    splits = {1: rows(batch, 1), args.microbatches: rows(batch, args.microbatches)}
    out: dict[str, dict] = {}
    trainers = {name: build(name, args) for name in BACKENDS}
    for name, t in trainers.items():
        t.train(batch, loss)  # warm-up; optimizer state exists from here on
        rest = memory(t)
        t.begin_train_step(1, loss)
        for mb in splits[args.microbatches]:
            t.train_microbatch(mb)
        out[name] = {"rest": rest, "bytes": memory(t), "oneshot": [], **{k: [] for k in splits}}
        t.abort_train_step()
    for _ in range(args.iters):
        for name, t in trainers.items():
            for k, mbs in splits.items():
                dd.barrier()
                start = time.perf_counter()
                t.begin_train_step(0, loss)
                for mb in mbs:
                    t.train_microbatch(mb)
                t.finish_train_step()
                out[name][k].append(time.perf_counter() - start)
            dd.barrier()
            start = time.perf_counter()
            t.train(batch, loss)
            out[name]["oneshot"].append(time.perf_counter() - start)
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(out, f)
    dd.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="global rows per step")
    p.add_argument("--seq-len", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(run_rank, args=(2, dd.find_free_port(), args, tmp), nprocs=2,
                           start_method="spawn")
        ranks = [pickle.load(open(Path(tmp) / f"rank{r}.pkl", "rb")) for r in range(2)]
    base = max(r["torch"]["bytes"] for r in ranks)
    k = args.microbatches
    tokens = int(rows(make_batch(args, 0), 2)[0].attention_mask.sum())
    print(f"dp 2, K = {k} microbatches, {args.iters} interleaved steps, "
          f"~{tokens // k} tokens per microbatch per rank ({args.batch} rows x <= {args.seq_len})")

    def median(name: str, key) -> float:  # a step lasts as long as its slowest rank
        return statistics.median(max(a, b) for a, b in zip(*(r[name][key] for r in ranks)))

    rest_base = max(r["torch"]["rest"] for r in ranks)
    fsdp_one = median(FSDP_REFERENCE, "oneshot")
    print(f"{'backend':<22} {'rest B/rank':>11} {'vs torch':>8} {'peak B/rank':>11} {'vs torch':>8} "
          f"{'one-shot s':>10} {'split K=1':>9} {'ratio':>6} {f'split K={k}':>9} {'ratio':>6} "
          f"{'vs fsdp':>7}")
    for name in BACKENDS:
        rest = max(r[name]["rest"] for r in ranks)
        peak = max(r[name]["bytes"] for r in ranks)
        one, s1, sk = median(name, "oneshot"), median(name, 1), median(name, k)
        vs_fsdp = "" if name == "torch" else f"{sk / fsdp_one:>6.2f}x"
        print(f"{name:<22} {rest:>11,} {rest / rest_base:>7.2f}x {peak:>11,} {peak / base:>7.2f}x "
              f"{one:>10.4f} {s1:>9.4f} {s1 / one:>5.2f}x {sk:>9.4f} {sk / one:>5.2f}x {vs_fsdp:>7}")
    print(f"targets: fsdp2 bytes <= 0.60x of torch; split K={k} <= 1.10x of one-shot; "
          f"'vs fsdp': split K={k} against {FSDP_REFERENCE}'s one-shot")


if __name__ == "__main__":
    main()
