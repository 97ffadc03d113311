"""The one projector: a run's state at any point of its log, from the newest usable
snapshot plus the tail -- as ``Repository.get`` does in event sourcing.

    projection = Projector(store).get(run_id, until=1200, observers=[trace])

Every reader of a run's state gets it here: the controller at start
(``controller.startup``), ``replay`` (any point, any step), ``staleness`` (with its
trace as an observer), ``audit`` (every event, no snapshot), the simulator (its timeline
is an observer) and the what-if. The fold itself is ``controller.core.fold`` (decode with
the event codec, apply with the reducer).

A bad entry never escapes as a traceback: the first malformed entry
(``EventDecodeError``) or broken rule (``InvariantViolation``) stops the fold and comes
back as a :class:`LogProblem` naming its position, with the state as of the entry
before it (the reducer leaves the state untouched when it rejects an event); callers
that cannot go on without the state ask :meth:`Projection.require`.

Snapshots are a cache. The fold starts from the store's newest snapshot when it lies
before the point asked for, decodes, and sits where it says -- and no observer is given
(an observer sees every event from the first). Should the tail not fold onto it, the
log is folded again from its first event, which decides.

Speed: a 1M-event log must fold in seconds. Entries come from the store's bulk read
(``EventStore.read_page``, one server round trip per page of :data:`PAGE_ENTRIES`),
read ahead of the fold by a helper thread, or for a long log by forked readers
(``controller.page_reader``; not in a process that may hold threads a fork would
orphan: ``fork_readers=False``).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, ParamSpec, TypeVar

from controller import page_reader
from controller.core.errors import InvariantViolation, SnapshotDecodeError
from controller.core.fold import Callback, Observer, apply_raw, watching
from controller.core.state import RunState, decode_state, initial_state
from events.codec import decode
from events.errors import EventDecodeError
from events.schema import AnyEvent, StepAborted, StepFinished
from events.store import BULK_PAGE_SIZE, EncodedPage, EventStore

__all__ = ["LogProblem", "Observer", "PAGE_ENTRIES", "Projection", "Projector", "gc_paused",
           "iter_pages"]

#: Entries per page (one server round trip each against Redis).
PAGE_ENTRIES = BULK_PAGE_SIZE

#: a long fold reports its progress each time it passes a multiple of this many events
PROGRESS_EVERY = 1_000_000

#: called with (position folded, the log's last position) as a long fold goes on
Progress = Callable[[int, int], None]

#: (position, encoded event): what the fold consumes (JSON text, as bytes or str)
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
class Projection:
    """A fold that stopped at the end, at a requested point, or at the first problem."""

    state: RunState
    #: ts of the last applied event (0.0 when none)
    last_ts: float = 0.0
    problem: LogProblem | None = None
    #: the error that ``problem`` describes (raised again by :meth:`require`)
    error: Exception | None = None
    #: position of the newest entry in the log when the read finished
    log_end: int = 0
    #: True when ``stop_step`` was given and its end event was reached
    reached: bool = False
    #: what each folded page's ``check`` said, in order (``read`` of ``get``)
    page_checks: list[Any] = field(default_factory=list)

    def require(self) -> RunState:
        """The state; the error that stopped the fold, raised again, if one did."""
        if self.error is not None:
            raise self.error
        return self.state


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


class Projector:
    """Folds runs of one store (see the module docstring)."""

    def __init__(self, store: EventStore, *, fork_readers: bool = True) -> None:
        self.store = store
        self.fork_readers = fork_readers

    @gc_paused  # no reference cycles; see gc_paused
    def get(
        self,
        run_id: str,
        *,
        until: int | None = None,
        stop_step: int | None = None,
        observers: Iterable[Observer] = (),
        snapshot: bool = True,
        read: page_reader.Fetch | None = None,
        progress: Progress | None = None,
    ) -> Projection:
        """The state right after position ``until`` (default: the end), or right after
        step ``stop_step``'s StepFinished / StepAborted (``reached`` says whether it came).

        ``observers`` watch the fold (``controller.core.fold.Observer``). ``snapshot=False``
        folds every event from the first (``audit`` checks every one). ``read`` reads a
        page of :data:`PAGE_ENTRIES` from a position (audit's reads check the hash chain
        too; each page's ``check`` lands in ``page_checks``). ``progress`` is called each
        time the fold passes a multiple of :data:`PROGRESS_EVERY` events.
        """
        watches = watching(observers)
        state, start = initial_state(), 1
        if snapshot and not watches:
            state, start = self._snapshot_start(run_id, until, stop_step)
        result = self._fold(run_id, state, start, until, stop_step, watches, read, progress)
        if result.problem is not None and start > 1:
            # The snapshot is a cache: what the log says from its first event decides.
            result = self._fold(run_id, initial_state(), 1, until, stop_step, watches, read,
                                progress)
        return result

    def _fold(
        self, run_id: str, state: RunState, start: int, until: int | None,
        stop_step: int | None, watches: dict[type, Callback], read: page_reader.Fetch | None,
        progress: Progress | None,
    ) -> Projection:
        store = self.store
        result = Projection(state=state)
        if stop_step is not None:
            watches = dict(watches)
            for cls in (StepFinished, StepAborted):
                watches[cls] = _stop_at(stop_step, watches.get(cls))
        last: AnyEvent | None = None
        end = 0 if progress is None else store.last_position(run_id) if until is None else until
        try:
            for page in self._pages(run_id, start, until, read):
                before = state.position
                last = apply_raw(state, page.entries(), watches) or last
                result.page_checks.append(page.check)
                if progress is not None and state.position // PROGRESS_EVERY > before // PROGRESS_EVERY:
                    progress(state.position, end)
        except _StepReached as reached:
            result.reached = True
            last = reached.event
        except EventDecodeError as err:
            where = state.position + 1 if err.position is None else err.position
            result.problem, result.error = LogProblem(where, "malformed", err.reason), err
            last = None
        except InvariantViolation as err:
            result.problem = LogProblem(err.position, "invariant", err.reason, err.event_id)
            result.error, last = err, None
        result.last_ts = _last_ts(store, run_id, state) if last is None else last.ts
        result.log_end = store.last_position(run_id)
        return result

    def _snapshot_start(
        self, run_id: str, until: int | None, stop_step: int | None
    ) -> tuple[RunState, int]:
        """The newest snapshot's state and the position after it, where it may be used."""
        snap = self.store.load_snapshot(run_id)  # ChainError: the log under it was altered
        if snap is None or (until is not None and snap[0] >= until):
            return initial_state(), 1
        try:
            state = decode_state(snap[1])
        except SnapshotDecodeError:
            return initial_state(), 1
        if state.position != snap[0] or (stop_step is not None and stop_step in state.steps):
            return initial_state(), 1
        return state, snap[0] + 1

    def _pages(
        self, run_id: str, start: int, end: int | None, read: page_reader.Fetch | None
    ) -> Iterator[EncodedPage]:
        return _pages(self.store, run_id, start, end, read, fork=self.fork_readers)


class _StepReached(Exception):
    """Raised by the ``stop_step`` observer right after the step's end event is applied."""

    def __init__(self, event: AnyEvent) -> None:
        self.event = event


def _stop_at(step: int, then: Callback | None) -> Callback:
    def observe(event: Any, position: int, state: RunState) -> None:
        if then is not None:
            then(event, position, state)
        if event.step == step:
            raise _StepReached(event)

    return observe


def _last_ts(store: EventStore, run_id: str, state: RunState) -> float:
    """ts of the event at ``state.position`` (after a problem or a snapshot start)."""
    if state.position == 0:
        return 0.0
    try:
        entries = store.read_raw(run_id, state.position, state.position, 1)
        return decode(entries[0].data, state.position).ts if entries else 0.0
    except EventDecodeError:
        return 0.0


# -- pages -------------------------------------------------------------------------------


def iter_pages(
    store: EventStore, run_id: str, start: int = 1, end: int | None = None
) -> Iterator[list[Entry]]:
    """(position, data) entries from ``start`` to ``end`` (inclusive), page by page."""
    for page in _pages(store, run_id, start, end):
        yield list(page.entries())


def _pages(
    store: EventStore, run_id: str, start: int = 1, end: int | None = None,
    read: page_reader.Fetch | None = None, *, fork: bool = True,
) -> Iterator[EncodedPage]:
    """The store's bulk pages, read ahead of the caller: by forked children for a long
    log (``controller.page_reader``: the read's parsing then runs on another core), else
    by a helper thread (the server's work and the socket wait overlap the caller's).
    ``read(position)`` reads a whole page (default: ``store.read_page``); with ``end``
    given, pages are read plainly up to it."""

    def fetch(position: int) -> EncodedPage:
        want = PAGE_ENTRIES if end is None else min(PAGE_ENTRIES, end - position + 1)
        if want <= 0:
            return EncodedPage(position, [])
        if read is not None and want == PAGE_ENTRIES:
            return read(position)
        return store.read_page(run_id, position, want)

    if fork and page_reader.can_fork() and _long(store, run_id, start, end):
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
