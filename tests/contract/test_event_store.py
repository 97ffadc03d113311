"""One contract for every EventStore: in-memory, Redis on fakeredis, Redis on redis-server.

Each test states a property of the log that the controller relies on; the same test
runs against each implementation, so they cannot drift apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Iterator

import fakeredis
import pytest

import events.redis_store.store
import events.store
from events.codec import encode
from events.errors import (
    ChainError,
    ConcurrencyError,
    EpochNotClaimedError,
    EventDecodeError,
    FencedError,
    ReplicasMissingError,
    RunNotFoundError,
)
from events.redis_store import RedisEventStore
from events.schema import GroupFailed, RunStarted, StepBegun, StoredEvent
from events.memory_store import MemoryEventStore
from events.store import EventStore, RawEntry, RunInfo, ServerEventStore

RUN = "run-a"


@pytest.fixture(params=["memory", "fakeredis", "redis", "redis-scripted-pages"])
def store(request: pytest.FixtureRequest) -> Iterator[EventStore]:
    if request.param == "memory":
        made: EventStore = MemoryEventStore()
    elif request.param == "fakeredis":
        pytest.importorskip("lupa", reason="fakeredis runs the append script only with lupa")
        server = fakeredis.FakeServer()
        made = RedisEventStore(
            "redis://fakeredis",
            client=fakeredis.FakeRedis(server=server),
            async_client_factory=lambda: fakeredis.FakeAsyncRedis(server=server),
        )
    elif request.param == "redis":
        made = RedisEventStore(request.getfixturevalue("redis_url"))
    else:  # the bulk read a client without the compiled RESP parser uses
        made = RedisEventStore(request.getfixturevalue("redis_url"), page_reads="script")
    yield made
    made.close()


def failed(n: int, epoch: int = 1) -> GroupFailed:
    return GroupFailed(
        event_id=f"group:g{n}:failed:a0", epoch=epoch, ts=100.0 + n, group_id=f"g{n}",
        attempt=0, reason="lost",
    )


def batch(first: int, size: int, epoch: int = 1) -> list[GroupFailed]:
    return [failed(n, epoch) for n in range(first, first + size)]


def event_ids(stored: list[StoredEvent]) -> list[str]:
    return [s.event.event_id for s in stored]


def _declared(protocol: type) -> dict[str, object]:
    """The public methods a protocol declares, its base tiers' included."""
    return {
        n: v for tier in reversed(protocol.__mro__) if tier is not object
        for n, v in vars(tier).items() if callable(v) and not n.startswith("_")
    }


def test_implements_the_protocol_with_its_signatures(store: EventStore) -> None:
    # isinstance() on a runtime Protocol only checks that the names exist; the
    # parameters (names, kinds, defaults, annotations) must match the protocol's too.
    assert isinstance(store, EventStore)
    methods = list(_declared(EventStore))
    assert {"read_page", "chain_head", "append_raw"} <= set(methods) and len(methods) == 16
    for name in methods:
        want = inspect.signature(getattr(EventStore, name))
        got = inspect.signature(getattr(type(store), name))
        assert list(got.parameters.values()) == list(want.parameters.values()), name
        assert got.return_annotation == want.return_annotation, name
    assert inspect.isasyncgenfunction(type(store).follow)


def test_every_capability_of_a_store_is_declared_by_its_tier(store: EventStore) -> None:
    """A store's public methods are exactly those of the tier it implements, so a
    caller never has to probe for one with getattr: the in-memory twin is an
    ``EventStore``, a Redis store a ``ServerEventStore`` (which adds what a shared
    server can do)."""
    tier = ServerEventStore if isinstance(store, RedisEventStore) else EventStore
    assert isinstance(store, ServerEventStore) == (tier is ServerEventStore)
    declared = _declared(tier)
    public = {
        n for n, v in vars(type(store)).items() if callable(v) and not n.startswith("_")
    }
    assert public == set(declared), f"{type(store).__name__} vs {tier.__name__}"
    for name, member in declared.items():
        got = inspect.signature(getattr(type(store), name))
        assert list(got.parameters) == list(inspect.signature(member).parameters), name


