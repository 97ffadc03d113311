"""Durable spill: a data plane wrapper that writes every row through to disk.

Payload rows must outlive a full restart until a checkpoint covers the step that
consumed them (DESIGN.md, "Recovery"). This wrapper implements the data plane
protocol over any inner plane and mirrors each row into a safetensors file::

    {directory}/{quote(partition)}/{quote(key)}.safetensors   # tensors; tags in metadata

Files are written atomically (temporary file, fsync, rename, fsync of the directory),
so after a crash a row file is either the complete old or the complete new row.
Disk is written before the inner plane, so a row the inner plane holds is on disk.
After a restart, :meth:`SpillDataPlane.reload` puts every spilled row back into the
(fresh) inner plane.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote, unquote

from safetensors.torch import load_file, save_file

from workers.dataplane.api import DataPlane, Fields, Row, Tags, as_columns

_SUFFIX = ".safetensors"
_TAGS = "tags"
_TMP_PREFIX = ".tmp-"


class SpillDataPlane:
    def __init__(self, inner: DataPlane, directory: str | os.PathLike[str]) -> None:
        self.inner = inner
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def put(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Fields,
        tags: Sequence[Tags] | None = None,
    ) -> None:
        keys, columns, tag_list = as_columns(keys, fields, tags)
        folder = self._folder(partition)
        folder.mkdir(parents=True, exist_ok=True)
        for i, key in enumerate(keys):
            path = folder / (quote(key, safe="") + _SUFFIX)
            row, old_tags = _read(path) if path.exists() else ({}, {})
            row.update({name: values[i] for name, values in columns.items()})
            _write_atomic(path, row, old_tags if tag_list is None else tag_list[i])
        _fsync_dir(folder)
        self.inner.put(partition, keys, columns, tag_list)

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> list[Row]:
        return self.inner.get(partition, keys, fields)

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None:
        # Inner first: a row on disk but not in memory is restored by reload; the
        # reverse (in memory, gone from disk) would not survive a restart unnoticed.
        self.inner.clear(partition, keys)
        folder = self._folder(partition)
        if not folder.exists():
            return
        if keys is None:
            doomed = list(folder.glob("*" + _SUFFIX))
        else:
            doomed = [folder / (quote(k, safe="") + _SUFFIX) for k in keys]
        for path in doomed:
            path.unlink(missing_ok=True)
        _fsync_dir(folder)

    def list(self, partition: str) -> list[str]:
        return self.inner.list(partition)

    def tags(self, partition: str) -> dict[str, Tags]:
        return self.inner.tags(partition)

    def close(self) -> None:
        self.inner.close()

    # -- recovery -----------------------------------------------------------------

    def spilled_partitions(self) -> list[str]:
        return sorted(unquote(p.name) for p in self.directory.iterdir() if p.is_dir())

    def reload(self, partition: str | None = None) -> int:
        """Put every spilled row (of ``partition``, or all) back into the inner plane.

        Returns the number of rows reloaded.
        """
        parts = self.spilled_partitions() if partition is None else [partition]
        count = 0
        for part in parts:
            folder = self._folder(part)
            for path in sorted(folder.glob("*" + _SUFFIX)) if folder.exists() else []:
                if path.name.startswith(_TMP_PREFIX):
                    # a write that a crash interrupted before its rename: never a row
                    path.unlink(missing_ok=True)
                    continue
                row, tags = _read(path)
                key = unquote(path.name[: -len(_SUFFIX)])
                self.inner.put(part, [key], [row], [tags])
                count += 1
        return count

    def _folder(self, partition: str) -> Path:
        if not partition:
            raise ValueError("partition must be a non-empty string")
        return self.directory / quote(partition, safe="")


def _read(path: Path) -> tuple[Row, Tags]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return load_file(str(path)), json.loads(meta.get(_TAGS, "{}"))


def _write_atomic(path: Path, row: Row, tags: Tags) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX, suffix=_SUFFIX)
    os.close(fd)
    try:
        tensors = {k: v.detach().cpu().contiguous() for k, v in row.items()}
        save_file(tensors, tmp, metadata={_TAGS: json.dumps(tags, sort_keys=True)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
