"""``audit`` in one read: the pages the fold reads check their own hash-chain links.

Auditing used to read the whole log twice: once to fold it, once (in another process)
to walk the chain. Every XRANGE page already carries each entry's type, id and hash
next to its data, so the page readers (forked children for a long log,
``controller.page_reader``) now check the page's links while they are at it and hand the
fold the data with a :class:`~events.chain.LinkCheck`. A link is H(stored previous
hash || entry) == stored hash, so a page is checked from the stored hash of the entry
before it (read as one extra entry) and pages are checked apart, on as many cores as
there are readers; the first bad entry over all pages is the one a sequential walk
finds first.

Exactness over speed: this path only vouches for what it saw whole. Where a page
could not be read this way (an entry without a hash, a gap, a field of another shape),
the fold stopped early, or the log has no chain head, :func:`page_verdict` returns None
and the caller walks the chain as before (``replay.chain_audit.audit_chain``), which
names what is wrong exactly as it always did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from events.chain import Chain, ChainHead, LinkCheck, check_links, mismatch_reason
from events.errors import ChainError
from events.store import EncodedPage, EventStore, ServerEventStore


def checked_fetch(
    store: EventStore, run_id: str, chain: Chain, page_entries: int
) -> Callable[[int], EncodedPage] | None:
    """A page fetch (the projector's) whose pages carry their ``LinkCheck``; None
    when the store has no chained page read (the caller then walks the chain apart)."""
    if not isinstance(store, ServerEventStore):
        return None
    read = store.read_chain_page

    def fetch(position: int) -> EncodedPage:
        before = 1 if position > 1 else 0  # the entry before the page: its stored hash
        entries = read(run_id, position - before, page_entries + before)
        if entries is None or len(entries) <= before:  # not vouched for, or past the end:
            return store.read_page(run_id, position, page_entries)  # no check, the walk
        prev = entries[0][4] if before else chain.genesis
        page = entries[before:]
        return EncodedPage(position, [e[3] for e in page], None, check_links(chain, prev, page))

    return fetch


def page_verdict(
    chain: Chain, checks: Sequence[LinkCheck | None], head: ChainHead | None, log_end: int
) -> tuple[str, str, int | None, str] | None:
    """(status, head, position, reason) as ``events.chain.verify`` reports it, from the
    checks of pages that cover positions 1..``log_end`` in order; None when they do not
    (a page without a check, a fold that stopped early) or the run has no chain head."""
    if head is None or not checks or any(c is None for c in checks):
        return None
    pages = [LinkCheck(*c) for c in checks if c is not None]  # lists off the pipe
    expected = 1
    for check in pages:
        if check.first != expected:
            return None
        expected = check.last + 1
    last = expected - 1
    if last != log_end:
        return None
    for check in pages:
        if check.bad is not None:
            return "broken", check.before_bad, check.bad, mismatch_reason(chain, check.bad)
    final = pages[-1].head
    if head.position > last:
        return ("broken", final, last + 1, f"log ends at position {last} but the chain head "
                f"is at position {head.position} (tail truncated)")
    if head.position < last:
        return ("broken", final, head.position + 1, f"entries after the chain head (position "
                f"{head.position}) were appended outside the controller")
    if head.hash != final:
        return "broken", final, last, "the chain head in meta does not match the log"
    return "ok", final, None, ""


def snapshot_problem(store: EventStore, run_id: str) -> ChainError | None:
    """The snapshot's recorded link no longer in the log (``check_snapshot_link``)."""
    try:
        store.load_snapshot(run_id)
    except ChainError as err:
        return err
    return None
