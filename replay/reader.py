"""Reading a run's log robustly and fast: raw pages, folded with the reducer.

Every read-only tool (``replay``, ``staleness``, ``audit``) folds the log the way
``controller.core.fold.fold_raw`` does -- decode each entry with the event codec, apply it
with the reducer -- but never lets a bad entry escape as a traceback: the first
malformed entry (``EventDecodeError``) or broken rule (``InvariantViolation``) stops
the fold and comes back as a :class:`LogProblem` naming its position, together with
the state as of the entry before it (the reducer leaves the state untouched when it
rejects an event).

Speed: a 1M-event log must fold in seconds. Entries come from the store's bulk read
(``EventStore.read_page``, one server round trip per page of :data:`PAGE_ENTRIES`), and
the next page is fetched on a helper thread while the current one folds.
"""

from __future__ import annotations

import gc
import functools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, ParamSpec, TypeVar

from controller.core.errors import InvariantViolation, SnapshotDecodeError
from controller.core.fold import Observer, apply_raw
from controller.core.state import RunState, decode_state, initial_state
from events.codec import decode
from events.errors import EventDecodeError
from events.schema import AnyEvent, StepAborted, StepFinished
from events.store import BULK_PAGE_SIZE, EncodedPage, EventStore
from replay import page_reader

#: Entries per page (one server round trip each against Redis).
PAGE_ENTRIES = BULK_PAGE_SIZE

#: a long fold reports its progress each time it passes a multiple of this many events
PROGRESS_EVERY = 1_000_000

#: called with (position folded, the log's last position) as a long fold goes on
Progress = Callable[[int, int], None]

#: (position, encoded event) -- what the fold consumes. The event is JSON text, as bytes
#: or str; ``events.codec.decode`` takes either.
Entry = tuple[int, bytes | str]


@dataclass(frozen=True)
class LogProblem:
    """The first entry of a log that could not be folded."""

    position: int
    kind: Literal["malformed", "invariant"]
    reason: str
    event_id: str | None = None

    def describe(self) -> str:
        what = "malformed entry" if self.kind == "malformed" else "invariant violated"
        which = f" ({self.event_id})" if self.event_id else ""
        return f"{what} at position {self.position}{which}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "kind": self.kind,
            "reason": self.reason,
            "event_id": self.event_id,
        }


