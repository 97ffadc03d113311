"""What spooling a received weight version to a file costs, and what it saves.

A generator receives a version bucket by bucket (``workers.weight_sync.BucketReceiver``)
and loads it into its model at the next boundary. Two variants, side by side, on the
same model and buckets:

* ``memory``: the buckets kept as ``bytes`` until the load (what the receiver did
  before it spooled) -- ``VersionedWeights.update`` with an in-memory stream;
* ``spool``: the receiver as it is, each bucket written to an unlinked file as it
  arrives and read back one at a time while loading.

Both load tensor by tensor into the model's parameters. Reports ms per MB (median of
``--repeats``) and the peak Python-heap bytes of the receive + load (``tracemalloc``;
bucket bytes live there, tensor storage does not), each with the ratio spool/memory.

    python -m bench.bench_refit_spool [--mib 64] [--bucket-mib 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import torch
from torch import nn

from workers.weight_sync import BucketReceiver, VersionedWeights, WeightStream, cpu_state_dict
from workers.weight_transport import RefitSource


def _model(mib: float) -> nn.Module:
    side = 512
    layers = max(1, round(mib * 2**20 / (side * side * 4)))
    return nn.Sequential(*(nn.Linear(side, side, bias=False) for _ in range(layers)))


def _buckets(weights, bucket_bytes: int) -> list[bytes]:
    source = RefitSource(lambda: weights)
    count = source.prepare_weight_buckets(1, bucket_bytes)
    return [source.weight_bucket(1, i) for i in range(count)]


def _memory(target: VersionedWeights, blobs: list[bytes], version: int) -> None:
    kept = [bytes(memoryview(b)) for b in blobs]  # fresh objects, as received from Ray
    target.update(version, WeightStream(tuple(kept)))


def _spool(target: VersionedWeights, blobs: list[bytes], version: int) -> None:
    receiver = BucketReceiver(target)
    for i, b in enumerate(blobs):
        receiver.receive(version, i, len(blobs), bytes(memoryview(b)))


def _measure(variant, blobs: list[bytes], mb: float, repeats: int) -> tuple[float, int]:
    target = VersionedWeights(_model(mb / 1.048576), "g0")
    variant(target, blobs, 1)  # warm
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        variant(target, blobs, 2 + r)
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    try:
        variant(target, blobs, 2 + repeats)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return statistics.median(times) * 1e3 / mb, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=64, help="model size, MiB")
    ap.add_argument("--bucket-mib", type=float, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = cpu_state_dict(_model(args.mib))
    mb = sum(t.numel() * t.element_size() for t in weights.values()) / 1e6
    blobs = _buckets(weights, int(args.bucket_mib * 2**20))
    print(f"model {mb:.1f} MB, {len(blobs)} buckets of {args.bucket_mib} MiB")
    mem_ms, mem_peak = _measure(_memory, blobs, mb, args.repeats)
    spool_ms, spool_peak = _measure(_spool, blobs, mb, args.repeats)
    print(f"{'':>8} {'ms/MB':>8} {'peak MB':>8}")
    print(f"{'memory':>8} {mem_ms:>8.2f} {mem_peak / 1e6:>8.1f}")
    print(f"{'spool':>8} {spool_ms:>8.2f} {spool_peak / 1e6:>8.1f}")
    print(f"spool/memory: time {spool_ms / mem_ms:.2f}x, peak {spool_peak / mem_peak:.3f}x")


if __name__ == "__main__":
    main()
