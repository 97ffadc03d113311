"""Durable, verifiable checkpoint directories.

Layout of a finished checkpoint ``<dir>/``::

    manifest.json      {"format_version", "meta", "files": {name: sha256}}
    model.pt           policy state_dict           (rank 0)
    optimizer.pt       optimizer state_dict        (rank 0)
    scheduler.pt       LR scheduler state_dict     (rank 0)
    rng_rank<r>.pt     torch RNG states of rank r  (every rank)

Atomicity: files are written into a hidden sibling staging directory, each file is
fsynced, then rank 0 hashes them, writes and fsyncs the manifest, fsyncs the staging
directory, renames it to ``<dir>`` and fsyncs the parent. A crash leaves either no
``<dir>`` or a complete one; a stale staging directory is removed by the next save.
Data-parallel ranks must share the filesystem that holds ``<dir>``.

``verify`` recomputes every hash before anything is loaded; any mismatch, missing file
or unreadable manifest raises :class:`CheckpointCorruptError` naming what is wrong.

:class:`FileCheckpoint` is this layout as a ``workers.trainer.parallel.CheckpointFormat``
(the torch and megatron backends); the FSDP2 backend's sharded format is in
``fsdp2_checkpoint`` and shares the staging, hashing and manifest code here.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers.api import CHECKPOINT_MANIFEST
from workers.trainer import distributed as dd
from workers.trainer.parallel import CheckpointParts, Restored

MANIFEST_NAME = CHECKPOINT_MANIFEST
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or does not fit this trainer."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files do not match its manifest (or the manifest is unreadable)."""


def staging_dir(final: Path) -> Path:
    return final.parent / f".{final.name}.partial"


