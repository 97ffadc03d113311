"""The controller's only path to the log, and so to its own state.

``LogWriter.append`` sends a batch to the store at the position the writer last saw,
with the writer's epoch, and only after the store acknowledges it folds the events
into the in-memory state. The one exception is a batch of worker facts (pauses,
commits): its pauses are applied before the write, so that a bad one is refused
instead of written (``controller.core.prefold``), and taken back if the write fails --
all inside this one synchronous call, so no caller ever sees a state ahead of the log:
the write-ahead protocol's "no side effect on state the log has not acknowledged"
holds. Then it fires the crash points that follow the append
(``controller.crashpoints.after_append``).

One append is one attempt: a ``FencedError`` is final (a newer controller owns the run
and this one must stop touching workers), a ``ConcurrencyError`` means the log is not
where this writer thinks, and a ``StoreUnavailableError`` goes to the caller -- which
may try again with the same expected position (the store recognises a batch that
already landed). The loop does, without blocking its event loop
(``controller.journal.Journal.append``, bounded by :class:`Backoff`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

from controller import crashpoints
from controller.core.decisions import Stamp
from controller.core.prefold import fold_after_write, prefold, undo
from controller.core.reducer import apply
from controller.core.state import RunState, encode_state
from events.errors import ConcurrencyError, FencedError, StoreUnavailableError
from events.schema import Event, StoredEvent
from events.store import EventStore

E = TypeVar("E", bound=Event)


@dataclass(frozen=True)
class Backoff:
    """How often, and how patiently, an append that found the store unavailable is tried
    again: ``tries`` in all, waiting ``first_delay_s`` x 1, 2, 3, ... in between (3 s in
    all by default: a Redis restart or a Sentinel failover, not an outage)."""

    tries: int = 6
    first_delay_s: float = 0.2

    def delays(self) -> Iterator[float]:
        """The waits between tries (one fewer than ``tries``)."""
        return (self.first_delay_s * n for n in range(1, self.tries))


class LogWriter:
    def __init__(
        self,
        store: EventStore,
        run_id: str,
        epoch: int,
        state: RunState,
        *,
        clock: Callable[[], float] = time.time,
        snapshot_every: int = 5000,
        snapshot_events_per_mib: int = 0,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.epoch = epoch
        self.state = state
        self.clock = clock
        self.fenced: FencedError | None = None
        #: the log is not where this writer's state says (e.g. a failover lost the
        #: primary's newest writes): the state must never be saved as a snapshot
        self.diverged: ConcurrencyError | None = None
        self.appended = 0
        #: save a snapshot of the folded state every this many events (0 = never) ...
        self.snapshot_every = snapshot_every
        #: ... and, once a snapshot was saved, not before this many events per MiB of it
        #: (0: whatever its size; see :meth:`snapshot_due`)
        self.snapshot_events_per_mib = snapshot_events_per_mib
        self._last_snapshot = state.position
        self._last_snapshot_bytes = 0
        #: called with (batch, state) after each acknowledged batch is folded (metrics)
        self.listeners: list[Callable[[Sequence[Event], RunState], None]] = []

    @property
    def position(self) -> int:
        return self.state.position

    def stamp(self) -> Stamp:
        """This writer's epoch, the current time and the position it appends at: what a
        decision of ``controller.core.decisions`` needs to build its events."""
        return Stamp(epoch=self.epoch, ts=self.clock(), position=self.position)

    def make(self, cls: type[E], **fields: Any) -> E:
        """An event of ``cls`` stamped with this writer's epoch and the current time."""
        return cls(epoch=self.epoch, ts=self.clock(), **fields)

    def append(self, *events: Event, batch_point: str | None = None) -> list[int]:
        """Append a batch atomically (one attempt); fold it into ``state`` once
        acknowledged, then fire its crash points (``batch_point``: the one that follows
        this whole batch, see ``crashpoints.BATCH_POINTS``).

        A batch of worker facts (pauses, commits) is folded before the write
        (``controller.core.prefold``): one that breaks a rule raises
        :class:`~controller.core.prefold.RejectedFact` and nothing is written."""
        if self.fenced is not None:
            raise self.fenced
        batch: Sequence[Event] = events
        state = self.state
        applied = prefold(state, batch, self.position + 1)
        try:
            positions = self.store.append(
                self.run_id, batch, expected_position=self.position, epoch=self.epoch
            )
        except BaseException as err:
            undo(state, applied)  # not written: neither are they folded
            if isinstance(err, FencedError):
                self.fenced = err
            elif isinstance(err, ConcurrencyError):
                self.diverged = err
            raise
        if applied.pauses or applied.commits:
            for k, (pos, event) in enumerate(zip(positions, batch)):
                fold_after_write(state, applied, k, event, pos)
        else:
            for pos, event in zip(positions, batch):
                apply(state, StoredEvent(position=pos, event=event))
        self.appended += len(batch)
        for listen in self.listeners:
            listen(batch, self.state)
        if self.snapshot_due():
            self.snapshot()
        crashpoints.after_append(batch, state, self.epoch, batch_point)
        return positions

    def snapshot_due(self) -> bool:
        """Whether the events since the last snapshot call for a new one.

        Encoding and storing a snapshot costs in proportion to the state's size, and the
        state grows with the run (an episode run's ~100 bytes per event). A fixed event
        interval would make that cost per event grow without bound; spacing snapshots by
        ``snapshot_events_per_mib`` events per MiB of the last one keeps it below the
        cost of one MiB per that many events, however large the state. Recovery then
        folds at most max(``snapshot_every``, size in MiB x ``snapshot_events_per_mib``)
        events after the snapshot it loads: a tail proportional to the snapshot it
        decodes anyway, so recovery time stays a fixed multiple of reading the state."""
        if not self.snapshot_every:
            return False
        since = self.position - self._last_snapshot
        sized = self._last_snapshot_bytes * self.snapshot_events_per_mib / 2**20
        return since >= self.snapshot_every and since >= sized

    def snapshot(self) -> None:
        """Save the folded state at the current position (a cache for fast recovery)."""
        if self.diverged is not None:
            return
        try:
            data = encode_state(self.state)
            self.store.save_snapshot(self.run_id, self.position, data)
            self._last_snapshot, self._last_snapshot_bytes = self.position, len(data)
        except StoreUnavailableError:
            pass  # only a cache: the next append retries the store anyway
