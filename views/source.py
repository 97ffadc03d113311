"""Where views read a run's log: the one place that knows how (today the replay readers).

Views fold the log with observers of their own; keeping the reading behind these two
functions lets them move to a single projector without touching the views.
"""

from __future__ import annotations

from collections.abc import Iterator

from controller.core.fold import Observer
from events.schema import AnyEvent
from events.store import EventStore
from replay.reader import FoldResult, fold_log, read_events


def events(
    store: EventStore, run_id: str, start: int = 1, end: int | None = None
) -> Iterator[tuple[int, AnyEvent]]:
    """Decoded (position, event) pairs, read ahead page by page (bounded memory); a
    malformed entry raises ``EventDecodeError`` naming its position."""
    return read_events(store, run_id, start, end)


def fold(
    store: EventStore, run_id: str, *, observers: dict[type, Observer] | None = None
) -> FoldResult:
    """The run's state folded with the reducer (every invariant checked), observers called
    after their events; a problem stops the fold and is named in the result."""
    return fold_log(store, run_id, observers=observers)