def test_a_store_missing_a_method_is_not_an_event_store() -> None:
    class NoBulkRead(MemoryEventStore):
        read_page = None  # type: ignore[assignment]

    assert not isinstance(NoBulkRead(), EventStore)


def test_every_store_says_whether_the_replicas_an_append_waits_for_exist(
    store: EventStore, request: pytest.FixtureRequest
) -> None:
    """``store.replicas = N`` makes every append wait for N replicas: a store refuses,
    before anything is written, a number it cannot have. None of these stores has a
    replica (the in-memory log is one process's memory; the redis-server here runs
    alone), so 0 passes and 1 is refused naming the key, the number wanted and had."""
    store.require_replicas(0)
    if request.node.callspec.params["store"] == "fakeredis":
        return  # fakeredis has no INFO: a server that does not say is not refused
    with pytest.raises(ReplicasMissingError, match=r"store.replicas = 1 .* has 0 connected"):
        store.require_replicas(1)
    assert store.list_runs() == []


def test_claim_epoch_is_monotonic_per_run(store: EventStore) -> None:
    assert [store.claim_epoch(RUN) for _ in range(3)] == [1, 2, 3]
    assert store.claim_epoch("run-b") == 1
    assert store.current_epoch(RUN) == 3
    assert store.run_exists(RUN) and store.run_exists("run-b")
    assert store.last_position("run-b") == 0
    assert store.read("run-b") == []


def test_append_read_round_trip(store: EventStore) -> None:
    epoch = store.claim_epoch(RUN)
    started = RunStarted(
        event_id=f"run:{RUN}:started", epoch=epoch, ts=1.5, run_id=RUN,
        config={"lr": 1e-6, "nested": {"k": [1, 2]}}, seed=7, code_version="abc",
        window_versions=2, groups_per_step=4, samples_per_group=8,
    )
    begun = StepBegun(event_id="step:0:begun", epoch=epoch, ts=2.0, step=0, base_trainer_version=0)
    assert store.append(RUN, [started, begun], expected_position=0, epoch=epoch) == [1, 2]
    assert store.read(RUN) == [StoredEvent(1, started), StoredEvent(2, begun)]
    raw = store.read_raw(RUN)
    assert [(r.position, r.event_type, r.event_id) for r in raw] == [
        (1, "RunStarted", f"run:{RUN}:started"), (2, "StepBegun", "step:0:begun"),
    ]
    position, data = raw[0][:2]  # a RawEntry unpacks as (position, data, ...)
    assert position == 1 and b'"type":"RunStarted"' in data


def test_positions_are_gapless_across_batches(store: EventStore) -> None:
    epoch = store.claim_epoch(RUN)
    assert store.append(RUN, batch(1, 1), expected_position=0, epoch=epoch) == [1]
    assert store.append(RUN, batch(2, 3), expected_position=1, epoch=epoch) == [2, 3, 4]
    assert store.append(RUN, batch(5, 2), expected_position=4, epoch=epoch) == [5, 6]
    stored = store.read(RUN)
    assert [s.position for s in stored] == [1, 2, 3, 4, 5, 6]
    assert event_ids(stored) == [e.event_id for e in batch(1, 6)]
    assert store.last_position(RUN) == 6


def test_old_epoch_is_fenced_after_a_new_claim(store: EventStore) -> None:
    old = store.claim_epoch(RUN)
    store.append(RUN, batch(1, 2), expected_position=0, epoch=old)
    new = store.claim_epoch(RUN)
    with pytest.raises(FencedError) as info:
        store.append(RUN, batch(3, 1), expected_position=2, epoch=old)
    assert (info.value.run_id, info.value.epoch, info.value.current_epoch) == (RUN, old, new)
    # Fencing wins over idempotency: a zombie's retry of its own batch is refused too.
    with pytest.raises(FencedError):
        store.append(RUN, batch(1, 2), expected_position=0, epoch=old)
    assert store.append(RUN, batch(3, 1, new), expected_position=2, epoch=new) == [3]
    assert store.last_position(RUN) == 3


