"""Process-group helpers for data-parallel trainer ranks (gloo on CPU, NCCL on GPU).

The trainer only ever uses the default process group, and only inside
``finish_train_step`` / ``save_checkpoint`` / construction -- never inside a
microbatch -- so a rank can run any number of microbatches (or dummies) without any
chance of a collective mismatch.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from workers.batch import TrainBatch

Backend = Literal["gloo", "nccl"]


def init_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: Backend | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Join the default group; backend defaults to NCCL when CUDA is available, else gloo."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def destroy_process_group() -> None:
    if is_distributed():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a one-element list without a group)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_module_(module: nn.Module, src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s."""
    if not is_distributed():
        return
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src)


def all_reduce_sum_flat_(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> None:
    """Sum ``tensors`` in place across ranks, packing them into flat buffers.

    Each element is reduced exactly once; tensors are grouped by dtype and packed into
    buckets of at most ``bucket_bytes`` (a single tensor larger than that is its own
    bucket), so a small model costs one collective.
    """
    if not is_distributed():
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        bucket: list[torch.Tensor] = []
        size = 0
        for t in by_dtype[dtype]:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > bucket_bytes:
                _reduce_bucket(bucket)
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            _reduce_bucket(bucket)


def _reduce_bucket(bucket: list[torch.Tensor]) -> None:
    flat = torch.cat([t.reshape(-1) for t in bucket])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for t in bucket:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def shard_rows(batch: TrainBatch, world_size: int) -> list[TrainBatch | None]:
    """Split a batch's rows into ``world_size`` contiguous, near-equal shards.

    A rank that gets no rows gets None (it will run a zero-weight dummy).
    """
    b = batch.num_sequences
    base, extra = divmod(b, world_size)
    out: list[TrainBatch | None] = []
    start = 0
    for r in range(world_size):
        n = base + (1 if r < extra else 0)
        out.append(batch.select(slice(start, start + n)) if n else None)
        start += n
    return out
