"""Durable spill: a data plane wrapper that writes every put through to disk.

Payload rows must outlive a full restart until a checkpoint covers the step that
consumed them (docs/DESIGN.md, "Recovery"). This wrapper implements the data plane
protocol over any inner plane and writes each ``put`` (a generator writes one group's
samples per put) as ONE memory-mapped ``TensorDict`` (``TensorDict.memmap``)::

    {directory}/{quote(partition)}/{stamp}[-{group}].{generation}/   # batch [n]: the put's rows
        <field>.memmap ...   jagged fields as nested tensors; "__keys__", "__tags__"
        meta.json            hold the keys and tags (JSON), next to the tensors

``{group}`` names, as a short hash, the ``{run}/{group}`` prefix that every key of the put
shares (a generator's put is one group's rows; keys are ``{run}/{group}/a{attempt}/...``,
see ``workers.dataplane.api``). :class:`SpillReader` reads a few keys by listing the
partition's directory names and opening only the puts of the keys' groups -- never the
whole spill. A put without the mark (keys of several groups, or written by an earlier
release) is opened by every keyed read, so the mark only saves work, never decides.

Directories are written whole and then renamed into place (temporary directory, fsync of
every file, rename, fsync of the partition directory), so after a crash a put is either
entirely on disk or not at all. Disk is written before the inner plane, so a row the
inner plane holds is on disk. A put is never changed in place: clearing some of its keys
writes the rest as the next generation of the same stamp, then deletes the old one.

:meth:`SpillDataPlane.reload` replays the puts in stamp order into a (fresh) inner
plane, which reproduces the ``put`` semantics exactly (later fields replace earlier
ones, tags given replace tags). A spill directory from an earlier release, which kept
one safetensors file per row, is refused with an error that says so (see
``docs/recovery.md``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote, unquote

import torch
from tensordict import TensorDict

from workers.dataplane.api import (
    DataPlane,
    DataPlaneError,
    Fields,
    MissingPayloadError,
    Row,
    Tags,
    as_columns,
    rows_of,
)

_KEYS = "__keys__"
_TAGS = "__tags__"
_TMP_PREFIX = ".tmp-"
_LEGACY_SUFFIX = ".safetensors"
_counter = itertools.count()


class SpillDataPlane:
    def __init__(self, inner: DataPlane, directory: str | os.PathLike[str]) -> None:
        self.inner = inner
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        #: keys of each put directory seen (directories are immutable once renamed in)
        self._keys_of: dict[Path, list[str]] = {}

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
        # stamp: time for order across processes, pid and a counter for uniqueness
        stamp = f"{time.time_ns():020d}-{os.getpid()}-{next(_counter):08d}"
        groups = {_group_mark(k) for k in keys}
        if len(groups) == 1:  # the keyed reader's index: see the module docstring
            stamp = f"{stamp}-{groups.pop()}"
        _write_put(folder, f"{stamp}.0", keys, columns, tag_list)
        self.inner.put(partition, keys, columns, tag_list)

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> list[Row]:
        return self.inner.get(partition, keys, fields)

    def get_batch(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> TensorDict:
        return self.inner.get_batch(partition, keys, fields)

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None:
        # Inner first: a row on disk but not in memory is restored by reload; the
        # reverse (in memory, gone from disk) would not survive a restart unnoticed.
        self.inner.clear(partition, keys)
        folder = self._folder(partition)
        if not folder.exists():
            return
        if keys is None:
            _remove_dir(folder)
            return
        doomed = set(keys)
        for path in _put_dirs(folder):
            put_keys = self._put_keys(path)
            if doomed.isdisjoint(put_keys):
                continue
            if not doomed.issuperset(put_keys):  # keep the rest as the next generation
                td = TensorDict.load_memmap(path)
                keep = [i for i, k in enumerate(put_keys) if k not in doomed]
                rows = rows_of(td.exclude(_KEYS, _TAGS))
                tags = json.loads(td.get_non_tensor(_TAGS))
                stamp, generation = path.name.rsplit(".", 1)
                _write_put(
                    folder,
                    f"{stamp}.{int(generation) + 1}",
                    [put_keys[i] for i in keep],
                    {n: [rows[i][n] for i in keep] for n in rows[0]},
                    None if tags is None else [tags[i] for i in keep],
                )
            _remove_dir(path)
            self._keys_of.pop(path, None)

    def list(self, partition: str) -> list[str]:
        return self.inner.list(partition)

    def tags(self, partition: str) -> dict[str, Tags]:
        return self.inner.tags(partition)

    def close(self) -> None:
        self.inner.close()

    # -- recovery -----------------------------------------------------------------

    def spilled_partitions(self) -> list[str]:
        return sorted(
            unquote(p.name) for p in self.directory.iterdir()
            if p.is_dir() and not p.name.startswith(_TMP_PREFIX)
        )

    def reload(self, partition: str | None = None, *, tidy: bool = True) -> int:
        """Put every spilled row (of ``partition``, or all) back into the inner plane.

        Returns the number of distinct keys reloaded. ``tidy``: also delete what a crash
        left behind (see ``_put_dirs``); a reader beside a live run must not, since a
        temporary directory may be a put being written right now.
        """
        parts = self.spilled_partitions() if partition is None else [partition]
        count = 0
        for part in parts:
            folder = self._folder(part)
            if not folder.exists():
                continue
            _refuse_legacy(folder)
            seen: set[str] = set()
            for path in _put_dirs(folder, tidy=tidy):
                td = TensorDict.load_memmap(path)
                keys = json.loads(td.get_non_tensor(_KEYS))
                tags = json.loads(td.get_non_tensor(_TAGS))
                self.inner.put(part, keys, rows_of(td.exclude(_KEYS, _TAGS)), tags)
                seen.update(keys)
            count += len(seen)
        return count

    def _folder(self, partition: str) -> Path:
        if not partition:
            raise ValueError("partition must be a non-empty string")
        return self.directory / quote(partition, safe="")

    def _put_keys(self, path: Path) -> list[str]:
        if path not in self._keys_of:
            td = TensorDict.load_memmap(path)
            self._keys_of[path] = json.loads(td.get_non_tensor(_KEYS))
        return self._keys_of[path]


class SpillReader:
    """A few keys read straight from a spill directory: only the puts of their groups are
    opened, nothing is loaded into a plane and nothing on disk is changed -- a live run's
    put being written (a temporary directory) or superseded generation is its writer's.

    ``get`` is the data plane's read (same rows, same :class:`MissingPayloadError`), so a
    reader that wants one episode's rows (``replay --episode``) need not reload a run.
    The partition's directory is listed once per reader (one command's view of the spill)
    and again when a listed put has gone since: the live run cleared some of its rows,
    which left the rest as the put's next generation.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._puts: dict[str, list[Path]] = {}
        #: keys of each put opened (immutable once renamed in): a put of the group that
        #: holds none of a later read's keys is not opened again (an episode's pieces)
        self._keys_of: dict[Path, list[str]] = {}

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> list[Row]:
        try:
            rows = self._rows(partition, keys, fields)
        except FileNotFoundError:  # a put listed before was cleared since: list again
            self._puts.pop(partition, None)
            try:
                rows = self._rows(partition, keys, fields)
            except FileNotFoundError as err:
                raise DataPlaneError(
                    f"spill partition {partition!r} changed twice while it was read "
                    f"({err.filename} went): the run is clearing rows; read again") from None
        missing = [k for k in keys if k not in rows]
        if missing:
            raise MissingPayloadError(partition, keys=missing)
        lacking = sorted({f for k in keys for f in fields or () if f not in rows[k]})
        if lacking:
            raise MissingPayloadError(partition, fields=lacking)
        if fields is None:
            return [dict(rows[k]) for k in keys]
        return [{f: rows[k][f] for f in fields} for k in keys]  # in the asked order, as the plane's get

    def _rows(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None
    ) -> dict[str, Row]:
        """The asked keys' rows found in their groups' puts (a later put's fields win)."""
        rows: dict[str, Row] = {}
        wanted, marks = set(keys), {_group_mark(k) for k in keys}
        for path in self._puts_of(partition):
            mark = _mark_of(path)
            if mark is not None and mark not in marks:
                continue  # another group's put: never opened
            if wanted.isdisjoint(self._keys_of.get(path, wanted)):
                continue
            td = TensorDict.load_memmap(path)
            put_keys = self._keys_of[path] = json.loads(td.get_non_tensor(_KEYS))
            if wanted.isdisjoint(put_keys):
                continue
            td = td.exclude(_KEYS, _TAGS)
            if fields is not None:  # only the asked fields' pages are read
                td = td.select(*(f for f in fields if f in td.keys()))
            for key, row in zip(put_keys, rows_of(td)):
                if key in wanted:  # as ``put``: a later put replaces the fields it gives
                    rows.setdefault(key, {}).update({n: t.clone() for n, t in row.items()})
        return rows

    def _puts_of(self, partition: str) -> list[Path]:
        if partition not in self._puts:
            folder = self.directory / quote(partition, safe="")
            if folder.is_dir():
                _refuse_legacy(folder)
            self._puts[partition] = _put_dirs(folder) if folder.is_dir() else []
        return self._puts[partition]