@dataclass
class FoldResult:
    """A fold that stopped at the end, at a requested point, or at the first problem."""

    state: RunState
    #: ts of the last applied event (0.0 when none)
    last_ts: float = 0.0
    problem: LogProblem | None = None
    #: position of the newest entry in the log when the read finished
    log_end: int = 0
    #: True when ``stop_step`` was given and its end event was reached
    reached: bool = False
    extras: dict[str, Any] = field(default_factory=dict)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def gc_paused(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` with the cyclic collector off (restored after, also on error).

    The read-only tools build one big state (10^5-10^6 records) and then reports of
    10^5 small dicts; every collection triggered by those allocations walks the whole
    heap, which cost as much as building the report. Nothing they build is cyclic
    garbage that must go before the tool ends.
    """

    @functools.wraps(fn)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return paused


# -- pages -------------------------------------------------------------------------------


def iter_pages(
    store: EventStore, run_id: str, start: int = 1, end: int | None = None
) -> Iterator[list[Entry]]:
    """(position, data) entries from ``start`` to ``end`` (inclusive), page by page."""
    for page in _iter_pages(store, run_id, start, end):
        yield list(page.entries())


def _iter_pages(
    store: EventStore, run_id: str, start: int = 1, end: int | None = None,
    read: page_reader.Fetch | None = None,
) -> Iterator[EncodedPage]:
    """The store's bulk pages, read ahead of the caller: by a forked child for a long
    log (``replay.page_reader``: the read's parsing then runs on another core), else by
    a helper thread (the server's work and the socket wait overlap the caller's).
    ``read(position)`` reads a whole page (default: ``store.read_page``); with ``end``
    given, pages are read plainly up to it."""

    def fetch(position: int) -> EncodedPage:
        want = PAGE_ENTRIES if end is None else min(PAGE_ENTRIES, end - position + 1)
        if want <= 0:
            return EncodedPage(position, [])
        if read is not None and want == PAGE_ENTRIES:
            return read(position)
        return store.read_page(run_id, position, want)

    if page_reader.can_fork() and _long(store, run_id, start, end):
        threaded = lambda position: _threaded_pages(fetch, position)  # noqa: E731
        yield from page_reader.forked_pages(
            fetch, start, PAGE_ENTRIES, threaded, page_reader.reader_count()
        )
    else:
        yield from _threaded_pages(fetch, start)


def _long(store: EventStore, run_id: str, start: int, end: int | None) -> bool:
    last = store.last_position(run_id) if end is None else end
    return last - start + 1 >= page_reader.FORK_ABOVE_ENTRIES


def _threaded_pages(fetch: page_reader.Fetch, start: int) -> Iterator[EncodedPage]:
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlc-read") as pool:
        pending = pool.submit(fetch, start)
        while True:
            page = pending.result()
            if not page.data:
                return
            full = len(page.data) == PAGE_ENTRIES
            if full:
                pending = pool.submit(fetch, page.next_position)
            yield page
            if not full:
                return


# -- folding -----------------------------------------------------------------------------

@gc_paused  # no reference cycles; see gc_paused
def fold_log(
    store: EventStore,
    run_id: str,
    *,
    until: int | None = None,
    stop_step: int | None = None,
    observers: dict[type, Observer] | None = None,
    use_snapshot: bool = False,
    read: page_reader.Fetch | None = None,
    progress: Progress | None = None,
) -> FoldResult:
    """Fold the run's log (up to position ``until``, or through step ``stop_step``'s end).

    ``observers`` maps an event type to a callback run after that event is applied
    (staleness traces); other events cost nothing extra. With ``use_snapshot`` the fold
    starts from the store's snapshot when it lies before ``until`` (replay only: audit
    must check every event). ``read`` reads a page of ``PAGE_ENTRIES`` from a position
    (audit's reads check the hash chain too); what each folded page's ``check`` says
    is kept, in order, in ``extras["page_checks"]``. ``progress`` is called each time
    the fold passes a multiple of :data:`PROGRESS_EVERY` events (minutes of work at 10^7).
    """
    state, start = _starting_state(store, run_id, until, stop_step, use_snapshot)
    result = FoldResult(state=state)
    watch = dict(observers or {})
    if stop_step is not None:
        for cls in (StepFinished, StepAborted):
            watch[cls] = _stop_at(stop_step, watch.get(cls))
    last: AnyEvent | None = None
    checks: list[Any] = result.extras.setdefault("page_checks", [])
    end = 0 if progress is None else store.last_position(run_id) if until is None else until
    try:
        for page in _iter_pages(store, run_id, start, until, read):
            before = state.position
            last = apply_raw(state, page.entries(), watch) or last
            checks.append(page.check)
            if progress is not None and state.position // PROGRESS_EVERY > before // PROGRESS_EVERY:
                progress(state.position, end)
    except _StepReached as reached:
        result.reached = True
        last = reached.event
    except EventDecodeError as err:
        where = state.position + 1 if err.position is None else err.position
        result.problem = LogProblem(where, "malformed", err.reason)
        last = None
    except InvariantViolation as err:
        result.problem = LogProblem(err.position, "invariant", err.reason, err.event_id)
        last = None
    result.last_ts = _last_ts(store, run_id, state) if last is None else last.ts
    result.log_end = store.last_position(run_id)
    return result


class _StepReached(Exception):
    """Raised by the ``stop_step`` observer right after the step's end event is applied."""

    def __init__(self, event: AnyEvent) -> None:
        self.event = event


def _stop_at(step: int, then: Observer | None) -> Observer:
    def observe(event: Any, position: int, state: RunState) -> None:
        if then is not None:
            then(event, position, state)
        if event.step == step:
            raise _StepReached(event)

    return observe


def _starting_state(
    store: EventStore, run_id: str, until: int | None, stop_step: int | None, use_snapshot: bool
) -> tuple[RunState, int]:
    if not use_snapshot:
        return initial_state(), 1
    snap = store.load_snapshot(run_id)
    if snap is None or (until is not None and snap[0] >= until):
        return initial_state(), 1
    try:
        state = decode_state(snap[1])
    except SnapshotDecodeError:
        return initial_state(), 1  # snapshots are a cache: fold from the start
    if state.position != snap[0] or (stop_step is not None and stop_step in state.steps):
        return initial_state(), 1
    return state, snap[0] + 1


def _last_ts(store: EventStore, run_id: str, state: RunState) -> float:
    """ts of the event at ``state.position`` (after a problem or a snapshot start)."""
    if state.position == 0:
        return 0.0
    try:
        entries = store.read_raw(run_id, state.position, state.position, 1)
        return decode(entries[0].data, state.position).ts if entries else 0.0
    except EventDecodeError:
        return 0.0


def read_events(
    store: EventStore, run_id: str, start: int = 1, end: int | None = None
) -> Iterator[tuple[int, AnyEvent]]:
    """Decoded (position, event) pairs; raises ``EventDecodeError`` naming the position."""
    for page in _iter_pages(store, run_id, start, end):
        for position, data in page.entries():
            yield position, decode(data, position)
