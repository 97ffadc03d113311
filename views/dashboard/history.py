"""Reads behind the dashboard's JSON: the runs, and the event table searched backwards.

The table shows the newest events first. A filter on type uses the stream's ``type``
field (no decoding); group and step filters decode only the entries whose raw bytes
mention the value. A search reads back at most ``SCAN_LIMIT`` entries per request and
says where it stopped, so a rare event in a 10M-event log costs pages, not a fold.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controller.core.turns import PART_TYPES, parts
from events.codec import decode
from events.errors import EventDecodeError
from events.schema import EVENT_TYPES
from events.store import EventStore, RawEntry
from views.dashboard.model import RECENT_EVENTS, event_row

#: the types a pause's entry holds (a type filter for one of them opens pauses too)
PART_NAMES = frozenset(c.__name__ for c in PART_TYPES)

PAGE = 1000
SCAN_LIMIT = 200_000
MAX_ROWS = 500


def run_rows(store: EventStore) -> list[dict[str, Any]]:
    rows = []
    for info in sorted(store.list_runs(), key=lambda r: r.run_id):
        last = store.read_raw(info.run_id, info.last_position, info.last_position) \
            if info.last_position else []
        rows.append({"run_id": info.run_id, "events": info.last_position, "epoch": info.epoch,
                     "finished": bool(last) and last[-1].event_type == "RunFinished"})
    return rows


@dataclass(frozen=True)
class EventQuery:
    type: str = ""
    group: str = ""
    step: int | None = None
    #: newest position to look at (0 = the log's end)
    before: int = 0
    limit: int = 100

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> EventQuery:
        kind = params.get("type", "")
        if kind and kind not in EVENT_TYPES:
            raise ValueError(f"type: unknown event type {kind!r}")
        if kind == "EpisodeTurnsRecorded":  # never a row: its parts are (``_rows``)
            raise ValueError(f"type: a pause shows as the events it stands for; ask for one "
                             f"of {', '.join(sorted(PART_NAMES))}")
        try:
            step = int(params["step"]) if params.get("step") else None
            before = int(params.get("before") or 0)
            limit = int(params.get("limit") or 100)
        except ValueError:
            raise ValueError("step, before and limit must be integers") from None
        if not 1 <= limit <= MAX_ROWS or before < 0:
            raise ValueError(f"limit must be in 1..{MAX_ROWS} and before >= 0")
        return cls(kind, params.get("group", "").strip(), step, before, limit)

    def matches_raw(self, entry: RawEntry) -> bool:
        # a pause holds events of the types it stands for (``controller.core.turns``)
        pause = entry.event_type == "EpisodeTurnsRecorded" and self.type in PART_NAMES
        if self.type and entry.event_type != self.type and not pause:
            return False
        if self.group and self.group.encode() not in entry.data:
            return False
        return self.step is None or str(self.step).encode() in entry.data

    def matches(self, event: Any) -> bool:
        if self.type and type(event).__name__ != self.type:
            return False
        if self.group and self.group != getattr(event, "group_id", None) and \
                self.group not in (getattr(event, "group_ids", None) or ()):
            return False
        return self.step is None or getattr(event, "step", None) == self.step


def find_events(store: EventStore, run_id: str, q: EventQuery) -> dict[str, Any]:
    """The newest ``q.limit`` matching events at or before ``q.before``."""
    end = q.before or store.last_position(run_id)
    rows: list[dict[str, Any]] = []
    hi = end
    scanned = end + 1  # the oldest position read: where the page says the search stopped
    while hi >= 1 and len(rows) < q.limit and end - hi < SCAN_LIMIT:
        lo = max(1, hi - PAGE + 1)
        for entry in reversed(store.read_raw(run_id, lo, hi)):
            scanned = entry.position
            if not q.matches_raw(entry):
                continue
            got = _rows(entry)
            for row in reversed(got) if got is not None else [None]:
                if row is None or q.matches(row.pop("_event")):
                    rows.append(row or _malformed(entry))
                    if len(rows) == q.limit:
                        break
            if len(rows) == q.limit:
                break
        hi = lo - 1
    return {"events": rows, "scanned_from": scanned, "end": end}


#: steps a trace shows when none are asked for (the newest ones)
TRACE_STEPS = 3


def trace_json(store: EventStore, run_id: str, steps: str) -> bytes:
    """The trace (``views.trace``) of steps ``A:B``, or of the newest ``TRACE_STEPS``."""
    import io

    from views.trace_file import parse_steps, write_trace

    window = parse_steps(steps) if steps else _newest_steps(store, run_id)  # ValueError: 400
    out = io.BytesIO()
    write_trace(store, run_id, out, window)
    return out.getvalue()


def _newest_steps(store: EventStore, run_id: str) -> tuple[int | None, int | None]:
    hi = store.last_position(run_id)
    while hi >= 1:
        lo = max(1, hi - PAGE + 1)
        for entry in reversed(store.read_raw(run_id, lo, hi)):
            if entry.event_type in ("StepFinished", "StepAborted"):
                try:
                    last = decode(entry.data, entry.position).step  # type: ignore[union-attr]
                except EventDecodeError:
                    continue
                return max(0, last - TRACE_STEPS + 1), last
        hi = lo - 1
    return None, None


def tail_rows(store: EventStore, run_id: str, end: int) -> list[dict[str, Any]]:
    """Table rows of the last events up to ``end``, oldest first (a malformed entry is a
    row of its own, never left out)."""
    rows = []
    for entry in store.read_raw(run_id, max(1, end - RECENT_EVENTS + 1), end):
        got = _rows(entry)
        if got is None:
            rows.append(_malformed(entry))
        for row in got or ():
            row.pop("_event")
            rows.append(row)
    return rows


def _rows(entry: RawEntry) -> list[dict[str, Any]] | None:
    """The entry's rows: one per event it stands for (a pause's parts); None when it
    does not decode."""
    try:
        event = decode(entry.data, entry.position)
    except EventDecodeError:
        return None
    return [{**event_row(entry.position, e), "_event": e} for e in parts(event)]


def _malformed(entry: RawEntry) -> dict[str, Any]:
    return {"position": entry.position, "ts": None, "type": "malformed", "epoch": None,
            "details": entry.data[:200].decode("utf-8", "replace"), "group": None, "step": None}
