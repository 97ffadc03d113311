"""The data plane protocol: where sample payloads live between generator and trainer.

Tensors never travel through the event log; a generator ``put``s one row per sample
under a key (``{run}/{group}/a{attempt}/s{i}``) in a partition, the trainer ``get``s
the rows of the groups it trains on, and the controller ``clear``s rows once a
checkpoint covers them. Every implementation (in-memory twin, TransferQueue, the
durable spill wrapper) passes the same contract suite.

Semantics shared by all implementations:

* A row is ``{field: Tensor}``; tensors of one field may differ in shape across rows
  (jagged completions) but must have the same number of dimensions within one put.
  Only tensors cross the plane -- no pickled objects. Field names starting with
  ``__`` are reserved.
* ``put`` to an existing key replaces the given fields and keeps the others; tags, when
  given, replace the key's tags. Tags are flat dicts of str/int/float/bool.
* ``get`` returns rows in the order of ``keys``, each with the requested fields
  (all fields when ``fields`` is None), with the dtypes and shapes that were put.
  A missing key or field raises :class:`MissingPayloadError` (a ``KeyError``)
  naming every missing one -- never a silently shorter result.
* ``clear`` of keys that are not there is a no-op (recovery may clear twice).
* ``list`` returns the partition's keys, sorted; an unknown partition is empty.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, Union, runtime_checkable

import torch

Row = dict[str, torch.Tensor]
TagValue = Union[str, int, float, bool]
Tags = dict[str, TagValue]
#: either columns ``{field: [tensor per key]}`` or rows ``[{field: tensor} per key]``
Fields = Union[Mapping[str, Sequence[torch.Tensor]], Sequence[Mapping[str, torch.Tensor]]]

RESERVED_PREFIX = "__"


class DataPlaneError(RuntimeError):
    """The data plane could not serve a request."""


class DataPlaneUnavailable(DataPlaneError):
    """The configured data plane could not be started or reached (no fallback)."""


class MissingPayloadError(KeyError):
    """Requested keys or fields are not in the data plane."""

    def __init__(
        self, partition: str, keys: Sequence[str] = (), fields: Sequence[str] = ()
    ) -> None:
        self.partition = partition
        self.keys = list(keys)
        self.fields = list(fields)
        parts = []
        if self.keys:
            parts.append(f"missing keys {self.keys}")
        if self.fields:
            parts.append(f"missing fields {self.fields}")
        super().__init__(f"partition {partition!r}: " + "; ".join(parts))

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@runtime_checkable
class DataPlane(Protocol):
    """Key/row store for sample payloads, partitioned (one partition per run)."""

    def put(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Fields,
        tags: Sequence[Tags] | None = None,
    ) -> None: ...

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> list[Row]: ...

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None: ...

    def list(self, partition: str) -> list[str]: ...

    def tags(self, partition: str) -> dict[str, Tags]:
        """Tags of every key in the partition."""
        ...

    def close(self) -> None: ...


def as_columns(
    keys: Sequence[str], fields: Fields, tags: Sequence[Tags] | None
) -> tuple[list[str], dict[str, list[torch.Tensor]], list[Tags] | None]:
    """Validate a ``put`` and return (keys, columns, tags) in column form."""
    keys = list(keys)
    if not keys:
        raise ValueError("put needs at least one key")
    if any(not isinstance(k, str) or not k for k in keys):
        raise ValueError("keys must be non-empty strings")
    if len(set(keys)) != len(keys):
        raise ValueError("keys in one put must be unique")
    columns = _columns(fields, len(keys))
    if not columns:
        raise ValueError("put needs at least one field")
    for name, values in columns.items():
        _check_column(name, values, len(keys))
    if tags is not None:
        tags = [dict(t) for t in tags]
        if len(tags) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(tags)} tags")
        for t in tags:
            for k, v in t.items():
                if not isinstance(k, str) or not isinstance(v, (str, int, float, bool)):
                    raise TypeError(f"tag {k!r}={v!r}: tags are flat str -> str/int/float/bool")
    return keys, columns, tags


def _columns(fields: Fields, n: int) -> dict[str, list[torch.Tensor]]:
    if isinstance(fields, Mapping):
        return {name: list(values) for name, values in fields.items()}
    rows = list(fields)
    if len(rows) != n:
        raise ValueError(f"{n} keys but {len(rows)} rows")
    if not rows:
        return {}
    names = list(rows[0])
    for i, row in enumerate(rows):
        if set(row) != set(names):
            raise ValueError(f"row {i} has fields {sorted(row)}, row 0 has {sorted(names)}")
    return {name: [row[name] for row in rows] for name in names}


def _check_column(name: str, values: list[torch.Tensor], n: int) -> None:
    if not isinstance(name, str) or not name or name.startswith(RESERVED_PREFIX):
        raise ValueError(f"invalid field name {name!r} (names starting with '__' are reserved)")
    if len(values) != n:
        raise ValueError(f"field {name!r} has {len(values)} values for {n} keys")
    ndims = set()
    for v in values:
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"field {name!r}: only tensors cross the data plane, got {type(v)}")
        if v.is_nested or v.layout != torch.strided:
            raise TypeError(f"field {name!r}: pass one dense tensor per row")
        ndims.add(v.dim())
    if len(ndims) > 1:
        raise ValueError(f"field {name!r}: rows have different numbers of dimensions {sorted(ndims)}")
