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
from events.redis_store import RedisEventStore, events_key, meta_key, snapshot_key
from replay.chain_audit import audit_chain
from tests.unit.random_log import random_run

RUN = "sim-7"


@pytest.fixture
def store(redis_url: str):
    made = RedisEventStore(redis_url)
    made.client.delete(events_key(RUN), meta_key(RUN), snapshot_key(RUN))
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


def _rewrite(store: RedisEventStore, change) -> None:
    """Rewrite the stream through a raw client, ``change(position, fields)`` editing
    each entry's fields in place (returning False drops the entry)."""
    entries = store.read_raw(RUN)
    store.client.delete(events_key(RUN))
    for e in entries:
        fields = {"type": e.event_type, "id": e.event_id, "data": e.data, "h": e.chain}
        if change(e.position, fields) is not False:
            store.client.xadd(events_key(RUN), fields, id=f"0-{e.position}")


def _set_hash(position: int, value: str):
    def change(at: int, fields: dict) -> None:
        if at == position:
            fields["h"] = value
    return change


#: raw-client edits, each at or next to a page boundary of the 7-entry pages below
EDITS = {
    "none": lambda store: None,
    "data at a page's first entry": lambda store: _rewrite(store, lambda at, f: f.update(
        data=f["data"].replace(b'"epoch"', b'"epoch" ')) if at == 36 else None),
    "hash of a page's last entry": lambda store: _rewrite(store, _set_hash(35, "ab" * 32)),
    "hash not hex": lambda store: _rewrite(store, _set_hash(42, "not a hash")),
    "head in meta": lambda store: store.client.hset(meta_key(RUN), "chain_head", "cd" * 32),
    "tail truncated": lambda store: store.client.xdel(events_key(RUN), f"0-{store.last_position(RUN)}"),
    "entry deleted": lambda store: store.client.xdel(events_key(RUN), "0-50"),
    "type not ascii": lambda store: _rewrite(store, lambda at, f: f.update(
        type="Gr\u00f6upFailed") if at == 40 else None),
}


@pytest.mark.parametrize("forked", [False, True], ids=["in-process", "forked readers"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_audit_in_one_read_gives_the_walks_verdict_and_the_plain_fold(
    store: RedisEventStore, edit: str, forked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``audit_log`` (pages that check their own links) against the separate walk and a
    plain fold, with 7-entry pages so edits land on page boundaries."""
    from controller.core.state import encode_state
    from controller import page_reader, projector
    from replay.chain_audit import audit_log
    from replay.chain_pages import page_verdict
    from events.chain import Chain

    monkeypatch.setattr(projector, "PAGE_ENTRIES", 7)
    monkeypatch.setattr(page_reader, "FORK_ABOVE_ENTRIES", 0 if forked else 10**9)
    monkeypatch.setattr(page_reader, "reader_count", lambda: 2)
    EDITS[edit](store)
    result, verdict = audit_log(store, RUN, None)
    assert verdict == audit_chain(store, RUN, None)
    plain = projector.Projector(store).get(RUN)
    assert encode_state(result.state) == encode_state(plain.state)
    assert result.problem == plain.problem
    found = page_verdict(Chain(RUN), result.page_checks, store.chain_head(RUN),
                         result.log_end)
    if edit in ("none", "data at a page's first entry", "hash of a page's last entry",
                "hash not hex", "head in meta", "tail truncated"):
        assert found is not None  # the one-read path decided, not the fallback walk
        assert found[0] == verdict.status and found[2] == verdict.position
    else:
        assert found is None  # a gap or an entry only read_raw vouches for: the walk
    expected = {"none": None, "data at a page's first entry": 36,
                "hash of a page's last entry": 35, "hash not hex": 42}
    if edit in expected:
        assert verdict.position == expected[edit]
    assert (verdict.status == "ok") == (edit == "none")