def _group_mark(key: str) -> str:
    """The short name of a key's ``{run}/{group}`` prefix (the whole key if it has no
    such prefix), stable across processes: part of a put directory's name."""
    prefix = "/".join(key.split("/", 2)[:2])
    return hashlib.blake2b(prefix.encode(), digest_size=6).hexdigest()


def _mark_of(path: Path) -> str | None:
    """The group mark in a put directory's name (``{ns}-{pid}-{n}-{mark}.{generation}``);
    None for a put of several groups or of an earlier release (``{ns}-{pid}-{n}``)."""
    parts = path.name.rpartition(".")[0].split("-")
    return parts[3] if len(parts) == 4 else None


def _put_dirs(folder: Path, *, tidy: bool = False) -> list[Path]:
    """The partition's complete put directories in stamp order, newest generation only.

    With ``tidy``, what a crash left behind goes: temporary directories (a write that
    never got renamed in) and generations that a newer one replaced.
    """
    newest: dict[str, tuple[int, Path]] = {}
    for path in folder.iterdir():
        if path.name.startswith(_TMP_PREFIX):
            if tidy:
                shutil.rmtree(path, ignore_errors=True)
            continue
        if not path.is_dir():
            continue
        stamp, _, generation = path.name.rpartition(".")
        held = newest.get(stamp)
        if held is None or int(generation) > held[0]:
            if held is not None and tidy:
                shutil.rmtree(held[1])
            newest[stamp] = (int(generation), path)
        elif tidy:
            shutil.rmtree(path)
    return [newest[stamp][1] for stamp in sorted(newest)]


