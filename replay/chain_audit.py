"""``audit``'s chain check: recompute every link of the run's hash chain (``events.chain``).

The chain covers what the fold never looks at (ids, the ``type`` field, the head in
meta). :func:`audit_log` is what ``rl-controller audit`` runs: the fold's own page
reads check the links (``replay.chain_pages``), so the log is read once; the whole
walk on its own (:func:`audit_chain`) stays for whatever that path cannot vouch for.
An HMAC chain can only be verified with its key; without one, audit says so rather
than reporting every entry as tampered.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from events.chain import HMAC_SHA256, SHA256, Chain, verify
from events.errors import ChainError
from events.store import EventStore, ServerEventStore
from controller import projector
from controller.projector import Projection, Projector, gc_paused
from replay import chain_pages

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


@gc_paused
def audit_chain(store: EventStore, run_id: str, key: bytes | None) -> ChainAudit:
    """Verify the whole chain of ``run_id``; with ``key``, as HMAC whatever meta says."""
    head = store.chain_head(run_id)
    if key is None and head is not None and head.algorithm == HMAC_SHA256:
        return ChainAudit("unverified", HMAC_SHA256)
    chain = Chain(run_id, key)
    algorithm = HMAC_SHA256 if key is not None else SHA256
    entries = _all(store, run_id)
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


def audit_log(
    store: EventStore, run_id: str, key: bytes | None, progress: projector.Progress | None = None
) -> tuple[Projection, ChainAudit]:
    """Fold the whole log and verify its chain, as ``rl-controller audit`` does.

    The common case reads the log once: the pages the fold reads check their own links
    (``replay.chain_pages``). Anything that path cannot vouch for -- no chain head, an
    HMAC chain without its key, a page it could not read whole, a fold that stopped
    early -- gets the separate walk (started beside the fold when known up front).
    """
    head = store.chain_head(run_id)
    verdict: Callable[[], ChainAudit] | None = None
    fetch = None
    if head is None or (key is None and head.algorithm == HMAC_SHA256):
        verdict = start_audit_chain(store, run_id, key)  # no head, or no key: the walk says
    else:
        chain = Chain(run_id, key)
        fetch = chain_pages.checked_fetch(store, run_id, chain, projector.PAGE_ENTRIES)
        if fetch is None:
            verdict = start_audit_chain(store, run_id, key)  # on another core
    result = Projector(store).get(run_id, snapshot=False, read=fetch, progress=progress)
    if verdict is not None:
        return result, verdict()
    found = chain_pages.page_verdict(chain, result.page_checks, head, result.log_end)
    if found is None or head is None:
        return result, audit_chain(store, run_id, key)
    status, last, position, reason = found
    algorithm = HMAC_SHA256 if key is not None else SHA256
    if status == "ok":
        err = chain_pages.snapshot_problem(store, run_id)
        if err is not None:
            return result, ChainAudit("broken", algorithm, last, position=err.position,
                                      reason=err.reason)
    return result, ChainAudit(status, algorithm, last, head_position=head.position,
                              position=position, reason=reason)


def start_audit_chain(store: EventStore, run_id: str, key: bytes | None) -> Callable[[], ChainAudit]:
    """Start :func:`audit_chain` in a forked process; the returned function waits for its
    verdict. ``audit`` folds the log meanwhile: both read the whole log and hash or fold
    it, and the fork runs them on two cores instead of one after the other.

    The child reads through a connection of its own (redis-py reconnects after a fork and
    never closes the parent's sockets) and sends back only the verdict. Where fork is not
    available, or the child fails for any reason, the chain is checked in this process
    when the verdict is asked for, so an error reads exactly as without the fork.
    """
    if not sys.platform.startswith("linux"):
        return lambda: audit_chain(store, run_id, key)
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(
        target=_chain_child, args=(send, store, run_id, key), name="rlc-chain-audit", daemon=True
    )
    child.start()
    send.close()

    def verdict() -> ChainAudit:
        try:
            result = receive.recv()
        except (EOFError, OSError):
            result = None
        finally:
            receive.close()
            child.join()
        return result if isinstance(result, ChainAudit) else audit_chain(store, run_id, key)

    return verdict


def _chain_child(send: Any, store: EventStore, run_id: str, key: bytes | None) -> None:
    try:
        send.send(audit_chain(store, run_id, key))
    except BaseException:  # noqa: BLE001 -- the parent re-runs it and reports the error
        send.send(None)
    finally:
        send.close()


def _all(store: EventStore, run_id: str) -> Iterator[tuple[int, Any, Any, bytes, str]]:
    """(position, type, id, data, hash) of every entry, in order.

    A ``ServerEventStore`` is read through ``read_chain_page`` (chained entries picked
    out without a per-entry Python object, or None for a page it cannot vouch for); any
    other page goes through ``read_raw``, which names a malformed entry.
    """
    fast = store.read_chain_page if isinstance(store, ServerEventStore) else None
    start = 1
    while True:
        page = None if fast is None else fast(run_id, start, PAGE)
        if page is None:
            page = [
                (e.position, e.event_type, e.event_id, e.data, e.chain)
                for e in store.read_raw(run_id, start, count=PAGE)
            ]
        yield from page
        if len(page) < PAGE:
            return
        start = page[-1][0] + 1
