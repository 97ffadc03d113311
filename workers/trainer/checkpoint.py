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
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

MANIFEST_NAME = "manifest.json"
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
