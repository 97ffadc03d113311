"""A committed group's per-sample values packed into one object each (``GroupRecord``).

A long log's state holds every group; per-sample strings, floats and ints were most of
its memory and of the fold's allocations. Little-endian everywhere, so a snapshot reads
the same on any machine.

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

#: joins a committed group's payload keys into one string (see ``pack_keys``)
KEY_SEPARATOR: Final = "\x00"


def pack_keys(keys: Sequence[str]) -> str | tuple[str, ...]:
    """One string for a group's keys; a tuple when a key itself holds the separator."""
    joined = KEY_SEPARATOR.join(keys)
    return joined if joined.count(KEY_SEPARATOR) == len(keys) - 1 else tuple(keys)


def pack_f64(values: Sequence[float]) -> bytes:
    return packer(F64, "d", len(values)).pack(*values)


def pack_i64(values: Sequence[int]) -> bytes:
    """Raises struct.error for a value that is not an int64 (the reducer names the event)."""
    return packer(I64, "q", len(values)).pack(*values)


# Little-endian everywhere (a snapshot reads the same on any machine); one compiled
# ``struct.Struct`` per sample count (a run has few distinct counts).
F64: dict[int, struct.Struct] = {}
I64: dict[int, struct.Struct] = {}


def packer(cache: dict[int, struct.Struct], code: str, n: int) -> struct.Struct:
    return cache.get(n) or cache.setdefault(n, struct.Struct(f"<{n}{code}"))
