"""Split-API train step vs one-shot ``train()`` on the same data, side by side in one run.

For data-parallel world sizes 1 and 2 (two processes over gloo, or NCCL with --device
cuda and two GPUs) it times, interleaved step by step so drift hits every mode alike:

* ``oneshot``   -- ``train(batch)``: one microbatch per rank;
* ``split K=1`` -- begin / one train_microbatch / finish: the API's own overhead;
* ``split K=k`` -- begin / k train_microbatch / finish: the real use, smaller forwards.

and prints the median step time and its ratio to one-shot (target: <= 1.05), for each
loss in ``--losses`` (``[train.loss]`` presets, all timed in the same interleaved loop):
``default`` (token-level GRPO with truncated IS), ``gspo`` (sequence-level ratio against
the generator, sequence-level IS, sequence-mean aggregation) and ``dr-grpo``
(seq-mean-token-sum-norm, whose constant normaliser spans microbatches), ``cispo``.

    python bench/bench_trainer_split.py --iters 20 --microbatches 4 --losses default,gspo
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

from workers.batch import TrainBatch  # noqa: E402
from workers.loss import LossOptions, StepLoss  # noqa: E402
from workers.models.tiny import TinyConfig  # noqa: E402
from workers.trainer import distributed as dd  # noqa: E402
from workers.trainer.config import TinyModelFactory, TrainerRuntime, TrainSection  # noqa: E402
from workers.trainer.torch_backend import TorchTrainer  # noqa: E402


#: ``--losses`` presets: name -> ``[train.loss]`` keys (``--seq-len`` fills norm_length)
LOSSES: dict[str, dict[str, object]] = {
    "default": {},
    "gspo": {
        "policy_loss": "gspo", "old_policy": "generator", "is_correction": "seq-tis",
        "is_cap": 5.0, "aggregation": "sequence",
    },
    "dr-grpo": {"aggregation": "seq-mean-token-sum-norm", "norm_length": -1},
    "cispo": {"policy_loss": "cispo", "old_policy": "generator", "is_correction": "icepop",
              "is_min": 0.5},
}


def loss_config(name: str, args: argparse.Namespace) -> StepLoss:
    opts = dict(LOSSES[name])
    if opts.get("norm_length") == -1:
        opts["norm_length"] = args.seq_len
    return StepLoss(LossOptions(**opts))


def make_batch(args: argparse.Namespace, seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    b, t, v = args.batch, args.seq_len, args.vocab
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    pos = torch.arange(t).unsqueeze(0)
    att = pos < lengths.unsqueeze(1)
    mask = att & (pos >= args.prompt_len)
    ids = torch.where(att, torch.randint(2, v, (b, t), generator=g), 0)
    gen = torch.where(mask, -torch.rand(b, t, generator=g) * 3, 0.0)
    return TrainBatch(ids, att, mask, gen, torch.randn(b, generator=g))


def rows(batch: TrainBatch, parts: int) -> list[TrainBatch]:
    idx = torch.arange(batch.num_sequences).tensor_split(parts)
    return [batch.select(slice(int(i[0]), int(i[-1]) + 1)) for i in idx]


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    torch.set_num_threads(args.threads)
    if world > 1:
        dd.init_process_group(rank, world, "127.0.0.1", port)
    cfg = TinyConfig(
        vocab_size=args.vocab,
        context_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=4,
    )
    trainer = TorchTrainer(
        TinyModelFactory(cfg),
        TrainSection(lr=1e-4),
        TrainerRuntime(device=args.device, digest_on_finish=False),
    )
    batch = rows(make_batch(args, 0), world)[rank]
    modes = {
        "oneshot": None,
        "split K=1": rows(batch, 1),
        f"split K={args.microbatches}": rows(batch, args.microbatches),
    }
    losses = {name: loss_config(name, args) for name in args.losses.split(",")}
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    times: dict[tuple[str, str], list[float]] = {(n, m): [] for n in losses for m in modes}
    for it in range(args.warmup + args.iters):
        for (name, mode), ts in times.items():
            loss, mbs = losses[name], modes[mode]
            dd.barrier()
            sync()
            t0 = time.perf_counter()
            if mbs is None:
                trainer.train(batch, loss)
            else:
                trainer.begin_train_step(trainer.trainer_version, loss)
                for mb in mbs:
                    trainer.train_microbatch(mb)
                trainer.finish_train_step()
            sync()
            if it >= args.warmup:
                ts.append(time.perf_counter() - t0)
    if rank == 0:
        with open(Path(out_dir) / "times.pkl", "wb") as f:
            pickle.dump(times, f)
    dd.destroy_process_group()


def measure(world: int, args: argparse.Namespace) -> dict[tuple[str, str], list[float]]:
    with tempfile.TemporaryDirectory() as out:
        if world == 1:
            run_rank(0, 1, 0, args, out)
        else:
            import torch.multiprocessing as mp

            port = dd.find_free_port()
            mp.start_processes(
                run_rank, args=(world, port, args, out), nprocs=world, start_method="spawn"
            )
        with open(Path(out) / "times.pkl", "rb") as f:
            return pickle.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="global rows per step")
    p.add_argument("--seq-len", type=int, default=96)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4, help="K per rank")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--device", default="cpu")
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--losses", default="default,gspo,dr-grpo",
                   help=f"comma-separated [train.loss] presets: {', '.join(LOSSES)}")
    args = p.parse_args()
    unknown = set(args.losses.split(",")) - set(LOSSES)
    if unknown:
        p.error(f"--losses: unknown preset(s) {', '.join(sorted(unknown))}; choose from {', '.join(LOSSES)}")

    print(
        f"tiny LM d_model={args.d_model} layers={args.layers}, global batch {args.batch}x"
        f"{args.seq_len}, {args.threads} thread(s)/rank, device {args.device}, "
        f"median of {args.iters} interleaved steps"
    )
    print(f"{'DP':>3} {'loss':<9} {'mode':<12} {'median s':>10} {'min s':>9} {'vs one-shot':>12}")
    for world in (int(w) for w in args.worlds.split(",")):
        times = measure(world, args)
        for (name, mode), ts in times.items():
            base = statistics.median(times[(name, "oneshot")])
            med = statistics.median(ts)
            print(
                f"{world:>3} {name:<9} {mode:<12} {med:>10.4f} {min(ts):>9.4f} "
                f"{med / base:>11.3f}x"
            )


if __name__ == "__main__":
    main()
