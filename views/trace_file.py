"""A run's trace written to a file or a stream (``rl-controller trace``, the dashboard).

The file appears complete or not at all: it is written beside the target and renamed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from events.store import EventStore
from views import source
from views.trace import TraceBuilder
from views.trace_writer import TraceWriter

Steps = tuple[int | None, int | None]


def parse_steps(text: str) -> Steps:
    """``A:B``, ``A:``, ``:B`` or ``A`` (= ``A:A``); raises ValueError saying what is wrong."""
    if not text:
        return None, None
    first, sep, last = text.partition(":")
    try:
        a = int(first) if first.strip() else None
        b = int(last) if last.strip() else None
    except ValueError:
        raise ValueError(f"steps {text!r}: expected A:B with step numbers (e.g. 10:20)") from None
    if not sep:
        b = a
    if (a is not None and a < 0) or (b is not None and b < 0) or (
            a is not None and b is not None and b < a):
        raise ValueError(f"steps {text!r}: expected 0 <= A <= B")
    return a, b


def write_trace(store: EventStore, run_id: str, out: Any, steps: Steps = (None, None)
                ) -> dict[str, int]:
    """Stream the run's events into ``out`` as a trace; stops after the last step asked."""
    writer = TraceWriter(out)
    builder = TraceBuilder(writer, run_id, steps)
    events = source.events(store, run_id)
    try:
        for position, event in events:
            if not builder.feed(position, event):
                break
    finally:
        events.close()  # stops the read-ahead (forked readers) when we stop early
    builder.finish()
    return {"entries": writer.written, "events": builder.events,
            "first": builder.first_position, "last": builder.last_position,
            "drawn": int(builder.drawing), "newest_step": builder.newest_step}


def trace_to_file(store: EventStore, run_id: str, target: Path, steps: Steps) -> dict[str, int]:
    """Write the trace to ``target``; a window that holds no step of the run (nothing
    drawn: ``summary["drawn"] == 0``) leaves ``target`` as it was."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            summary = write_trace(store, run_id, out, steps)
        if summary["drawn"]:
            os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return summary
