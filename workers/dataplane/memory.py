"""In-memory twin of the data plane, for unit tests and single-process runs.

Same contract as the TransferQueue adapter (see ``workers.dataplane.api``). Tensors
are copied on the way in and out so callers can never alias stored payloads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from tensordict import TensorDict

from workers.dataplane.api import Fields, MissingPayloadError, Row, Tags, as_columns, batch_of


class MemoryDataPlane:
    def __init__(self) -> None:
        self._rows: dict[str, dict[str, Row]] = {}
        self._tags: dict[str, dict[str, Tags]] = {}
        # Ray actors with concurrency may call in from several threads.
        self._lock = threading.Lock()

    def put(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Fields,
        tags: Sequence[Tags] | None = None,
    ) -> None:
        keys, columns, tag_list = as_columns(keys, fields, tags)
        with self._lock:
            rows = self._rows.setdefault(partition, {})
            part_tags = self._tags.setdefault(partition, {})
            for i, key in enumerate(keys):
                row = rows.setdefault(key, {})
                for name, values in columns.items():
                    row[name] = values[i].detach().to("cpu", copy=True)
                if tag_list is not None:
                    part_tags[key] = dict(tag_list[i])
                else:
                    part_tags.setdefault(key, {})

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> list[Row]:
        with self._lock:
            rows = self._rows.get(partition, {})
            missing_keys = [k for k in keys if k not in rows]
            if missing_keys:
                raise MissingPayloadError(partition, keys=missing_keys)
            if fields is None:
                return [{n: t.clone() for n, t in rows[k].items()} for k in keys]
            missing_fields = sorted({f for k in keys for f in fields if f not in rows[k]})
            if missing_fields:
                raise MissingPayloadError(partition, fields=missing_fields)
            return [{f: rows[k][f].clone() for f in fields} for k in keys]

    def get_batch(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> TensorDict:
        rows = self.get(partition, keys, fields)
        names = list(rows[0]) if rows else []
        missing = sorted({n for r in rows for n in names if n not in r})
        if missing:  # fields=None and the rows' fields differ: no common batch
            raise MissingPayloadError(partition, fields=missing)
        return batch_of({n: [r[n] for r in rows] for n in names}, len(rows))

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None:
        with self._lock:
            if keys is None:
                self._rows.pop(partition, None)
                self._tags.pop(partition, None)
                return
            for k in keys:
                self._rows.get(partition, {}).pop(k, None)
                self._tags.get(partition, {}).pop(k, None)

    def list(self, partition: str) -> list[str]:
        with self._lock:
            return sorted(self._rows.get(partition, {}))

    def tags(self, partition: str) -> dict[str, Tags]:
        with self._lock:
            return {k: dict(v) for k, v in sorted(self._tags.get(partition, {}).items())}

    def close(self) -> None:
        with self._lock:
            self._rows.clear()
            self._tags.clear()