def _remove_dir(path: Path) -> None:
    """Delete a put (or a partition) atomically: renamed out of the way first, so a crash
    mid-delete leaves a temporary directory (tidied away), never a half-deleted put that
    a reload would read."""
    doomed = path.parent / f"{_TMP_PREFIX}rm-{path.name}"
    os.rename(path, doomed)
    _fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def _write_put(
    folder: Path,
    name: str,
    keys: list[str],
    columns: dict[str, list[torch.Tensor]],
    tags: list[Tags] | None,
) -> None:
    """Write one put as a memory-mapped TensorDict, atomically, under ``folder/name``."""
    td = TensorDict(
        {field: _stacked(values) for field, values in columns.items()}, batch_size=[len(keys)]
    )
    td.set_non_tensor(_KEYS, json.dumps(keys))
    td.set_non_tensor(_TAGS, json.dumps(tags, sort_keys=True))
    tmp = folder / (_TMP_PREFIX + name)
    try:
        td.memmap(prefix=tmp)
        for root, _dirs, files in os.walk(tmp):
            for file in files:
                _fsync_file(Path(root) / file)
            _fsync_dir(Path(root))
        os.rename(tmp, folder / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(folder)


def _stacked(values: list[torch.Tensor]) -> torch.Tensor:
    """One field of a put: dense when every row has one shape, else a nested tensor
    (strided layout: what ``TensorDict.memmap`` stores)."""
    rows = [v.detach().cpu() for v in values]
    if all(r.shape == rows[0].shape for r in rows):
        return torch.stack(rows)
    with warnings.catch_warnings():  # "prototype stage": the layout memmap supports
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.as_nested_tensor(rows, layout=torch.strided)


def _refuse_legacy(folder: Path) -> None:
    old = next(folder.glob("*" + _LEGACY_SUFFIX), None)
    if old is not None:
        raise DataPlaneError(
            f"spill directory {folder} holds rows in the safetensors format of an earlier "
            f"release ({old.name}); this release reads memory-mapped TensorDicts only. "
            "Resume that run with the release that wrote it, or delete the directory "
            "(its payloads are then lost: steps after the newest checkpoint cannot be "
            "re-trained)"
        )


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    _fsync_file(folder)