def test_unclaimed_epoch_is_rejected(store: EventStore) -> None:
    with pytest.raises(EpochNotClaimedError):
        store.append(RUN, batch(1, 1), expected_position=0, epoch=1)
    epoch = store.claim_epoch(RUN)
    with pytest.raises(EpochNotClaimedError) as info:
        store.append(RUN, batch(1, 1), expected_position=0, epoch=epoch + 1)
    assert info.value.current_epoch == epoch
    assert store.last_position(RUN) == 0


def test_retried_batch_is_written_once_with_the_same_positions(store: EventStore) -> None:
    epoch = store.claim_epoch(RUN)
    first = store.append(RUN, batch(1, 3), expected_position=0, epoch=epoch)
    assert store.append(RUN, batch(1, 3), expected_position=0, epoch=epoch) == first == [1, 2, 3]
    store.append(RUN, batch(4, 2), expected_position=3, epoch=epoch)
    # A retry after the log moved on still finds its entries (and a prefix of them).
    assert store.append(RUN, batch(1, 3), expected_position=0, epoch=epoch) == [1, 2, 3]
    assert store.append(RUN, batch(2, 2), expected_position=1, epoch=epoch) == [2, 3]
    assert event_ids(store.read(RUN)) == [e.event_id for e in batch(1, 5)]


def test_different_events_after_expected_position_conflict(store: EventStore) -> None:
    epoch = store.claim_epoch(RUN)
    store.append(RUN, batch(1, 3), expected_position=0, epoch=epoch)
    with pytest.raises(ConcurrencyError) as info:
        store.append(RUN, [failed(1), failed(99)], expected_position=0, epoch=epoch)
    assert (info.value.expected, info.value.actual) == (0, 3)
    with pytest.raises(ConcurrencyError):
        store.append(RUN, batch(50, 1), expected_position=2, epoch=epoch)
    assert store.last_position(RUN) == 3


def test_batch_longer_than_the_overlap_conflicts(store: EventStore) -> None:
    epoch = store.claim_epoch(RUN)
    store.append(RUN, batch(1, 2), expected_position=0, epoch=epoch)
    # Same ids as far as the log goes, but the batch runs past its end: not a replay.
    with pytest.raises(ConcurrencyError):
        store.append(RUN, batch(1, 3), expected_position=0, epoch=epoch)
    assert store.last_position(RUN) == 2


def test_expected_position_ahead_of_the_log_conflicts(store: EventStore) -> None:
    epoch = store.claim_epoch(RUN)
    store.append(RUN, batch(1, 2), expected_position=0, epoch=epoch)
    with pytest.raises(ConcurrencyError) as info:
        store.append(RUN, batch(3, 1), expected_position=5, epoch=epoch)
    assert (info.value.expected, info.value.actual) == (5, 2)


def test_invalid_appends_are_refused_before_writing(store: EventStore) -> None:
    epoch = store.claim_epoch(RUN)
    with pytest.raises(ValueError):
        store.append(RUN, [], expected_position=0, epoch=epoch)
    with pytest.raises(ValueError, match="duplicate"):
        store.append(RUN, [failed(1), failed(1)], expected_position=0, epoch=epoch)
    with pytest.raises(ValueError):
        store.append(RUN, batch(1, 1), expected_position=-1, epoch=epoch)
    with pytest.raises(ValueError, match="invalid run id"):
        store.claim_epoch("has space")
    assert store.last_position(RUN) == 0


def test_read_ranges(store: EventStore) -> None:
    epoch = store.claim_epoch(RUN)
    store.append(RUN, batch(1, 10), expected_position=0, epoch=epoch)

    def positions(**kw: int) -> list[int]:
        return [s.position for s in store.read(RUN, **kw)]

    assert positions() == list(range(1, 11))
    assert positions(start=4) == list(range(4, 11))
    assert positions(start=4, end=6) == [4, 5, 6]
    assert positions(start=4, count=2) == [4, 5]
    assert positions(start=4, end=5, count=10) == [4, 5]
    assert positions(start=9, end=100) == [9, 10]
    assert positions(start=11) == []
    assert positions(start=5, end=4) == []
    assert positions(count=0) == []
    with pytest.raises(ValueError):
        store.read(RUN, start=0)


