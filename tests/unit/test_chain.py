"""The hash chain (events/chain.py): links, verification, and the writer's head cache."""

from __future__ import annotations

import pytest

from events.chain import Chain, ChainKeyError, ChainWriter, load_key, verify
from events.errors import ChainError
from events.schema import GroupFailed
from events.memory_store import MemoryEventStore

RUN = "run-c"
KEY = b"k" * 32


def entries(n: int) -> list[tuple[str, str, bytes]]:
    return [("GroupFailed", f"id{i}", b'{"x": %d}' % i) for i in range(1, n + 1)]


def chained(chain: Chain, items: list[tuple[str, str, bytes]]):
    hashes = chain.links(chain.genesis, 1, items)
    return [(p, t, i, d, h) for p, ((t, i, d), h) in enumerate(zip(items, hashes), start=1)]


def test_links_cover_position_type_id_and_data() -> None:
    c = Chain(RUN)
    base = c.link(c.genesis, 1, "A", "id", b"data")
    assert len(base) == 64
    assert c.link(c.genesis, 2, "A", "id", b"data") != base
    assert c.link(c.genesis, 1, "B", "id", b"data") != base
    assert c.link(c.genesis, 1, "A", "id2", b"data") != base
    assert c.link(c.genesis, 1, "A", "id", b"datb") != base
    # length framing: moving bytes between id and data changes the hash
    assert c.link(c.genesis, 1, "A", "idd", b"ata") != base
    assert Chain("other-run").genesis != c.genesis
    assert Chain(RUN, KEY).link(c.genesis, 1, "A", "id", b"data") != base


@pytest.mark.parametrize("key", [None, KEY], ids=["sha256", "hmac"])
def test_a_batch_links_as_one_link_after_another(key: bytes | None) -> None:
    c = Chain(RUN, key)
    items = [*entries(3), ("GroupFailed", b"bytes-id", b""), (b"Bytes", "id", b"\x00" * 9)]
    prev, expected = c.link(c.genesis, 6, "A", "i", b"d"), []
    for position, (t, i, d) in enumerate(items, start=7):
        prev = c.link(prev, position, t, i, d)
        expected.append(prev)
    assert c.links(c.link(c.genesis, 6, "A", "i", b"d"), 7, items) == expected


def test_verify_accepts_a_whole_chain_and_names_its_head() -> None:
    c = Chain(RUN, KEY)
    log = chained(c, entries(5))
    report = verify(c, log, stored_head=log[-1][4], stored_len=5)
    assert (report.status, report.head) == ("ok", log[-1][4])


@pytest.mark.parametrize(
    ("edit", "position", "why"),
    [
        (lambda log: log[:2] + [log[2][:3] + (b"{}", log[2][4])] + log[3:], 3, "mismatch"),
        (lambda log: log[:1] + log[2:], 2, "missing"),
        (
            lambda log: log[:1] + [log[1][:3] + (log[3][3], log[1][4])] + log[2:3]
            + [log[3][:3] + (log[1][3], log[3][4])] + log[4:],
            2, "mismatch",
        ),
        (lambda log: log[:3], 4, "truncated"),
        (lambda log: log + [(6, "GroupFailed", "id6", b"{}", "ab" * 32)], 6, "mismatch"),
        (lambda log: log[:4] + [log[4][:4] + ("",)], 5, "no chain hash"),
    ],
    ids=["edit", "delete", "swap", "truncate", "forged-append", "stripped-hash"],
)
def test_verify_names_the_first_bad_position(edit, position, why) -> None:
    c = Chain(RUN)
    log = chained(c, entries(5))
    report = verify(c, edit(log), stored_head=log[-1][4], stored_len=5)
    assert report.status == "broken"
    assert report.position == position
    assert why in report.reason


def test_recomputing_without_the_key_is_caught() -> None:
    keyed, plain = Chain(RUN, KEY), Chain(RUN)
    log = chained(keyed, entries(4))
    # rewrite entry 3 and recompute 3..4 with plain SHA-256 from the stored h_2
    forged = log[:2]
    prev = log[1][4]
    for p, t, i, d, _ in log[2:]:
        d = b'{"x": 99}' if p == 3 else d
        prev = plain.link(prev, p, t, i, d)
        forged.append((p, t, i, d, prev))
    assert verify(plain, forged[2:], stored_head=prev, stored_len=4).status == "broken"
    report = verify(keyed, forged, stored_head=prev, stored_len=4)
    assert (report.status, report.position) == ("broken", 3)


