"""The controller's only path to the log, and so to its own state.

``LogWriter.append`` sends a batch to the store at the position the writer last saw,
with the writer's epoch, and only after the store acknowledges it folds the events
into the in-memory state. State therefore never runs ahead of the log: the write-ahead
protocol's "no side effect on state the log has not acknowledged" holds by
construction. A transient store failure is retried with the same expected position
(the store recognises a batch that already landed), a ``FencedError`` is final: a newer
controller owns the run and this one must stop touching workers.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence, TypeVar

from controller.core.reducer import apply
from controller.core.state import RunState, encode_state
from events.errors import ConcurrencyError, FencedError, StoreUnavailableError
from events.schema import Event, StoredEvent
from events.store import EventStore

E = TypeVar("E", bound=Event)


class LogWriter:
    def __init__(
        self,
        store: EventStore,
        run_id: str,
        epoch: int,
        state: RunState,
        *,
        clock: Callable[[], float] = time.time,
        retries: int = 5,
        retry_delay_s: float = 0.2,
        snapshot_every: int = 5000,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.epoch = epoch
        self.state = state
        self.clock = clock
        self.retries = retries
        self.retry_delay_s = retry_delay_s
        self.fenced: FencedError | None = None
        #: the log is not where this writer's state says (e.g. a failover lost the
        #: primary's newest writes): the state must never be saved as a snapshot
        self.diverged: ConcurrencyError | None = None
        self.appended = 0
        #: save a snapshot of the folded state every this many events (0 = never)
        self.snapshot_every = snapshot_every
        self._last_snapshot = state.position
        #: called with (batch, state) after each acknowledged batch is folded (metrics)
        self.listeners: list[Callable[[Sequence[Event], RunState], None]] = []

    @property
    def position(self) -> int:
        return self.state.position

    def make(self, cls: type[E], **fields: Any) -> E:
        """An event of ``cls`` stamped with this writer's epoch and the current time."""
        return cls(epoch=self.epoch, ts=self.clock(), **fields)

    def append(self, *events: Event) -> list[int]:
        """Append a batch atomically; fold it into ``state`` once acknowledged."""
        if self.fenced is not None:
            raise self.fenced
        batch: Sequence[Event] = events
        for attempt in range(self.retries + 1):
            try:
                positions = self.store.append(
                    self.run_id, batch, expected_position=self.position, epoch=self.epoch
                )
                break
            except FencedError as err:
                self.fenced = err
                raise
            except ConcurrencyError as err:
                self.diverged = err
                raise
            except StoreUnavailableError:
                if attempt == self.retries:
                    raise
                time.sleep(self.retry_delay_s * (attempt + 1))
        for pos, event in zip(positions, batch):
            apply(self.state, StoredEvent(position=pos, event=event))
        self.appended += len(batch)
        for listen in self.listeners:
            listen(batch, self.state)
        if self.snapshot_every and self.position - self._last_snapshot >= self.snapshot_every:
            self.snapshot()
        return positions

    def snapshot(self) -> None:
        """Save the folded state at the current position (a cache for fast recovery)."""
        if self.diverged is not None:
            return
        try:
            self.store.save_snapshot(self.run_id, self.position, encode_state(self.state))
            self._last_snapshot = self.position
        except StoreUnavailableError:
            pass  # only a cache: the next append retries the store anyway
