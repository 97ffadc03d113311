"""kill -9 the redis-server mid-appends: every acknowledged event survives, exactly once.

A writer thread appends batches as fast as it can against a real server with AOF and
``appendfsync always``. The server is SIGKILLed while appends are in flight, then
restarted on the same AOF directory. The batch whose reply was lost is "in doubt": it
may or may not be in the log (never half of it: the script's writes are atomic), and
retrying it must be idempotent.
"""

from __future__ import annotations

import threading
import time

import pytest

from events.errors import StoreUnavailableError
from events.redis_store import RedisEventStore
from events.schema import GroupFailed
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration

RUN = "durable"
BATCH = 5


def make_batch(first: int, epoch: int) -> list[GroupFailed]:
    return [
        GroupFailed(
            event_id=f"group:g{n}:failed:a0", epoch=epoch, ts=float(n), group_id=f"g{n}",
            attempt=0, reason="crash test",
        )
        for n in range(first, first + BATCH)
    ]


class Writer(threading.Thread):
    """Appends batches until the store fails; records what was acknowledged."""

    def __init__(self, store: RedisEventStore, epoch: int, position: int) -> None:
        super().__init__(daemon=True)
        self.store, self.epoch, self.position = store, epoch, position
        self.acked: dict[int, str] = {}  # position -> event id
        self.in_doubt: tuple[int, list[GroupFailed]] | None = None
        self.unexpected: BaseException | None = None

    def run(self) -> None:
        while True:
            events = make_batch(self.position + 1, self.epoch)
            try:
                positions = self.store.append(
                    RUN, events, expected_position=self.position, epoch=self.epoch
                )
            except StoreUnavailableError:
                self.in_doubt = (self.position, events)
                return
            except BaseException as err:  # noqa: BLE001 -- reported by the test
                self.unexpected = err
                return
            self.acked.update((p, e.event_id) for p, e in zip(positions, events))
            self.position = positions[-1]


def crash_round(server: RedisServer, epoch: int, position: int, min_batches: int) -> int:
    """One kill -9 / restart cycle; returns the log position after the in-doubt retry."""
    writer_store = RedisEventStore(server.url, connect_timeout_s=0.5)
    writer = Writer(writer_store, epoch, position)
    writer.start()
    deadline = time.monotonic() + 30
    while len(writer.acked) < min_batches * BATCH and writer.is_alive():
        assert time.monotonic() < deadline, "writer made no progress"
        time.sleep(0.005)
    server.kill()
    writer.join(timeout=60)
    assert not writer.is_alive()
    assert writer.unexpected is None, repr(writer.unexpected)
    assert writer.in_doubt is not None
    writer_store.close()

    server.start()
    store = RedisEventStore(server.url)
    try:
        stored = store.read(RUN)
        positions = [s.position for s in stored]
        ids = [s.event.event_id for s in stored]
        assert positions == list(range(1, len(stored) + 1)), "positions are not gapless"
        assert len(set(ids)) == len(ids), "an event was written twice"
        by_position = dict(zip(positions, ids))
        for pos, event_id in writer.acked.items():
            assert by_position.get(pos) == event_id, f"acknowledged event at {pos} lost"
        acked_end = max(writer.acked)
        # The in-doubt batch is all there or not at all.
        assert len(stored) in (acked_end, acked_end + BATCH)
        assert store.current_epoch(RUN) == epoch

        doubt_position, doubt_events = writer.in_doubt
        assert doubt_position == acked_end
        retried = store.append(RUN, doubt_events, expected_position=doubt_position, epoch=epoch)
        assert retried == list(range(acked_end + 1, acked_end + BATCH + 1))
        after = store.read(RUN)
        assert [s.event.event_id for s in after[:acked_end]] == ids[:acked_end]
        assert [s.event.event_id for s in after[acked_end:]] == [e.event_id for e in doubt_events]
        return len(after)
    finally:
        store.close()


def test_acknowledged_appends_survive_kill_9(redis_server: RedisServer) -> None:
    store = RedisEventStore(redis_server.url)
    epoch = store.claim_epoch(RUN)
    store.close()
    position = 0
    for min_batches in (20, 50, 5):
        position = crash_round(redis_server, epoch, position, min_batches)
    assert position >= 75 * BATCH