def test_log_without_hashes_reads_as_absent() -> None:
    log = [(p, t, i, d, "") for p, (t, i, d) in enumerate(entries(3), start=1)]
    assert verify(Chain(RUN), log, stored_head=None, stored_len=None).status == "absent"
    # a stored head with no hashes in the entries is a stripped chain, not an old log
    report = verify(Chain(RUN), log, stored_head="ab" * 32, stored_len=3)
    assert (report.status, report.position) == ("broken", 1)


def test_key_file_errors_are_one_line(tmp_path) -> None:
    with pytest.raises(ChainKeyError, match="chain_key_file .*missing"):
        load_key(tmp_path / "missing")
    short = tmp_path / "short"
    short.write_bytes(b"abc\n")
    with pytest.raises(ChainKeyError, match="at least 16"):
        load_key(short)
    good = tmp_path / "good"
    good.write_bytes(KEY + b"\n")
    assert load_key(good) == KEY


def failed(n: int) -> GroupFailed:
    return GroupFailed(
        event_id=f"group:g{n}:failed:a0", epoch=1, ts=float(n), group_id=f"g{n}",
        attempt=0, reason="lost",
    )


def test_writer_continues_the_chain_after_a_restart() -> None:
    store = MemoryEventStore(chain_key=KEY)
    epoch = store.claim_epoch(RUN)
    store.append(RUN, [failed(1), failed(2)], expected_position=0, epoch=epoch)
    # a new writer (new process): no cached head, so it reads h_2 from the log
    store._chain = ChainWriter(KEY)
    store.append(RUN, [failed(3)], expected_position=2, epoch=epoch)
    raw = store.read_raw(RUN)
    c = Chain(RUN, KEY)
    log = [(e.position, e.event_type, e.event_id, e.data, e.chain) for e in raw]
    head = store.chain_head(RUN)
    assert head is not None and (head.hash, head.position) == (raw[-1].chain, 3)
    assert verify(c, log, stored_head=head.hash, stored_len=3).status == "ok"
    # an idempotent retry of the last batch is recognised (same ids, same hashes)
    assert store.append(RUN, [failed(3)], expected_position=2, epoch=epoch) == [3]


def test_snapshot_records_the_hash_and_load_checks_it() -> None:
    store = MemoryEventStore()
    epoch = store.claim_epoch(RUN)
    store.append(RUN, [failed(1), failed(2)], expected_position=0, epoch=epoch)
    assert store.save_snapshot(RUN, 2, b"state")
    assert store.load_snapshot(RUN) == (2, b"state")
    run = store._runs[RUN]
    run.entries[1] = run.entries[1]._replace(chain="00" * 32)
    with pytest.raises(ChainError, match="position 2.*altered after the snapshot"):
        store.load_snapshot(RUN)


def test_a_log_from_before_chains_reads_resumes_unchained_and_audits_as_absent() -> None:
    from events.codec import encode
    from replay.chain_audit import audit_chain

    store = MemoryEventStore()
    epoch = store.claim_epoch(RUN)
    for n in (1, 2):  # how an old controller wrote: no h field
        store.append_raw(RUN, encode(failed(n)), event_type="GroupFailed",
                         event_id=failed(n).event_id)
    store.append(RUN, [failed(3)], expected_position=2, epoch=epoch)  # a resumed run
    assert [e.chain for e in store.read_raw(RUN)] == ["", "", ""]
    assert store.chain_head(RUN) is None
    assert [s.event for s in store.read(RUN)] == [failed(1), failed(2), failed(3)]
    assert audit_chain(store, RUN, None).describe().startswith("chain: absent")


def test_the_forked_chain_audit_gives_the_same_verdict_and_the_same_errors() -> None:
    from events.errors import RunNotFoundError
    from replay.chain_audit import audit_chain, start_audit_chain

    store = MemoryEventStore(chain_key=KEY)
    epoch = store.claim_epoch(RUN)
    store.append(RUN, [failed(n) for n in range(1, 6)], expected_position=0, epoch=epoch)
    for key in (KEY, None, b"x" * 32):  # ok, unverified (no key), broken (wrong key)
        assert start_audit_chain(store, RUN, key)() == audit_chain(store, RUN, key)
    assert audit_chain(store, RUN, b"x" * 32).status == "broken"
    # the child fails; the verdict re-runs here and raises what audit_chain raises
    with pytest.raises(RunNotFoundError):
        start_audit_chain(store, "no-such-run", None)()
