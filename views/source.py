"""Where views read a run's log: the one place that knows how.

The dashboard's history is the projector's fold (``Projector.get`` with an observer:
every invariant checked, the page's audit status). The trace needs no state, only the
events in order, in bounded memory: it reads the projector's pages and decodes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from controller.core.fold import Observer
from controller.core.turns import expanded_at
from controller.projector import Projection, Projector, iter_pages
from events.codec import decode
from events.schema import AnyEvent
from events.store import EventStore


def events(
    store: EventStore, run_id: str, start: int = 1, end: int | None = None
) -> Iterator[tuple[int, AnyEvent]]:
    """Decoded (position, event) pairs, read ahead page by page (bounded memory); a
    malformed entry raises ``EventDecodeError`` naming its position. A pause
    (``EpisodeTurnsRecorded``) comes as the events it stands for, at its position."""
    for page in iter_pages(store, run_id, start, end):
        yield from expanded_at((position, decode(data, position)) for position, data in page)


def fold(store: EventStore, run_id: str, *, observers: Iterable[Observer] = (),
         fork_readers: bool = True) -> Projection:
    """The run's state folded by the projector (every invariant checked); a problem stops
    the fold and is named in the result. ``fork_readers=False`` in a process that holds
    threads (the dashboard's server)."""
    return Projector(store, fork_readers=fork_readers).get(run_id, observers=observers)
