"""``audit``'s chain check: recompute every link of the run's hash chain (``events.chain``).

Separate from the fold on purpose: the fold reads only the ``data`` field on its fast
path, and the chain covers what the fold never looks at (ids, the ``type`` field, the
head in meta). An HMAC chain can only be verified with its key; without one, audit
says so rather than reporting every entry as tampered.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from events.chain import HMAC_SHA256, SHA256, Chain, verify
from events.errors import ChainError
from events.store import EventStore, RawEntry

#: entries per read while verifying
PAGE = 20_000


@dataclass(frozen=True)
class ChainAudit:
    #: "ok", "absent", "broken" or "unverified" (an HMAC chain and no key given)
    status: str
    algorithm: str
    #: the verified head hash ("" when none): print it, pin it elsewhere
    head: str = ""
    head_position: int = 0
    position: int | None = None
    reason: str = ""

    def describe(self) -> str:
        if self.status == "ok":
            return f"chain: ok ({self.algorithm}), head {self.head} at position {self.head_position}"
        if self.status == "absent":
            return "chain: absent (the log was written before hash chains; edits cannot be seen)"
        if self.status == "unverified":
            return "chain: not verified (an HMAC chain: pass --chain-key-file to check it)"
        return f"chain: broken at position {self.position}: {self.reason}"

    def to_dict(self) -> dict[str, object]:
        return {
            "status": self.status, "algorithm": self.algorithm, "head": self.head,
            "head_position": self.head_position, "position": self.position,
            "reason": self.reason,
        }


def audit_chain(store: EventStore, run_id: str, key: bytes | None) -> ChainAudit:
    """Verify the whole chain of ``run_id``; with ``key``, as HMAC whatever meta says."""
    head = store.chain_head(run_id)
    if key is None and head is not None and head.algorithm == HMAC_SHA256:
        return ChainAudit("unverified", HMAC_SHA256)
    chain = Chain(run_id, key)
    algorithm = HMAC_SHA256 if key is not None else SHA256
    entries = _fast_entries(store, run_id)
    if entries is None:
        entries = (
            (e.position, e.event_type, e.event_id, e.data, e.chain) for e in _all(store, run_id)
        )
    report = verify(
        chain, entries,
        stored_head=None if head is None else head.hash,
        stored_len=None if head is None else head.position,
    )
    if report.status == "ok":
        try:  # the snapshot recorded the hash at its position: the log must still carry it
            store.load_snapshot(run_id)
        except ChainError as err:
            return ChainAudit("broken", algorithm, report.head, position=err.position,
                              reason=err.reason)
    return ChainAudit(
        report.status, algorithm, report.head,
        head_position=0 if head is None else head.position,
        position=report.position, reason=report.reason,
    )


def _fast_entries(store: EventStore, run_id: str) -> Iterator[Any] | None:
    """Entries straight off a Redis client with the compiled parser; None otherwise.

    A bytes command name gets the nested reply without redis-py's per-entry dict; the
    fields are picked by place when the entry has the store's layout (type, id, data,
    h), else by name. A stream id that is not ``0-N`` goes to the generic path's error.
    """
    from replay.reader import _hiredis_in_use

    client = getattr(store, "client", None)
    if client is None or not _hiredis_in_use(client):
        return None
    from events.redis_store import events_key

    key = events_key(run_id)

    def read() -> Iterator[Any]:
        start = 1
        while True:
            batch = client.execute_command(b"XRANGE", key, f"0-{start}", "+", "COUNT", PAGE)
            for entry_id, f in batch:
                ms, _, seq = entry_id.partition(b"-")
                if ms != b"0" or not seq.isdigit():
                    raise ChainError(run_id, None, f"stream id {entry_id!r} is not a position")
                if len(f) == 8 and f[0] == b"type" and f[2] == b"id" and f[6] == b"h":
                    yield int(seq), f[1], f[3], f[5], f[7].decode()
                else:
                    d = dict(zip(f[::2], f[1::2]))
                    h = d.get(b"h", b"").decode()
                    yield int(seq), d.get(b"type", b""), d.get(b"id", b""), d.get(b"data", b""), h
            if len(batch) < PAGE:
                return
            start = int(batch[-1][0].partition(b"-")[2]) + 1

    return read()


def _all(store: EventStore, run_id: str) -> Iterator[RawEntry]:
    start = 1
    while True:
        entries = store.read_raw(run_id, start, count=PAGE)
        yield from entries
        if len(entries) < PAGE:
            return
        start = entries[-1].position + 1
