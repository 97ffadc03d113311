"""The EventStore protocol, its value types and the checks every implementation shares.

A run's log is an append-only sequence of encoded events at positions 1, 2, 3, ...
(gapless; the position is the identity of an entry). Every append is guarded twice:

* **fencing** -- the writer passes the epoch it claimed with :meth:`claim_epoch`; once a
  newer controller claims a higher epoch, appends with the old one raise
  :class:`FencedError` (an epoch that was never claimed is rejected too);
* **optimistic concurrency** -- the writer passes the last position it saw. If the log
  is still there, the batch is appended. If the log has moved past it and the entries
  that follow carry exactly the batch's event ids, the append already happened (a retry
  after a lost reply) and the original positions are returned; anything else raises
  :class:`ConcurrencyError`.

Capabilities come in declared tiers (as eventsourcing's AggregateRecorder within
ApplicationRecorder): a caller that needs more than the log asks for the tier that
declares it, never probes a store with ``getattr``.

    EventStore          the log: claim, append, read, follow, snapshots, runs, and
                        whether the replicas an append waits for exist
      ServerEventStore  + a server others share: may this user write, how durable is
                        it, delete a run, chained pages picked out of one reply

The implementations: ``events.memory_store.MemoryEventStore`` (in-process, an
``EventStore``) and ``events.redis_store.RedisEventStore`` (a ``ServerEventStore``,
built by ``events.factory.open_store``); the contract suite in
``tests/contract/test_event_store.py`` runs against both.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import msgspec

from events.chain import ChainHead
from events.codec import decode
from events.errors import ConcurrencyError, RunIdError
from events.schema import Event, StoredEvent
from events.store_config import StoreConfig

#: Run ids become part of storage keys: no whitespace, braces or control characters.
_RUN_ID_RE = re.compile(r"^[^\s{}\x00-\x1f\x7f]{1,200}$")

#: Entries returned per round trip when a read has no ``count``.
READ_PAGE_SIZE = 1000
#: Entries per :meth:`EventStore.read_page` by default (folding a long log).
BULK_PAGE_SIZE = 20_000


class RunInfo(msgspec.Struct, frozen=True):
    """What a store knows about one run without reading its log."""

    run_id: str
    last_position: int
    epoch: int
    #: position of the newest snapshot, None when the run has none
    snapshot_position: int | None = None


class RawEntry(NamedTuple):
    """One log entry as stored: for tools that must report malformed entries and go on."""

    position: int
    data: bytes
    #: the ``type`` and ``id`` stream fields (readable without decoding ``data``)
    event_type: str = ""
    event_id: str = ""
    #: the entry's hash-chain link (``events.chain``); "" in a log from before chains
    chain: str = ""


class EncodedPage(NamedTuple):
    """Encoded events of one bulk read (:meth:`EventStore.read_page`), in log order.

    ``data`` holds each entry's JSON (bytes, or str where the store's fast path hands
    out text; ``events.codec.decode`` takes either). Entries sit at the consecutive
    positions ``first``, ``first + 1``, ... -- always, in a log written through this
    package -- unless ``positions`` lists them (a log edited by hand, whose gap the
    reducer then reports).
    """

    first: int
    data: list[bytes] | list[str]
    positions: list[int] | None = None
    #: what a checking read found on the page besides its data (``audit`` reads pages
    #: that check their hash-chain links, ``replay.chain_pages``); None for a plain read
    check: Any = None

    @property
    def next_position(self) -> int:
        """The position after the page's last entry."""
        if self.positions is not None and self.positions:
            return self.positions[-1] + 1
        return self.first + len(self.data)

    def entries(self) -> Iterable[tuple[int, bytes | str]]:
        """(position, data) pairs, built lazily (no tuple is kept per entry)."""
        if self.positions is None:
            return zip(itertools.count(self.first), self.data)
        return zip(self.positions, self.data)


#: (position, type, id, data, chain hash) of one entry, as ``events.chain.verify`` takes it
ChainEntry = tuple[int, bytes, bytes, bytes, str]


def page_of(entries: Sequence[RawEntry], start: int) -> EncodedPage:
    """``read_raw`` entries as a page (``positions`` kept only when they have a gap)."""
    if not entries:
        return EncodedPage(start, [])
    first = entries[0].position
    data = [e.data for e in entries]
    if first == start and entries[-1].position == first + len(entries) - 1:
        return EncodedPage(first, data)
    return EncodedPage(first, data, [e.position for e in entries])


