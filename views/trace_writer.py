"""Writing Chrome trace-event JSON as a stream: ``{"traceEvents": [...]}``.

The format (the "Trace Event Format" document Chrome and Perfetto read): every entry has
a phase ``ph`` -- ``B``/``E`` begin and end a slice on a thread track, ``X`` is a whole
slice with its ``dur``, ``i`` an instant, ``C`` a process counter, ``s``/``t``/``f`` the
start, steps and finish of a flow (an arrow between slices; each binds to the slice open
on its track at its timestamp), ``M`` names processes and threads. Timestamps are
microseconds (fractions allowed).

Entries are encoded a batch at a time and written out, so the whole trace is never held:
memory is the batch plus what the builder keeps about live groups. Each track's
timestamps are kept non-decreasing in file order (``at``): a log written across a
controller restart on another host may step back by clock skew, and viewers nest a
thread's slices by time.
"""

from __future__ import annotations

from typing import IO, Any

import msgspec

#: entries encoded and written together
BATCH = 4096

Track = tuple[int, int]


class TraceWriter:
    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.pending: list[dict[str, Any]] = []
        self.last: dict[Track, float] = {}
        self.written = 0
        self._encode = msgspec.json.Encoder().encode
        out.write(b'{"displayTimeUnit":"ms","traceEvents":[\n')

    def at(self, track: Track, ts: float) -> float:
        """``ts`` moved up to the track's last timestamp if it is behind it."""
        last = self.last.get(track, 0.0)
        if ts < last:
            return last
        self.last[track] = ts
        return ts

    def add(self, entry: dict[str, Any]) -> None:
        self.pending.append(entry)

    def maybe_flush(self) -> None:
        """Write the pending entries out once there are a batch of them (the builder calls
        this after each event, so one call's entries never wait on a size check each)."""
        if len(self.pending) >= BATCH:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        body = self._encode(self.pending)[1:-1]  # the list's items, without brackets
        self.out.write((b",\n" if self.written else b"") + body)
        self.written += len(self.pending)
        self.pending = []

    def close(self, metadata: dict[str, Any]) -> None:
        self.flush()
        self.out.write(b'\n],"metadata":' + self._encode(metadata) + b"}\n")

    # -- entries -----------------------------------------------------------------------

    def name(self, pid: int, tid: int | None, name: str, sort_index: int) -> None:
        """Name a process (``tid`` None) or a thread, and fix its place in the view."""
        what = "process" if tid is None else "thread"
        base = {"pid": pid} if tid is None else {"pid": pid, "tid": tid}
        self.add({"ph": "M", "name": f"{what}_name", **base, "args": {"name": name}})
        self.add({"ph": "M", "name": f"{what}_sort_index", **base,
                  "args": {"sort_index": sort_index}})

    def begin(self, track: Track, ts: float, name: str, args: dict[str, Any]) -> float:
        ts = self.at(track, ts)
        self.add({"ph": "B", "pid": track[0], "tid": track[1], "ts": ts, "name": name,
                  "args": args})
        return ts

    def end(self, track: Track, ts: float, args: dict[str, Any] | None = None) -> float:
        ts = self.at(track, ts)
        entry: dict[str, Any] = {"ph": "E", "pid": track[0], "tid": track[1], "ts": ts}
        if args:
            entry["args"] = args
        self.add(entry)
        return ts

    def complete(
        self, track: Track, start: float, end: float, name: str, args: dict[str, Any]
    ) -> tuple[float, float]:
        """An ``X`` slice; returns its (start, end) as written (at least MIN_DUR_US long)."""
        start = self.at(track, start)
        dur = max(end - start, MIN_DUR_US)
        self.add({"ph": "X", "pid": track[0], "tid": track[1], "ts": start, "dur": dur,
                  "name": name, "args": args})
        return start, start + dur

    def instant(self, track: Track, ts: float, name: str, args: dict[str, Any]) -> None:
        ts = self.at(track, ts)
        self.add({"ph": "i", "s": "t", "pid": track[0], "tid": track[1], "ts": ts,
                  "name": name, "args": args})

    def counter(self, pid: int, ts: float, name: str, values: dict[str, float]) -> None:
        ts = self.at((pid, 0), ts)
        self.add({"ph": "C", "pid": pid, "tid": 0, "ts": ts, "name": name, "args": values})

    def flow(self, phase: str, track: Track, ts: float, flow_id: int) -> None:
        """One point of flow ``flow_id``, bound to the slice open on ``track`` at ``ts``
        (a point is put just inside the slice's start, which viewers treat as open)."""
        # No ``at``: ``ts`` is inside a slice just written on ``track``, so not behind it.
        entry = {"ph": phase, "cat": "group", "name": "group", "id": flow_id,
                 "pid": track[0], "tid": track[1], "ts": ts}
        if phase != "s":
            entry["bp"] = "e"  # the enclosing slice, not the next one to begin
        self.pending.append(entry)


#: a slice is at least this long (us): a zero-length one would close before the flow
#: point placed in it
MIN_DUR_US = 1.0
#: where a flow point sits after its slice's start (us)
INSIDE_US = 0.001
