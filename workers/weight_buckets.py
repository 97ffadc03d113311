"""A state dict cut into bounded buckets of bytes, and put back together.

Weight refit streams the trainer's weights to the generators one bucket at a time, so
no message (a Ray object, an RPC into a vLLM engine process) is ever larger than
``bucket_bytes``, whatever the model's size. A bucket is a safetensors blob of flat
pieces; a tensor larger than a bucket is split across consecutive buckets. The plan
(which piece goes where) depends only on names, shapes and dtypes, so the sender can
serialise bucket ``i`` alone, and the receiver needs no side channel: every piece
carries its tensor's name, shape and offset in the blob's metadata.

Invariants: pieces of one tensor arrive in order; a tensor is yielded by
:func:`unpack_buckets` once all its elements have arrived, exactly once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

_META_KEY = "rlc_pieces"


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + numel)`` of the flattened tensor ``name``."""

    name: str
    shape: tuple[int, ...]
    start: int
    numel: int


def plan_buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[Piece]]:
    """Pieces per bucket, each bucket holding at most ``bucket_bytes`` of tensor data."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[Piece]] = [[]]
    room = bucket_bytes
    for name, tensor in state_dict.items():
        item = tensor.element_size()
        if item > bucket_bytes:
            raise ValueError(f"bucket_bytes {bucket_bytes} is smaller than one {tensor.dtype} element")
        total, start = tensor.numel(), 0
        if total == 0:
            buckets[-1].append(Piece(name, tuple(tensor.shape), 0, 0))
        while start < total:
            if room < item:
                buckets.append([])
                room = bucket_bytes
            take = min(total - start, room // item)
            buckets[-1].append(Piece(name, tuple(tensor.shape), start, take))
            room -= take * item
            start += take
    return [b for b in buckets if b]


def pack_bucket(state_dict: Mapping[str, torch.Tensor], pieces: list[Piece]) -> bytes:
    """One bucket's bytes (a safetensors blob of the pieces' flat slices)."""
    tensors = {}
    for i, p in enumerate(pieces):
        flat = state_dict[p.name].detach().to("cpu").reshape(-1)
        tensors[f"p{i}"] = flat[p.start : p.start + p.numel].clone()
    meta = [[p.name, list(p.shape), p.start, p.numel] for p in pieces]
    return st_save(tensors, metadata={_META_KEY: json.dumps(meta)})


def iter_buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int) -> Iterator[bytes]:
    for pieces in plan_buckets(state_dict, bucket_bytes):
        yield pack_bucket(state_dict, pieces)


def _pieces(blob: bytes) -> list[Piece]:
    header_len = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + header_len])
    meta = json.loads(header["__metadata__"][_META_KEY])
    return [Piece(n, tuple(s), start, numel) for n, s, start, numel in meta]


def unpack_buckets(buckets: Iterable[bytes]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor, as soon as its last piece has arrived."""
    partial: dict[str, tuple[torch.Tensor, int]] = {}
    for blob in buckets:
        tensors = st_load(blob)
        for i, p in enumerate(_pieces(blob)):
            flat = tensors[f"p{i}"]
            total = 1
            for d in p.shape:
                total *= d
            if p.start == 0 and p.numel == total:
                yield p.name, flat.reshape(p.shape)
                continue
            buf, filled = partial.get(p.name, (torch.empty(total, dtype=flat.dtype), 0))
            if p.start != filled:
                raise ValueError(f"weight bucket piece of {p.name!r} out of order ({p.start} != {filled})")
            buf[p.start : p.start + p.numel] = flat
            filled += p.numel
            if filled == total:
                partial.pop(p.name, None)
                yield p.name, buf.reshape(p.shape)
            else:
                partial[p.name] = (buf, filled)
    if partial:
        raise ValueError(f"weight buckets ended with incomplete tensors {sorted(partial)}")


def bucket_nbytes(buckets: Iterable[bytes]) -> int:
    return sum(len(b) for b in buckets)
