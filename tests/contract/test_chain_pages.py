"""Chain pages picked out of a raw XRANGE reply (``events.redis_store.replies.xrange_chain_page``)
against a real redis-server: the same (position, type, id, data, hash) tuples that
``read_raw`` gives, None for any page it cannot vouch for, and the same audit verdict
through ``replay.chain_audit`` whichever way the pages come (untouched and edited log).

The store's ``read_chain_page`` is the one ``audit`` uses when a store has
it: one XRANGE per page, no per-entry Python objects.
"""

from __future__ import annotations

import pytest

from events.redis_store.replies import xrange_chain_page
from events.redis_store import RedisEventStore, events_key
from replay.chain_audit import audit_chain
from tests.unit.log_builder import random_run

RUN = "sim-7"


@pytest.fixture
def store(redis_url: str):
    made = RedisEventStore(redis_url)
    made.client.delete(events_key(RUN))
    builder = random_run(7, 30, window=1, groups_per_step=4)
    events, position = [s.event for s in builder.events], 0
    i = 0
    while i < len(events):  # claim each epoch the log moves to, then append its events
        epoch = events[i].epoch
        while not made.run_exists(RUN) or made.current_epoch(RUN) < epoch:
            made.claim_epoch(RUN)
        j = i
        while j < len(events) and events[j].epoch == epoch:
            j += 1
        made.append(RUN, events[i:j], expected_position=position, epoch=epoch)
        position, i = j, j
    yield made
    made.close()


def _reply(store: RedisEventStore, start: int, count: int = 10_000):
    return store.client.execute_command(b"XRANGE", events_key(RUN), f"0-{start}", "+", "COUNT", count)


def test_a_chain_page_is_what_read_raw_reads(store: RedisEventStore) -> None:
    raw = store.read_raw(RUN, 5)
    page = xrange_chain_page(_reply(store, 5), 5)
    assert page == [
        (e.position, e.event_type.encode(), e.event_id.encode(), e.data, e.chain) for e in raw
    ]
    assert len(page) > 100 and all(len(h) == 64 for *_, h in page)


def test_a_page_it_cannot_vouch_for_is_none(store: RedisEventStore) -> None:
    assert xrange_chain_page(_reply(store, 5), 4) is None  # not the ids asked for
    store.client.xadd(events_key(RUN), {"type": "X", "id": "i", "data": "{}"}, id="0-999999")
    assert xrange_chain_page(_reply(store, 1), 1) is None  # an entry without a hash
    assert xrange_chain_page([], 1) == []


@pytest.mark.parametrize("edit", ["none", "data", "type"])
def test_audit_gives_one_verdict_whichever_way_pages_come(
    store: RedisEventStore, redis_url: str, edit: str
) -> None:
    if edit != "none":  # rewrite the stream with entry 40 changed, as a raw client could
        entries = store.read_raw(RUN)
        store.client.delete(events_key(RUN))
        for e in entries:
            fields = {"type": e.event_type, "id": e.event_id, "data": e.data, "h": e.chain}
            if e.position == 40 and edit == "data":
                fields["data"] = e.data.replace(b'"epoch"', b'"epoch" ')
            elif e.position == 40:
                fields["type"] = "Gr\u00f6upFailed"  # not ASCII: read through read_raw
            store.client.xadd(events_key(RUN), fields, id=f"0-{e.position}")
    fast = audit_chain(store, RUN, None)
    plain_store = RedisEventStore(redis_url)
    try:
        plain = audit_chain(plain_store, RUN, None)
    finally:
        plain_store.close()
    assert fast == plain
    assert (fast.status, fast.position) == (("ok", None) if edit == "none" else ("broken", 40))
