"""The data plane protocol: where sample payloads live between generator and trainer.

Tensors never travel through the event log; a generator ``put``s one row per sample
under a key (``{run}/{group}/a{attempt}/s{i}``) in a partition, the trainer ``get``s
the rows of the groups it trains on, and the controller ``clear``s rows once a
checkpoint covers them. Every implementation (in-memory twin, TransferQueue, the
durable spill wrapper) passes the same contract suite.

Semantics shared by all implementations:

* A row is ``{field: Tensor}``; tensors of one field may differ across rows in their
  first dimension only (jagged completions), as in a jagged ``TensorDict``. Only
  tensors cross the plane -- no pickled objects. Field names starting with ``__`` are
  reserved. ``put`` takes rows, columns, or a ``TensorDict`` with one batch entry
  per key.
* ``get_batch`` returns the rows as ONE ``tensordict.TensorDict`` of batch size
  ``[len(keys)]`` -- TransferQueue's own type, what the trainer collates: scalar fields
  dense ``[B]``, the others jagged (nested tensors, ragged first dimension) or dense
  when every row has the same shape. ``get`` is the same read as one dict per row.
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
from tensordict import TensorDict, TensorDictBase

Row = dict[str, torch.Tensor]
TagValue = Union[str, int, float, bool]
Tags = dict[str, TagValue]
#: columns ``{field: [tensor per key]}``, rows ``[{field: tensor} per key]``, or a
#: TensorDict with one batch entry per key
Fields = Union[
    Mapping[str, Sequence[torch.Tensor]], Sequence[Mapping[str, torch.Tensor]], TensorDictBase
]

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

    def __reduce__(self):  # pickled (a Ray task's error) with its keys, not its message
        return type(self), (self.partition, self.keys, self.fields)


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

    def get_batch(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> TensorDict:
        """The rows of ``keys`` as one TensorDict (see the module docstring)."""
        ...

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None: ...

    def list(self, partition: str) -> list[str]: ...

    def tags(self, partition: str) -> dict[str, Tags]:
        """Tags of every key in the partition."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class DurableDataPlane(DataPlane, Protocol):
    """A :class:`DataPlane` whose rows outlive its process (``SpillDataPlane``): after a
    restart, recovery puts them back into the plane before it asks what is there."""

    def reload(self, partition: str | None = None) -> int:
        """Put every kept row (of ``partition``, or all) back; the number of keys."""
        ...


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
    if isinstance(fields, TensorDictBase):
        if tuple(fields.batch_size[:1]) != (n,):
            raise ValueError(f"{n} keys but a TensorDict of batch size {list(fields.batch_size)}")
        return {name: split_rows(fields.get(name)) for name in fields.keys()}
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
    trailing = {tuple(v.shape[1:]) for v in values}
    if len(trailing) > 1:
        raise ValueError(
            f"field {name!r}: rows may differ only in their first dimension, got trailing "
            f"shapes {sorted(trailing)}"
        )


# -- rows <-> one TensorDict ------------------------------------------------------------


def batch_of(columns: Mapping[str, Sequence[torch.Tensor]], n: int) -> TensorDict:
    """Columns (as ``as_columns`` returns them) as one TensorDict of batch size ``[n]``:
    scalars and equal-shaped rows stacked dense, other fields jagged."""
    out: dict[str, torch.Tensor] = {}
    for name, values in columns.items():
        first = values[0].shape
        if all(v.shape == first for v in values):
            out[name] = torch.stack([v.detach().cpu() for v in values])
        else:
            rows = [v.detach().cpu() for v in values]
            out[name] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    return TensorDict(out, batch_size=[n])


def split_rows(value: torch.Tensor) -> list[torch.Tensor]:
    """One batched field (dense or jagged) as one tensor per batch entry."""
    if value.is_nested and value.layout == torch.jagged:
        # split the flat values by offsets (much cheaper than unbind)
        return list(value.values().split(value.offsets().diff().tolist()))
    return list(value.unbind(0))


def rows_of(batch: TensorDictBase) -> list[Row]:
    """A TensorDict with one batch entry per key as one dict row per key."""
    rows: list[Row] = [{} for _ in range(batch.batch_size[0])]
    for name in batch.keys():
        for row, value in zip(rows, split_rows(batch.get(name))):
            row[name] = value
    return rows
