"""MemoryEventStore: the in-process twin of the Redis store, with the same semantics.

It keeps the *encoded* bytes, so decoding and malformed-entry behaviour match the Redis
store exactly; the contract suite in ``tests/contract/test_event_store.py`` runs against
both. The protocol and the shared checks are in ``events.store``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence

from events.chain import CHAIN_REFUSED, ChainHead, ChainWriter, check_snapshot_link
from events.codec import encode
from events.errors import (
    ChainError,
    ConcurrencyError,
    EpochNotClaimedError,
    FencedError,
    ReplicasMissingError,
    RunNotFoundError,
)
from events.schema import Event, StoredEvent
from events.store import (
    BULK_PAGE_SIZE,
    READ_PAGE_SIZE,
    EncodedPage,
    RawEntry,
    RunInfo,
    check_append_args,
    check_range,
    check_retry,
    check_run_id,
    check_snapshot_position,
    decode_entries,
    page_of,
)


class _MemoryRun:
    __slots__ = ("entries", "epoch", "snapshot", "head")

    def __init__(self) -> None:
        self.entries: list[RawEntry] = []
        self.epoch = 0
        #: (position, data, chain hash of the entry at position)
        self.snapshot: tuple[int, bytes, str] | None = None
        #: the newest chained entry
        self.head: ChainHead | None = None


class MemoryEventStore:
    """In-process EventStore with the Redis store's semantics. Thread-safe.

    :meth:`follow` waits on an ``asyncio.Event`` per follower that appends set from any
    thread (``call_soon_threadsafe``), and re-checks every ``block_ms`` regardless.
    """

    def __init__(self, *, chain_key: bytes | None = None) -> None:
        self._chain = ChainWriter(chain_key)
        self._runs: dict[str, _MemoryRun] = {}
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    # -- helpers -------------------------------------------------------------------

    def _run(self, run_id: str) -> _MemoryRun:
        check_run_id(run_id)
        run = self._runs.get(run_id)
        if run is None:
            raise RunNotFoundError(run_id, sorted(self._runs))
        return run

    def _wake_followers(self) -> None:
        for loop, event in list(self._waiters):
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # loop closed: that follower is gone
                self._waiters.discard((loop, event))

    # -- writes --------------------------------------------------------------------

    def claim_epoch(self, run_id: str) -> int:
        check_run_id(run_id)
        with self._lock:
            run = self._runs.setdefault(run_id, _MemoryRun())
            run.epoch += 1
            return run.epoch

    def append(
        self, run_id: str, events: Sequence[Event], *, expected_position: int, epoch: int
    ) -> list[int]:
        check_run_id(run_id)
        check_append_args(events, expected_position, epoch)
        entries = [(type(e).__name__, e.event_id, encode(e)) for e in events]
        prev, hashes = self._chain.batch(  # encode and hash outside the lock
            run_id, expected_position, entries, lambda p: self._hash_at(run_id, p)
        )
        # positioned here, outside the lock: a namedtuple ``_replace`` per entry under it
        # cost as much as the entries' hashing (~17 us per append, 5 per episode group)
        first = expected_position + 1
        encoded = [RawEntry(p, d, t, i, h)
                   for p, (t, i, d), h in zip(range(first, first + len(entries)), entries, hashes)]
        try:
            positions = self._append_locked(run_id, encoded, expected_position, epoch, prev)
        except Exception:
            self._chain.forget(run_id)
            raise
        self._chain.appended(run_id, positions[-1], hashes[-1])
        self._wake_followers()
        return positions

    def _append_locked(
        self, run_id: str, encoded: list[RawEntry], expected_position: int, epoch: int, prev: str
    ) -> list[int]:
        with self._lock:
            run = self._runs.get(run_id)
            current = 0 if run is None else run.epoch
            if epoch < current:
                raise FencedError(run_id, epoch, current)
            if run is None or epoch > current:
                raise EpochNotClaimedError(run_id, epoch, current)
            length = len(run.entries)
            positions = list(range(expected_position + 1, expected_position + 1 + len(encoded)))
            if length == expected_position:
                if prev != ("" if run.head is None else run.head.hash):
                    raise ChainError(run_id, expected_position + 1, CHAIN_REFUSED)
                run.entries.extend(encoded)  # positioned by ``append``: expected + 1, ...
                if encoded[-1].chain:
                    alg = run.head.algorithm if run.head else self._chain.algorithm
                    run.head = ChainHead(encoded[-1].chain, positions[-1], alg)
            elif length < expected_position:
                raise ConcurrencyError(run_id, expected_position, length, "log is behind")
            else:
                stored = run.entries[expected_position : positions[-1]]
                mine = [e.event_id for e in encoded]
                check_retry(run_id, expected_position, length, [e.event_id for e in stored], mine)
                if [e.chain for e in stored] != [e.chain for e in encoded]:
                    raise ChainError(run_id, expected_position + 1, CHAIN_REFUSED)
            return positions

    def _hash_at(self, run_id: str, position: int) -> str:
        entries = self.read_raw(run_id, position, position, 1)
        return entries[0].chain if entries else ""

    def chain_head(self, run_id: str) -> ChainHead | None:
        with self._lock:
            return self._run(run_id).head

    def append_raw(
        self, run_id: str, data: bytes, *, event_type: str = "?", event_id: str = ""
    ) -> int:
        """Append bytes as they are, unchecked and unfenced. For tests and repair tools only."""
        check_run_id(run_id)
        with self._lock:
            run = self._runs.setdefault(run_id, _MemoryRun())
            position = len(run.entries) + 1
            run.entries.append(RawEntry(position, bytes(data), event_type, event_id))
        self._wake_followers()
        return position

    def save_snapshot(self, run_id: str, position: int, data: bytes) -> bool:
        with self._lock:
            run = self._run(run_id)
            check_snapshot_position(run_id, position, len(run.entries))
            if run.snapshot is not None and run.snapshot[0] > position:
                return False
            link = run.entries[position - 1].chain if position else ""
            run.snapshot = (position, bytes(data), link)
            return True

    # -- reads ---------------------------------------------------------------------

    def read_raw(
        self, run_id: str, start: int = 1, end: int | None = None, count: int | None = None
    ) -> list[RawEntry]:
        check_range(start, end, count)
        with self._lock:
            entries = self._run(run_id).entries
            stop = len(entries) if end is None else min(end, len(entries))
            if count is not None:
                stop = min(stop, start - 1 + count)
            return entries[start - 1 : stop]

    def read(
        self, run_id: str, start: int = 1, end: int | None = None, count: int | None = None
    ) -> list[StoredEvent]:
        return decode_entries(self.read_raw(run_id, start, end, count))

    def read_page(self, run_id: str, start: int = 1, count: int = BULK_PAGE_SIZE) -> EncodedPage:
        check_range(start, None, count)
        with self._lock:
            entries = self._run(run_id).entries[start - 1 : start - 1 + count]
        return page_of(entries, start)

    def last_position(self, run_id: str) -> int:
        with self._lock:
            return len(self._run(run_id).entries)

    def current_epoch(self, run_id: str) -> int:
        with self._lock:
            return self._run(run_id).epoch

    def run_exists(self, run_id: str) -> bool:
        check_run_id(run_id)
        return run_id in self._runs

    def list_runs(self) -> list[RunInfo]:
        with self._lock:
            return [
                RunInfo(
                    run_id=run_id,
                    last_position=len(run.entries),
                    epoch=run.epoch,
                    snapshot_position=None if run.snapshot is None else run.snapshot[0],
                )
                for run_id, run in sorted(self._runs.items())
            ]

    def load_snapshot(self, run_id: str) -> tuple[int, bytes] | None:
        with self._lock:
            snap = self._run(run_id).snapshot
        if snap is None:
            return None
        if snap[2]:
            check_snapshot_link(run_id, snap[0], snap[2], lambda p: self._hash_at(run_id, p))
        return snap[0], snap[1]

    async def follow(
        self, run_id: str, from_position: int = 0, *, block_ms: int = 1000
    ) -> AsyncIterator[StoredEvent]:
        if from_position < 0:
            raise ValueError(f"from_position must be >= 0, got {from_position}")
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        self._waiters.add(waiter)
        try:
            position = from_position
            while True:
                waiter[1].clear()
                for stored in self.read(run_id, position + 1, count=READ_PAGE_SIZE):
                    position = stored.position
                    yield stored
                if self.last_position(run_id) > position:
                    continue
                try:
                    await asyncio.wait_for(waiter[1].wait(), block_ms / 1000)
                except TimeoutError:
                    pass
        finally:
            self._waiters.discard(waiter)

    def require_replicas(self, wanted: int) -> None:
        """Nothing copies an in-process log: it has no replica, so any ``wanted`` > 0 is
        refused (an append here is as durable as this process, whatever is asked)."""
        if wanted > 0:
            raise ReplicasMissingError("the in-memory store", wanted, 0)

    def close(self) -> None:
        pass