@runtime_checkable
class EventStore(Protocol):
    """Append-only, fenced, idempotent event log per run. Positions are 1-based, gapless."""

    def claim_epoch(self, run_id: str) -> int:
        """Atomically increment and return the run's epoch, creating the run if needed."""
        ...

    def append(
        self, run_id: str, events: Sequence[Event], *, expected_position: int, epoch: int
    ) -> list[int]:
        """Append ``events`` after ``expected_position``; return their positions."""
        ...

    def read(
        self, run_id: str, start: int = 1, end: int | None = None, count: int | None = None
    ) -> list[StoredEvent]:
        """Decoded events at positions ``start..end`` (inclusive), at most ``count``."""
        ...

    def read_raw(
        self, run_id: str, start: int = 1, end: int | None = None, count: int | None = None
    ) -> list[RawEntry]:
        """Like :meth:`read` but undecoded, so malformed entries can be reported."""
        ...

    def read_page(self, run_id: str, start: int = 1, count: int = BULK_PAGE_SIZE) -> EncodedPage:
        """At most ``count`` encoded entries from ``start``: the bulk read that folds a
        long log. One round trip per page where the store has a server; no per-entry
        objects beyond the data itself."""
        ...

    def last_position(self, run_id: str) -> int: ...

    def current_epoch(self, run_id: str) -> int: ...

    def follow(
        self, run_id: str, from_position: int = 0, *, block_ms: int = 1000
    ) -> AsyncIterator[StoredEvent]:
        """Yield events after ``from_position``, then wait for new ones, forever."""
        ...

    def list_runs(self) -> list[RunInfo]: ...

    def run_exists(self, run_id: str) -> bool: ...

    def save_snapshot(self, run_id: str, position: int, data: bytes) -> bool:
        """Store folded state as of ``position``; kept only if not older than the newest."""
        ...

    def load_snapshot(self, run_id: str) -> tuple[int, bytes] | None:
        """The newest snapshot; raises ``ChainError`` if the log under it was altered."""
        ...

    def chain_head(self, run_id: str) -> ChainHead | None:
        """The run's chain head as its meta records it; None for a log without a chain."""
        ...

    def append_raw(
        self, run_id: str, data: bytes, *, event_type: str = "?", event_id: str = ""
    ) -> int:
        """Append bytes as they are, unchecked and unfenced; returns the position. For
        tests and repair tools only (an old or tampered log): the controller never calls it."""
        ...

    def require_replicas(self, wanted: int) -> None:
        """Raise ``ReplicasMissingError`` now, before anything is written, when fewer than
        ``wanted`` replicas could confirm an append (``store.replicas``): a server's
        connected replicas; none where nothing copies the log (the in-memory store). A
        server that does not say (``INFO`` refused) is not refused: each append's ``WAIT``
        still fails when its replicas do not confirm it."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ServerEventStore(EventStore, Protocol):
    """An :class:`EventStore` on a server that other users and processes share."""

    #: appends wait for this many replicas (``events.redis_store.replication``); a
    #: resumed run sets its own, read from its log
    replication: StoreConfig

    def require_writable(self) -> None:
        """Raise ``StorePermissionError`` now when this user may not write the log (a
        reader's ACL user), before anything else is started."""
        ...

    def durability(self) -> tuple[str, str] | None:
        """The server's (appendonly, appendfsync); None when it does not say."""
        ...

    def delete_run(self, run_id: str) -> None:
        """Remove the run's log, snapshot and metadata."""
        ...

    def read_chain_page(self, run_id: str, start: int, count: int) -> list[ChainEntry] | None:
        """At most ``count`` chained entries from ``start``, picked out of one reply for
        ``audit``'s chain walk; None for a page only ``read_raw`` can vouch for."""
        ...


# Argument checks shared by every implementation, so they fail the same way.


def check_run_id(run_id: str) -> None:
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
        raise RunIdError(
            f"invalid run id {run_id!r}: 1-200 characters, no whitespace or braces"
        )


def check_append_args(events: Sequence[Event], expected_position: int, epoch: int) -> None:
    if not events:
        raise ValueError("append needs at least one event")
    if expected_position < 0:
        raise ValueError(f"expected_position must be >= 0, got {expected_position}")
    if epoch < 1:
        raise ValueError(f"epoch must be >= 1 (claim one with claim_epoch), got {epoch}")
    ids = [e.event_id for e in events]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate event ids in one batch: {sorted(ids)}")


def check_range(start: int, end: int | None, count: int | None) -> None:
    if start < 1:
        raise ValueError(f"positions start at 1, got start={start}")
    if end is not None and end < 0:
        raise ValueError(f"end must be >= 0, got {end}")
    if count is not None and count < 0:
        raise ValueError(f"count must be >= 0, got {count}")


def decode_entries(entries: Sequence[RawEntry]) -> list[StoredEvent]:
    return [StoredEvent(position=e.position, event=decode(e.data, e.position)) for e in entries]


def check_retry(
    run_id: str, expected: int, length: int, stored_ids: Sequence[str], batch_ids: Sequence[str]
) -> None:
    """The log moved past ``expected``: accept only an exact replay of an earlier append."""
    if len(stored_ids) < len(batch_ids):
        raise ConcurrencyError(
            run_id, expected, length, "log moved by fewer entries than the batch (partial overlap)"
        )
    for offset, (stored, mine) in enumerate(zip(stored_ids, batch_ids)):
        if stored != mine:
            raise ConcurrencyError(
                run_id,
                expected,
                length,
                f"position {expected + 1 + offset} holds {stored!r}, batch has {mine!r}",
            )


def check_snapshot_position(run_id: str, position: int, last: int) -> None:
    if not 0 <= position <= last:
        raise ValueError(
            f"run {run_id!r}: snapshot position {position} outside the log (0..{last})"
        )