def test_reads_page_through_long_logs(store: EventStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events.store, "READ_PAGE_SIZE", 4)
    monkeypatch.setattr(events.redis_store.store, "READ_PAGE_SIZE", 4)
    epoch = store.claim_epoch(RUN)
    store.append(RUN, batch(1, 11), expected_position=0, epoch=epoch)
    assert [s.position for s in store.read(RUN)] == list(range(1, 12))
    assert [s.position for s in store.read(RUN, start=2, count=9)] == list(range(2, 11))


async def test_follow_yields_existing_then_new_events(store: EventStore) -> None:
    epoch = store.claim_epoch(RUN)
    store.append(RUN, batch(1, 3), expected_position=0, epoch=epoch)
    seen: list[int] = []
    caught_up = asyncio.Event()

    async def consume() -> None:
        async with contextlib.aclosing(store.follow(RUN, 1, block_ms=50)) as stream:
            async for stored in stream:
                seen.append(stored.position)
                if stored.position == 3:
                    caught_up.set()
                if stored.position == 5:
                    return

    task = asyncio.create_task(consume())
    await asyncio.wait_for(caught_up.wait(), timeout=5)  # the existing events 2 and 3
    assert seen == [2, 3]
    # Appended after the follower caught up: whether it is blocked in its read by now or
    # between two reads, the contract is that these arrive, in order, exactly once.
    store.append(RUN, batch(4, 2), expected_position=3, epoch=epoch)
    await asyncio.wait_for(task, timeout=5)
    assert seen == [2, 3, 4, 5]


async def test_follow_of_a_missing_run_raises(store: EventStore) -> None:
    with pytest.raises(RunNotFoundError):
        async for _ in store.follow("nope", 0, block_ms=10):
            pass


def test_list_runs(store: EventStore) -> None:
    assert store.list_runs() == []
    store.claim_epoch("run-b")
    epoch = store.claim_epoch(RUN)
    store.claim_epoch(RUN)
    store.append(RUN, batch(1, 2, epoch + 1), expected_position=0, epoch=epoch + 1)
    store.save_snapshot(RUN, 1, b"state")
    assert store.list_runs() == [
        RunInfo(run_id=RUN, last_position=2, epoch=2, snapshot_position=1),
        RunInfo(run_id="run-b", last_position=0, epoch=1, snapshot_position=None),
    ]


def test_snapshots_keep_the_newest(store: EventStore) -> None:
    epoch = store.claim_epoch(RUN)
    assert store.load_snapshot(RUN) is None
    store.append(RUN, batch(1, 5), expected_position=0, epoch=epoch)
    assert store.save_snapshot(RUN, 2, b"\x00at-2")
    assert store.save_snapshot(RUN, 5, b"\xffat-5")
    assert not store.save_snapshot(RUN, 3, b"older")  # an older one never replaces it
    assert store.load_snapshot(RUN) == (5, b"\xffat-5")
    with pytest.raises(ValueError):
        store.save_snapshot(RUN, 6, b"beyond the log")


def test_missing_run_names_the_known_runs(store: EventStore) -> None:
    store.claim_epoch("run-b")
    store.claim_epoch(RUN)
    assert not store.run_exists("nope")
    for call in (
        lambda: store.read("nope"),
        lambda: store.read_raw("nope"),
        lambda: store.last_position("nope"),
        lambda: store.current_epoch("nope"),
        lambda: store.load_snapshot("nope"),
        lambda: store.read_page("nope"),
    ):
        with pytest.raises(RunNotFoundError) as info:
            call()
        assert info.value.known == [RUN, "run-b"]
        assert "run-a, run-b" in str(info.value)


