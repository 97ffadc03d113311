"""Where a generator keeps a weight version between receiving and loading it: a file.

A refit must land atomically with respect to generation (``workers.weight_sync``), so
a version that arrives while a group is generating waits -- whole -- for the next
boundary. Kept as a list of buckets in memory, that is one model's size of extra RAM
in every generator, and twice that when the buckets are copied into a vLLM engine
process as well. Spooled, each bucket goes to a file as it arrives and is read back
one at a time when the version is loaded, so the receiver's extra memory is about one
bucket (plus, while loading, one tensor being reassembled from its pieces), whatever
the model's size. The file's bytes sit in the page cache, which the kernel can evict.

The file is unlinked as soon as it is created and lives on through its open
descriptor: a generator killed mid-refit leaves nothing on disk. Another process on
the same host (a vLLM engine core) reads it through ``/proc/<pid>/fd/<fd>``
(:attr:`SpooledBuckets.path`), so only a path and offsets cross that process boundary.

Directory: ``tempfile.gettempdir()`` (``TMPDIR``); if that is a RAM-backed ``tmpfs``,
point ``TMPDIR`` at a disk for the bound to hold.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class SpooledBuckets:
    """A sealed spool: ``(offset, length)`` of each bucket in the file at ``path``.

    Picklable (a path and integers); iterating reads one bucket at a time.
    """

    path: str
    spans: tuple[tuple[int, int], ...]

    def __iter__(self) -> Iterator[bytes]:
        with open(self.path, "rb", buffering=0) as f:
            for offset, length in self.spans:
                f.seek(offset)
                blob = f.read(length)
                if len(blob) != length:
                    raise OSError(f"weight spool {self.path}: bucket at {offset} is truncated")
                yield blob

    def __len__(self) -> int:
        return len(self.spans)

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.spans)


class BucketSpool:
    """An append-only file of weight buckets for one version (see the module docstring)."""

    def __init__(self, directory: str | None = None) -> None:
        fd, name = tempfile.mkstemp(prefix="rlc-refit-", suffix=".buckets", dir=directory)
        self._fd: int | None = fd
        proc = f"/proc/{os.getpid()}/fd/{fd}"
        if os.path.exists(proc):  # Linux: gone from the directory, alive while open
            os.unlink(name)
            self.path, self._name = proc, None
        else:  # elsewhere: a named file, removed by close()
            self.path, self._name = name, name
        self._spans: list[tuple[int, int]] = []
        self._end = 0

    def append(self, bucket: bytes) -> None:
        if self._fd is None:
            raise RuntimeError("weight spool is closed")
        view = memoryview(bucket)
        while view:
            view = view[os.write(self._fd, view) :]
        self._spans.append((self._end, len(bucket)))
        self._end += len(bucket)

    def sealed(self) -> SpooledBuckets:
        """What has been appended, to read back while the spool stays open."""
        return SpooledBuckets(self.path, tuple(self._spans))

    def close(self) -> None:
        """Drop the file (idempotent); readers must be done with it."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        if self._name is not None:
            name, self._name = self._name, None
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass

    def __enter__(self) -> BucketSpool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a receiver dropped mid-version must not leak the fd
        self.close()
