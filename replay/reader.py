"""Reading a run's log robustly and fast: raw pages, folded with the reducer.

Every read-only tool (``replay``, ``staleness``, ``audit``) folds the log the way
``controller.core.fold.fold_raw`` does -- decode each entry with the event codec, apply it
with the reducer -- but never lets a bad entry escape as a traceback: the first
malformed entry (``EventDecodeError``) or broken rule (``InvariantViolation``) stops
the fold and comes back as a :class:`LogProblem` naming its position, together with
the state as of the entry before it (the reducer leaves the state untouched when it
rejects an event).

Speed: a 1M-event log must fold in seconds. Entries are read in pages of
:data:`PAGE_ENTRIES`, and the next page is fetched on a helper thread while the current
one folds. Against a Redis store with the compiled RESP parser (``hiredis``) a page is
one plain XRANGE (the server does the least work) whose data fields are picked out with
C-level ``map``/``itemgetter`` passes, with no Python code per entry. Without
``hiredis``, parsing the nested XRANGE reply in Python would cost more than the fold;
a small read-only server-side script then returns the page's data fields packed into
ONE msgpack string instead, which ``msgspec`` splits in C. Any other store, a Redis
that refuses scripts, or a page that is not the plain gapless ``0-N`` entries these
fast paths expect is read through ``EventStore.read_raw``.
"""

from __future__ import annotations

import gc
import importlib.util
import itertools
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Literal, NamedTuple

import msgspec

from controller.core.errors import InvariantViolation, SnapshotDecodeError
from controller.core.fold import Observer, apply_raw
from controller.core.state import RunState, decode_state, initial_state
from events.codec import decode
from events.errors import EventDecodeError
from events.schema import AnyEvent, StepAborted, StepFinished
from events.store import EventStore

#: Entries per page (one server round trip each on the fast paths).
PAGE_ENTRIES = 20_000

# KEYS: stream. ARGV: first position, count. Reply: {first id, last id, msgpack array of
# the entries' data fields}. One bulk string per page: redis-py's pure-Python parser
# would otherwise spend more time on 20k bulk strings than the fold spends on them.
# Read-only: works on replicas and under EVAL_RO-only ACLs alike.
_PAGE_LUA = """
local e = redis.call('XRANGE', KEYS[1], '0-' .. ARGV[1], '+', 'COUNT', tonumber(ARGV[2]))
if #e == 0 then return {'', '', ''} end
local out = {}
for i = 1, #e do
  local f = e[i][2]
  if f[5] == 'data' then
    out[i] = f[6]
  else
    local d = ''
    for j = 1, #f, 2 do if f[j] == 'data' then d = f[j + 1] end end
    out[i] = d
  end
end
return {e[1][1], e[#e][1], cmsgpack.pack(out)}
"""

#: (position, encoded event) -- what the fold consumes. The event is JSON text, as bytes
#: or (from the scripted read) str; ``events.codec.decode`` takes either.
Entry = tuple[int, bytes]

_entry_fields = itemgetter(1)
_field_4 = itemgetter(4)
_field_5 = itemgetter(5)
_unpack_page = msgspec.msgpack.Decoder(list[str]).decode


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


# -- pages -------------------------------------------------------------------------------


def iter_pages(
    store: EventStore, run_id: str, start: int = 1, end: int | None = None
) -> Iterator[list[Entry]]:
    """(position, bytes) entries from ``start`` to ``end`` (inclusive), page by page.

    The next page is fetched on a helper thread while the caller works on this one, so
    the server's work and the fold overlap (the socket wait releases the GIL).
    """
    for page in _iter_pages(store, run_id, start, end):
        yield list(page.entries)


class _Page(NamedTuple):
    size: int
    #: position after the page's last entry
    next_position: int
    #: the page's (position, data) pairs, iterated once; from the fast paths a ``zip``
    #: over the data list, so no tuple is kept per entry
    entries: Iterable[Entry]


def _iter_pages(
    store: EventStore, run_id: str, start: int = 1, end: int | None = None
) -> Iterator[_Page]:
    fast = _fast_reader(store, run_id)

    def fetch(position: int) -> _Page:
        want = PAGE_ENTRIES if end is None else min(PAGE_ENTRIES, end - position + 1)
        if want <= 0:
            return _Page(0, position, ())
        data = fast(position, want) if fast is not None else None
        if data is not None:
            return _Page(len(data), position + len(data), zip(itertools.count(position), data))
        entries = [(e.position, e.data) for e in store.read_raw(run_id, position, end, want)]
        return _Page(len(entries), entries[-1][0] + 1 if entries else position, entries)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlc-read") as pool:
        pending = pool.submit(fetch, start)
        while True:
            page = pending.result()
            if not page.size:
                return
            full = page.size == PAGE_ENTRIES
            if full:
                pending = pool.submit(fetch, page.next_position)
            yield page
            if not full:
                return