def test_malformed_entry_raises_decode_error_at_its_position(store: EventStore) -> None:
    epoch = store.claim_epoch(RUN)
    store.append(RUN, batch(1, 2), expected_position=0, epoch=epoch)
    inject = store.append_raw  # type: ignore[attr-defined]  # test-only, not in the protocol
    assert inject(RUN, b"{not json", event_type="?", event_id="junk") == 3
    # the raw entry has no chain hash: the writer's chain refuses to build on it
    with pytest.raises(ChainError, match="position 4.*chain head"):
        store.append(RUN, batch(4, 1), expected_position=3, epoch=epoch)
    inject(RUN, encode(failed(4)), event_type="GroupFailed", event_id=failed(4).event_id)
    with pytest.raises(EventDecodeError) as info:
        store.read(RUN)
    assert info.value.position == 3
    assert "position 3" in str(info.value)
    assert [s.position for s in store.read(RUN, end=2)] == [1, 2]
    assert [s.position for s in store.read(RUN, start=4)] == [4]
    raw = store.read_raw(RUN)
    assert [r.position for r in raw] == [1, 2, 3, 4]
    assert raw[2] == RawEntry(3, b"{not json", "?", "junk")


# -- the bulk read (read_page) -------------------------------------------------------


def _as_bytes(data: bytes | str) -> bytes:
    return data.encode() if isinstance(data, str) else data


def page_entries(store: EventStore, start: int, count: int) -> list[tuple[int, bytes]]:
    page = store.read_page(RUN, start, count)
    return [(position, _as_bytes(data)) for position, data in page.entries()]


def test_read_page_returns_what_read_raw_returns(store: EventStore) -> None:
    epoch = store.claim_epoch(RUN)
    store.append(RUN, batch(1, 11), expected_position=0, epoch=epoch)
    for start, count in [(1, 4), (5, 4), (9, 4), (1, 100), (11, 1), (12, 5), (3, 0)]:
        want = [(r.position, r.data) for r in store.read_raw(RUN, start, count=count)]
        assert page_entries(store, start, count) == want, (start, count)
    page = store.read_page(RUN, 9, 4)
    assert (page.first, len(page.data), page.next_position) == (9, 3, 12)
    assert store.read_page(RUN).next_position == 12  # the default page holds the whole log


def test_read_page_hands_over_malformed_entries_undecoded(store: EventStore) -> None:
    epoch = store.claim_epoch(RUN)
    store.append(RUN, batch(1, 2), expected_position=0, epoch=epoch)
    inject = store.append_raw  # type: ignore[attr-defined]  # test-only, not in the protocol
    inject(RUN, b"{not json", event_type="?", event_id="junk")
    inject(RUN, b"\xff\xfe not utf-8", event_type="?", event_id="binary")
    # a well-formed entry after them, written raw too: the hash chain refuses a checked
    # append after unchained injections (test_chain_tamper covers that refusal)
    (good,) = batch(5, 1)
    inject(RUN, encode(good), event_type=type(good).__name__, event_id=good.event_id)
    got = page_entries(store, 1, 10)
    assert [p for p, _ in got] == [1, 2, 3, 4, 5]
    assert got[2] == (3, b"{not json") and got[3] == (4, b"\xff\xfe not utf-8")
    assert got[4] == (5, store.read_raw(RUN, 5)[0].data)


def test_read_page_rejects_bad_ranges(store: EventStore) -> None:
    store.claim_epoch(RUN)
    with pytest.raises(ValueError):
        store.read_page(RUN, 0, 5)
    with pytest.raises(ValueError):
        store.read_page(RUN, 1, -1)


def test_appends_form_a_hash_chain_that_audit_verifies(store: EventStore) -> None:
    from replay.chain_audit import audit_chain

    epoch = store.claim_epoch(RUN)
    store.append(RUN, batch(1, 2), expected_position=0, epoch=epoch)
    store.append(RUN, batch(3, 3), expected_position=2, epoch=epoch)
    assert store.append(RUN, batch(3, 3), expected_position=2, epoch=epoch) == [3, 4, 5]
    raw = store.read_raw(RUN)
    assert all(len(e.chain) == 64 for e in raw)
    head = store.chain_head(RUN)
    assert head is not None and (head.hash, head.position) == (raw[-1].chain, 5)
    report = audit_chain(store, RUN, None)
    assert (report.status, report.head) == ("ok", raw[-1].chain)
    assert store.save_snapshot(RUN, 4, b"state") and store.load_snapshot(RUN) == (4, b"state")