def prepare_staging(final: Path) -> Path:
    """Create an empty staging directory for ``final`` (rank 0 only)."""
    staging = staging_dir(final)
    if staging.exists():
        shutil.rmtree(staging)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging.mkdir()
    return staging


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_torch(directory: Path, name: str, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    write_bytes_durable(directory / name, buf.getvalue())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def finalize(staging: Path, final: Path, meta: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """Hash the staged files, write the manifest, publish atomically (rank 0 only).

    Returns (sha256 of the manifest, {file: sha256}).
    """
    files = {
        p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.name != MANIFEST_NAME
    }
    manifest = {"format_version": FORMAT_VERSION, "meta": meta, "files": files}
    data = json.dumps(manifest, indent=2, sort_keys=True).encode()
    write_bytes_durable(staging / MANIFEST_NAME, data)
    _fsync_dir(staging)
    if final.exists():
        raise CheckpointError(f"checkpoint directory {final} already exists")
    os.rename(staging, final)
    _fsync_dir(final.parent)
    return hashlib.sha256(data).hexdigest(), files


def verify(directory: Path) -> tuple[dict[str, Any], str]:
    """Check every file against the manifest; returns (manifest, sha256 of the manifest)."""
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    try:
        data = path.read_bytes()
        manifest = json.loads(data)
        files = manifest["files"]
        version = manifest["format_version"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointCorruptError(
            f"checkpoint {directory}: unreadable manifest ({err})"
        ) from err
    if version != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"checkpoint {directory}: format_version {version!r}, expected {FORMAT_VERSION}"
        )
    for name, want in sorted(files.items()):
        file = directory / name
        if not file.is_file():
            raise CheckpointCorruptError(f"checkpoint {directory}: file {name} is missing")
        got = sha256_file(file)
        if got != want:
            raise CheckpointCorruptError(
                f"checkpoint {directory}: sha256 of {name} is {got}, manifest says {want}"
            )
    return manifest, hashlib.sha256(data).hexdigest()


def read_torch(directory: Path, name: str) -> Any:
    # Verified against the manifest first; weights_only keeps loading free of code execution.
    return torch.load(directory / name, map_location="cpu", weights_only=True)


def save_collective(
    final: Path,
    *,
    rank: int,
    rank_files: dict[str, Any],
    rank0_files: Callable[[], dict[str, Any]],
    meta: Callable[[], dict[str, Any]],
) -> tuple[str, dict[str, str]]:
    """Write a checkpoint from every data-parallel rank (a collective); returns rank 0's
    (manifest sha256, files).

    Every rank writes its ``rank_files`` (its RNG state) into the staging directory;
    rank 0 also writes ``rank0_files()`` and, after a barrier, finalizes with ``meta()``.
    If rank 0 fails, every rank raises :class:`CheckpointError`, not only rank 0.
    """
    if final.exists():
        raise CheckpointError(f"checkpoint directory {final} already exists")
    outcome: tuple[str, Any] = ("ok", None)
    if rank == 0:
        prepare_staging(final)
    dd.barrier()
    staging = staging_dir(final)
    for name, obj in rank_files.items():
        write_torch(staging, name, obj)
    if rank == 0:
        for name, obj in rank0_files().items():
            write_torch(staging, name, obj)
    dd.barrier()
    if rank == 0:
        try:
            outcome = ("ok", finalize(staging, final, meta()))
        except Exception as err:  # every rank must learn of it, not only rank 0
            outcome = ("error", f"{type(err).__name__}: {err}")
    status, payload = dd.all_gather_objects(outcome)[0]
    if status == "error":
        raise CheckpointError(f"saving checkpoint {final} failed on rank 0: {payload}")
    return payload


@dataclass
class TrainerFiles:
    """A verified checkpoint's contents, as one rank of a torch trainer loads them."""

    manifest: dict[str, Any]
    sha256: str
    model: Any
    optimizer: Any
    scheduler: Any
    #: this rank's RNG states; None when the checkpoint was written at another world size
    rng: Any | None


def read_trainer_files(final: Path, rank: int) -> TrainerFiles:
    """Verify every file's hash (:func:`verify`), then read what ``rank`` restores."""
    manifest, sha = verify(final)
    rng_name = f"rng_rank{rank}.pt"
    return TrainerFiles(
        manifest=manifest,
        sha256=sha,
        model=read_torch(final, "model.pt"),
        optimizer=read_torch(final, "optimizer.pt"),
        scheduler=read_torch(final, "scheduler.pt"),
        rng=read_torch(final, rng_name) if rng_name in manifest["files"] else None,
    )


class FileCheckpoint:
    """The replicated backends' format (torch, megatron): rank 0 writes the full
    model / optimizer / scheduler state dicts, every rank its RNG states."""

    def save(
        self,
        final: Path,
        parts: CheckpointParts,
        rng: dict[str, Any],
        meta: Callable[[], dict[str, Any]],
    ) -> tuple[str, dict[str, str]]:
        return save_collective(
            final,
            rank=parts.rank,
            rank_files={f"rng_rank{parts.rank}.pt": rng},
            rank0_files=lambda: {
                "model.pt": parts.model.state_dict(),
                "optimizer.pt": parts.optimizer.state_dict(),
                "scheduler.pt": parts.scheduler.state_dict(),
            },
            meta=meta,
        )

    def load(
        self, final: Path, parts: CheckpointParts, accept: Callable[[Mapping[str, Any]], None]
    ) -> Restored:
        got = read_trainer_files(final, parts.rank)
        accept(got.manifest["meta"])
        parts.model.load_state_dict(got.model)
        parts.optimizer.load_state_dict(got.optimizer)
        parts.scheduler.load_state_dict(got.scheduler)
        return Restored(got.manifest["meta"], got.sha256, got.manifest["files"], got.rng)


class UnsupportedCheckpoint:
    """A backend configuration that cannot checkpoint yet: both calls say why."""

    def __init__(self, save_reason: str, load_reason: str) -> None:
        self.save_reason, self.load_reason = save_reason, load_reason

    def save(self, final: Path, *unused: Any) -> tuple[str, dict[str, str]]:
        raise CheckpointError(self.save_reason)

    def load(self, final: Path, *unused: Any) -> Restored:
        raise CheckpointError(self.load_reason)