def _fast_reader(store: EventStore, run_id: str) -> Callable[[int, int], list[Any] | None] | None:
    """A page reader straight off the Redis client, or None for the generic path.

    With the compiled RESP parser (``hiredis``) in use, plain XRANGE; without it, the
    read-only script above. Either returns None for a page it cannot vouch for (not the
    gapless ``0-N`` ids, an unexpected shape): ``read_raw`` then reads and explains it.
    """
    client = getattr(store, "client", None)
    if client is None or not hasattr(client, "execute_command"):
        return None
    from events.redis_store import events_key

    key = events_key(run_id)
    store.last_position(run_id)  # raises RunNotFoundError for a wrong run id
    read_page = _xrange_page if _hiredis_in_use(client) else _scripted_page
    broken = False

    def read(position: int, want: int) -> list[Any] | None:
        """The data of entries ``position`` .. ``position + want - 1`` (fewer at the end)."""
        nonlocal broken
        if broken:
            return None
        try:
            first, last, data = read_page(client, key, position, want)
        except Exception:  # scripts disabled, ACL, old server: the generic path reports errors
            broken = True
            return None
        if data is None:
            return None
        if not data:
            return []
        lo, hi = _seq(first), _seq(last)
        # Stream ids increase strictly, so first 0-lo, last 0-hi and hi - lo + 1 entries
        # mean exactly the ids 0-lo .. 0-hi.
        if lo != position or hi - lo + 1 != len(data):
            return None
        return data

    return read


def _hiredis_in_use(client: Any) -> bool:
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:  # pragma: no cover - very old redis-py
        return importlib.util.find_spec("hiredis") is not None
    return bool(HIREDIS_AVAILABLE) and type(client).__module__.startswith("redis.")


def _xrange_page(
    client: Any, key: str, position: int, want: int
) -> tuple[Any, Any, list[Any] | None]:
    # A bytes command name skips redis-py's per-entry dict callback: the nested reply
    # comes straight from the C parser, and the data fields are picked out in C too.
    batch = client.execute_command(b"XRANGE", key, f"0-{position}", "+", "COUNT", want)
    if not batch:
        return b"", b"", []
    fields = list(map(_entry_fields, batch))
    shape = set(map(len, fields))
    if (shape == {6} or shape == {8}) and list(map(_field_4, fields)).count(b"data") == len(fields):
        data = list(map(_field_5, fields))  # type, id, data[, h]: how the store writes
    else:
        data = [_data_field(f) for f in fields]
    return batch[0][0], batch[-1][0], data


def _scripted_page(
    client: Any, key: str, position: int, want: int
) -> tuple[Any, Any, list[Any] | None]:
    first, last, packed = client.execute_command("EVAL", _PAGE_LUA, 1, key, position, want)
    try:
        return first, last, _unpack_page(packed) if packed else []
    except msgspec.DecodeError:  # an entry that is not UTF-8: read_raw hands it over as is
        return first, last, None


def _data_field(fields: list[bytes]) -> bytes:
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == b"data":
            return fields[i + 1]
    return b""


def _seq(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(seq) if ms == "0" and seq.isdigit() else -1


# -- folding -----------------------------------------------------------------------------

def fold_log(
    store: EventStore,
    run_id: str,
    *,
    until: int | None = None,
    stop_step: int | None = None,
    observers: dict[type, Observer] | None = None,
    use_snapshot: bool = False,
) -> FoldResult:
    """Fold the run's log (up to position ``until``, or through step ``stop_step``'s end).

    ``observers`` maps an event type to a callback run after that event is applied
    (staleness traces); other events cost nothing extra. With ``use_snapshot`` the fold
    starts from the store's snapshot when it lies before ``until`` (replay only: audit
    must check every event).
    """
    state, start = _starting_state(store, run_id, until, stop_step, use_snapshot)
    result = FoldResult(state=state)
    watch = dict(observers or {})
    if stop_step is not None:
        for cls in (StepFinished, StepAborted):
            watch[cls] = _stop_at(stop_step, watch.get(cls))
    last: AnyEvent | None = None
    # The fold makes no reference cycles; with 10^5 live records, the collector's full
    # passes (triggered by every decoded event's allocations) would cost more than the fold.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for page in _iter_pages(store, run_id, start, until):
            last = apply_raw(state, page.entries, watch) or last
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
    finally:
        if gc_was_enabled:
            gc.enable()
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
        for position, data in page.entries:
            yield position, decode(data, position)
