"""TransferQueue adapter: the only module in the project that imports ``transfer_queue``.

Uses TransferQueue's key/value API (``kv_batch_put`` / ``kv_batch_get`` / ``kv_list`` /
``kv_clear``) over its SimpleStorage backend (in-memory storage units run as Ray
actors). The adapter hides three sharp edges behind the data plane contract:

* **Shapes.** Non-scalar fields come back as jagged nested tensors even when they went
  in dense. Every field is therefore stored with a companion ``__shape__/<field>`` row
  ``[ndim, *shape]``; rows are flattened to 1-D on put and reshaped on get. Scalar
  fields go in as a dense ``[B]`` column.
* **Missing data is silent.** An absent key or field is dropped from the result (or
  yields an empty batch); the adapter checks what came back and raises
  :class:`MissingPayloadError` naming the missing keys/fields.
* **Start-up.** ``transfer_queue.init`` hangs when Ray has fewer than 4 logical CPUs;
  the adapter starts Ray with enough CPUs itself, or refuses an existing cluster that
  has too few, and wraps any start-up failure in :class:`DataPlaneUnavailable` --
  never a silent fallback to memory.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import ray
import torch

from workers.dataplane.api import (
    DataPlaneUnavailable,
    Fields,
    MissingPayloadError,
    Row,
    Tags,
    as_columns,
)

_SHAPE = "__shape__/"
#: TransferQueue's controller and storage units need this many logical CPUs in Ray.
MIN_RAY_CPUS = 4


@dataclass(frozen=True)
class TransferQueueConfig:
    """How to reach (or start) TransferQueue."""

    #: Ray address to join (None: the already initialised Ray, else start a local one)
    ray_address: str | None = None
    #: logical CPUs for a Ray started here (>= 4, or TransferQueue's init hangs)
    ray_num_cpus: int = MIN_RAY_CPUS
    #: SimpleStorage units (Ray actors holding the payloads)
    num_storage_units: int = 2
    #: only nodes offering this Ray resource hold storage units (None: every node)
    storage_node_resource: str | None = None


def _ensure_ray(cfg: TransferQueueConfig) -> None:
    if not ray.is_initialized():
        if cfg.ray_address is None:
            ray.init(
                num_cpus=max(cfg.ray_num_cpus, MIN_RAY_CPUS),
                include_dashboard=False,
                log_to_driver=False,
            )
        else:
            ray.init(address=cfg.ray_address, log_to_driver=False)
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < MIN_RAY_CPUS:
        raise DataPlaneUnavailable(
            f"Ray has {cpus:g} logical CPUs; TransferQueue needs at least {MIN_RAY_CPUS} "
            f"(start Ray with ray.init(num_cpus={MIN_RAY_CPUS}) or more)"
        )


class TransferQueueDataPlane:
    """Data plane over TransferQueue's SimpleStorage backend."""

    def __init__(self, cfg: TransferQueueConfig = TransferQueueConfig()) -> None:
        try:
            import transfer_queue as tq
            from tensordict import TensorDict

            _ensure_ray(cfg)
            storage: dict = {"num_data_storage_units": cfg.num_storage_units}
            if cfg.storage_node_resource:
                storage["required_node_resource"] = cfg.storage_node_resource
            tq.init({"backend": {"SimpleStorage": storage}})
        except DataPlaneUnavailable:
            raise
        except Exception as err:  # any start-up failure is fatal, never a fallback
            raise DataPlaneUnavailable(f"TransferQueue failed to start: {err!r}") from err
        self._tq = tq
        self._td = TensorDict
        # TransferQueue's client is not safe for concurrent calls from threads.
        self._lock = threading.Lock()

    # -- protocol -----------------------------------------------------------------

    def put(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Fields,
        tags: Sequence[Tags] | None = None,
    ) -> None:
        keys, columns, tag_list = as_columns(keys, fields, tags)
        batch: dict[str, torch.Tensor] = {}
        for name, values in columns.items():
            batch[name], batch[_SHAPE + name] = _encode(values)
        td = self._td(batch, batch_size=[len(keys)])
        with self._lock:
            self._tq.kv_batch_put(keys=keys, partition_id=partition, fields=td, tags=tag_list)

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> list[Row]:
        keys = list(keys)
        if not keys:
            return []
        select = None if fields is None else [x for f in fields for x in (f, _SHAPE + f)]
        with self._lock:
            try:
                td = self._tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=select)
            except ValueError:
                td = None
            if td is None or td.batch_size[0] != len(keys) or (
                select is not None and any(f not in td.keys() for f in select)
            ):
                raise self._diagnose(partition, keys, fields)
        names = [n for n in td.keys() if not n.startswith(_SHAPE)]
        rows: list[Row] = [{} for _ in keys]
        for name in names:
            for i, value in enumerate(_decode(td[name], td[_SHAPE + name])):
                rows[i][name] = value
        return rows

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None:
        with self._lock:
            present = set(self._list(partition))
            doomed = sorted(present if keys is None else present.intersection(keys))
            if doomed:
                self._tq.kv_clear(keys=doomed, partition_id=partition)

    def list(self, partition: str) -> list[str]:
        with self._lock:
            return self._list(partition)

    def tags(self, partition: str) -> dict[str, Tags]:
        with self._lock:
            listing = self._tq.kv_list(partition_id=partition).get(partition, {})
        return {k: dict(v or {}) for k, v in sorted(listing.items())}

    def close(self) -> None:
        """Stop TransferQueue's controller and storage (started by this process)."""
        with self._lock:
            self._tq.close()

    # -- helpers ------------------------------------------------------------------

    def _list(self, partition: str) -> list[str]:
        return sorted(self._tq.kv_list(partition_id=partition).get(partition, {}))

    def _diagnose(
        self, partition: str, keys: list[str], fields: Sequence[str] | None
    ) -> MissingPayloadError:
        """Work out which keys or fields a short result was missing."""
        present = set(self._list(partition))
        missing = [k for k in keys if k not in present]
        if missing or fields is None:
            return MissingPayloadError(partition, keys=missing or keys)
        have: set[str] | None = None
        for key in keys:  # a field must be present on every requested key
            td = self._tq.kv_batch_get(keys=[key], partition_id=partition)
            names = set(td.keys())
            have = names if have is None else have & names
        return MissingPayloadError(partition, fields=[f for f in fields if f not in (have or set())])


def _encode(values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One column -> (data, shapes): dense ``[B]`` for scalars, else flattened rows."""
    shapes = torch.tensor([[v.dim(), *v.shape] for v in values], dtype=torch.int64)
    if values[0].dim() == 0:
        return torch.stack([v.detach().cpu() for v in values]), shapes
    flat = [v.detach().cpu().reshape(-1) for v in values]
    if len({f.shape[0] for f in flat}) == 1:
        return torch.stack(flat), shapes
    return torch.nested.as_nested_tensor(flat, layout=torch.jagged), shapes


def _rows(t: torch.Tensor) -> list[torch.Tensor]:
    if t.is_nested:  # split the flat values by offsets (much cheaper than unbind)
        return list(t.values().split(t.offsets().diff().tolist()))
    return list(t.unbind(0))


def _decode(data: torch.Tensor, shapes: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for value, shape in zip(_rows(data), _rows(shapes)):
        dims = [int(x) for x in shape.tolist()][1:]
        out.append(value.reshape(dims).clone())
    return out
