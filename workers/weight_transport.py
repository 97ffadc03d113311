"""How one weight version travels from the trainer worker to the generator workers.

The interface is one method, :meth:`WeightTransport.send`: given the version, the
trainer's handle and the generators' handles, deliver the weights and return every
generator's :class:`~workers.weight_sync.WeightsAck`. The generator side does not
know the transport: it receives buckets (``receive_weight_bucket``) and acks the
version once the last one is loaded (``workers.weight_sync.BucketReceiver``).

:class:`BucketTransport` is the CPU path: the trainer cuts its exported state dict into
buckets of at most ``bucket_bytes`` (``workers.weight_buckets``) and they go one at a
time; with Ray handles each bucket is one object in the object store that every
generator reads by reference (one put, many gets), in-process it is handed over
directly. So the largest message is one bucket, whatever the model's size. A GPU
transport (an NCCL broadcast from trainer rank 0 into the generators' buffers, or CUDA
IPC handles on one node) is another implementation of ``send``; nothing else changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from workers.calls import WeightSink, WeightSource
from workers.weight_buckets import Piece, pack_bucket, plan_buckets
from workers.weight_sync import WeightsAck

#: Default refit bucket: large enough that per-bucket overhead vanishes, small enough
#: to bound the transport's memory.
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


class WeightTransport(Protocol):
    async def send(self, version: int, trainer: Any, generators: Sequence[Any]) -> list[WeightsAck]:
        """Deliver ``version`` from ``trainer`` to every handle in ``generators``."""
        ...


class BucketTransport:
    """Bucket by bucket through the handles' own calls (Ray object store or in-process)."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"refit bucket size must be >= 1 byte, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes

    async def send(self, version: int, trainer: Any, generators: Sequence[Any]) -> list[WeightsAck]:
        count = await trainer.call(WeightSource.prepare_weight_buckets, version, self.bucket_bytes)
        acks: list[Any] = [None] * len(generators)
        for index in range(count):
            # relayed: a Ray handle passes a reference (the bucket is stored once and
            # each generator fetches it; the controller never holds it)
            bucket = await trainer.relay(WeightSource.weight_bucket, version, index)
            acks = await asyncio.gather(*(
                g.call(WeightSink.receive_weight_bucket, version, index, count, bucket)
                for g in generators
            ))
        if any(a is None for a in acks):
            raise RuntimeError(f"weight version {version}: a generator did not acknowledge")
        return list(acks)


class RefitSource:
    """The trainer's side of :class:`BucketTransport`: export once, serve bucket by bucket.

    ``export`` is any backend's ``export_weights`` (torch, megatron, FSDP2): a CPU state
    dict in HF-compatible names. The export is held from ``prepare_weight_buckets``
    until its last bucket has been served.
    """

    def __init__(self, export: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self._export = export
        self._held: tuple[int, Mapping[str, torch.Tensor], list[list[Piece]]] | None = None

    def prepare_weight_buckets(self, version: int, bucket_bytes: int) -> int:
        weights = self._export()
        self._held = (version, weights, plan_buckets(weights, bucket_bytes))
        return len(self._held[2])

    def weight_bucket(self, version: int, index: int) -> bytes:
        if self._held is None or self._held[0] != version:
            raise RuntimeError(f"weight_bucket: weights of version {version} were not prepared")
        _, weights, plan = self._held
        blob = pack_bucket(weights, plan[index])
        if index == len(plan) - 1:
            self._held = None
        return blob
