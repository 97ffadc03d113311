"""The hash chain over a run's log: what makes an edit with a raw client visible.

Every entry carries ``h_n = H(h_{n-1} || entry_n)`` in a stream field of its own (``h``,
next to ``type``, ``id`` and ``data``), so the JSON in ``data`` stays what any client
reads. ``entry_n`` is the entry's position, type, id and data, length-prefixed so no
two different entries frame to the same bytes. ``h_0`` is derived from the run id, so
a chain cannot be moved to another run.

``H`` is HMAC-SHA256 under a key that only the controller (and the auditor) hold when
``store.chain_key_file`` is set: a writer with a raw client then cannot forge a
consistent chain. Without a key it is plain SHA-256: any edit still breaks the chain
unless the editor recomputes every later hash (and the head), which the head hash
printed by ``audit`` and pinned elsewhere (a paper, a ticket) exposes.

The run's ``meta`` keeps the head (``chain_head``: hash of the newest entry, and
``chain_len``: its position); the append script accepts a batch only if the writer's
previous hash is that head, atomically with the epoch and position checks. The head
is how a truncated tail shows: the log ends before ``chain_len``.

Old logs: the ``h`` field is the chain's version marker. A log whose entries have no
``h`` (written before chains) reads as before; ``audit`` reports "chain absent", and a
controller resuming such a run goes on without a chain (a chain starting mid-log would
vouch for nothing before it). Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from events.errors import ChainError

#: stream field holding an entry's chain hash (hex)
HASH_FIELD = "h"
#: meta fields: hash and position of the newest chained entry
HEAD_FIELD = "chain_head"
LEN_FIELD = "chain_len"
#: snapshot field: the chain hash of the entry at the snapshot's position
SNAPSHOT_FIELD = "chain"

_GENESIS_TAG = b"rlc-chain-v1\0"
_FRAME = struct.Struct(">QII")
_sha256 = hashlib.sha256


#: ``chain_alg`` values in meta (a hint for the auditor; a key given to audit always wins)
SHA256 = "sha256"
HMAC_SHA256 = "hmac-sha256"


class ChainHead(NamedTuple):
    """What the run's meta says about the chain."""

    hash: str
    #: position of the newest chained entry
    position: int
    #: SHA256 or HMAC_SHA256 ("" if unknown)
    algorithm: str


class ChainKeyError(ValueError):
    """The chain key file is missing, unreadable or empty."""


def load_key(path: str | Path, name: str = "store.chain_key_file") -> bytes:
    """The HMAC key in ``path`` (its bytes, surrounding whitespace stripped); errors name
    the setting or flag ``name`` that gave the path."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as err:
        raise ChainKeyError(f"{name} {str(path)!r}: {err.strerror}") from None
    if len(key) < 16:
        raise ChainKeyError(f"{name} {str(path)!r}: key has {len(key)} bytes; need at least 16")
    return key


class Chain:
    """H for one run: plain SHA-256, or HMAC-SHA256 with ``key``."""

    def __init__(self, run_id: str, key: bytes | None = None) -> None:
        self.key = key
        self.genesis = self._digest(_GENESIS_TAG + run_id.encode())

    @property
    def keyed(self) -> bool:
        return self.key is not None

    @property
    def algorithm(self) -> str:
        return SHA256 if self.key is None else HMAC_SHA256

    def _digest(self, message: bytes) -> str:
        return self.raw_digest(message).hex()

    def raw_digest(self, message: bytes) -> bytes:
        """H(message) as bytes (``_digest`` is its hex)."""
        if self.key is None:
            return _sha256(message).digest()
        return hmac.digest(self.key, message, "sha256")

    def link(
        self, prev: str, position: int, event_type: str | bytes, event_id: str | bytes,
        data: bytes,
    ) -> str:
        """h_n for the entry at ``position`` after ``prev`` = h_{n-1} (hex)."""
        t = event_type if isinstance(event_type, bytes) else event_type.encode()
        i = event_id if isinstance(event_id, bytes) else event_id.encode()
        frame = _FRAME.pack(position, len(t), len(i))
        return self._digest(bytes.fromhex(prev) + frame + t + i + data)

    def links(
        self, prev: str, first: int, entries: Iterable[tuple[str, str, bytes]]
    ) -> list[str]:
        """Hashes of consecutive (type, id, data) entries starting at position ``first``.

        As ``link`` entry by entry, but the previous link is carried as bytes (no hex
        round trip per entry): every event the controller appends passes here."""
        out = []
        prev_raw, digest, frame = bytes.fromhex(prev), self.raw_digest, _FRAME.pack
        for position, (event_type, event_id, data) in enumerate(entries, start=first):
            prev_raw = _link_raw(digest, frame, prev_raw, position, event_type, event_id, data)
            out.append(prev_raw.hex())
        return out


@dataclass(frozen=True)
class ChainReport:
    """Outcome of :func:`verify`."""

    #: "ok", "absent" (no entry has a hash: written before chains) or "broken"
    status: str
    #: hash of the last verified entry ("" when none)
    head: str = ""
    #: first bad position and why (status "broken" only)
    position: int | None = None
    reason: str = ""


def verify(
    chain: Chain,
    entries: Iterable[tuple[int, str | bytes, str | bytes, bytes, str]],
    *,
    stored_head: str | None,
    stored_len: int | None,
) -> ChainReport:
    """Check (position, type, id, data, hash) entries from position 1 against ``chain``.

    ``stored_head``/``stored_len`` are the meta head (None when the run has none). The
    first entry decides: no hash there and no stored head means a log from before
    chains ("absent"); anything else must chain from the genesis hash to the head.
    """
    prev = chain.genesis
    # The previous link as bytes: each link is checked as H(prev || frame) == stored, as
    # ``Chain.link`` computes it, without a hex round trip per entry (audit walks 10^7).
    prev_raw, digest, frame = bytes.fromhex(prev), chain.raw_digest, _FRAME.pack
    expected = 1
    absent = False
    for position, event_type, event_id, data, stored in entries:
        if position != expected:
            return ChainReport("broken", prev, expected, "entry missing (deleted from the log)")
        expected += 1
        if position == 1 and not stored and stored_head is None:
            absent = True
        if absent:
            if stored:
                return ChainReport("broken", "", position, "chain hash in a log without a chain")
            continue
        if not stored:
            return ChainReport("broken", prev, position, "entry has no chain hash")
        raw = _link_raw(digest, frame, prev_raw, position, event_type, event_id, data)
        if not hmac.compare_digest(raw.hex(), stored):
            return ChainReport("broken", prev, position, mismatch_reason(chain, position))
        prev, prev_raw = stored, raw
    if absent:
        return ChainReport("absent")
    last = expected - 1
    if stored_head is None:
        if last == 0:
            return ChainReport("absent")
        return ChainReport("broken", prev, last, "the run's chain head is missing from meta")
    if stored_len is not None and stored_len > last:
        return ChainReport(
            "broken", prev, last + 1,
            f"log ends at position {last} but the chain head is at position {stored_len} "
            "(tail truncated)",
        )
    if stored_len is not None and stored_len < last:
        return ChainReport(
            "broken", prev, stored_len + 1,
            f"entries after the chain head (position {stored_len}) were appended outside "
            "the controller",
        )
    if not hmac.compare_digest(stored_head, prev):
        return ChainReport("broken", prev, last, "the chain head in meta does not match the log")
    return ChainReport("ok", prev)


def _link_raw(
    digest: Callable[[bytes], bytes], frame: Callable[..., bytes], prev_raw: bytes,
    position: int, event_type: str | bytes, event_id: str | bytes, data: bytes,
) -> bytes:
    t = event_type if isinstance(event_type, bytes) else event_type.encode()
    i = event_id if isinstance(event_id, bytes) else event_id.encode()
    return digest(prev_raw + frame(position, len(t), len(i)) + t + i + data)


class LinkCheck(NamedTuple):
    """What :func:`check_links` found on a run of consecutive chained entries."""

    first: int
    last: int
    #: the stored hash of the last entry
    head: str
    #: the first entry whose link does not hold (None: every link holds) ...
    bad: int | None = None
    #: ... and the hash before it (what ``verify`` reports as its head there)
    before_bad: str = ""


def check_links(
    chain: Chain, prev: str, entries: Sequence[tuple[int, str | bytes, str | bytes, bytes, str]]
) -> LinkCheck:
    """Check the links of consecutive, chained (position, type, id, data, hash) entries
    (non-empty, every hash present) after ``prev``, the stored hash of the entry before
    the first (the genesis hash before position 1).

    Each link is H(stored previous hash || entry) == stored hash, exactly as ``verify``
    checks it; so the pages of a log can be checked apart (each from the stored hash
    before it) and the first bad entry over all of them is ``verify``'s.
    """
    first, last, head = entries[0][0], entries[-1][0], entries[-1][4]
    try:
        prev_raw = bytes.fromhex(prev)
    except ValueError:  # not a hash: the entry before is bad, and is found there first
        return LinkCheck(first, last, head, first, prev)
    digest, frame = chain.raw_digest, _FRAME.pack
    for position, event_type, event_id, data, stored in entries:
        raw = _link_raw(digest, frame, prev_raw, position, event_type, event_id, data)
        if not hmac.compare_digest(raw.hex(), stored):
            return LinkCheck(first, last, head, position, prev)
        prev, prev_raw = stored, raw
    return LinkCheck(first, last, head)


def mismatch_reason(chain: Chain, position: int) -> str:
    """Why the entry at ``position`` breaks the chain (its link does not hold)."""
    how = "HMAC with the chain key" if chain.keyed else "SHA-256"
    return (
        f"chain hash mismatch ({how}): entry {position} was altered, moved or forged"
    )


class ChainWriter:
    """The single writer's side: hashes for a batch, from a cached head per run.

    The controller appends after the position it last wrote, so the head it needs is
    the one it computed last; only the first append of a process (or one after an
    error) asks ``lookup`` for the hash stored at ``expected_position`` ("" when that
    entry has none: a log from before chains, which stays unchained).
    """

    def __init__(self, key: bytes | None = None) -> None:
        self.key = key
        self._chains: dict[str, Chain] = {}
        self._heads: dict[str, tuple[int, str]] = {}

    @property
    def algorithm(self) -> str:
        return SHA256 if self.key is None else HMAC_SHA256

    def chain(self, run_id: str) -> Chain:
        chain = self._chains.get(run_id)
        if chain is None:
            chain = self._chains[run_id] = Chain(run_id, self.key)
        return chain

    def batch(
        self,
        run_id: str,
        expected_position: int,
        entries: list[tuple[str, str, bytes]],
        lookup: Callable[[int], str],
    ) -> tuple[str, list[str]]:
        """(previous hash as stored, the batch's hashes); ("", ["", ...]) when unchained."""
        cached = self._heads.get(run_id)
        if cached is not None and cached[0] == expected_position:
            prev = cached[1]
        elif expected_position == 0:
            prev = ""
        else:
            prev = lookup(expected_position)
            if not prev:
                return "", [""] * len(entries)
        chain = self.chain(run_id)
        hashes = chain.links(prev or chain.genesis, expected_position + 1, entries)
        return prev, hashes

    def appended(self, run_id: str, last_position: int, head: str) -> None:
        """Record the head after a successful append (or a recognised replay)."""
        if head:
            self._heads[run_id] = (last_position, head)

    def forget(self, run_id: str) -> None:
        self._heads.pop(run_id, None)


#: why an append whose previous hash is not the stored head is refused
CHAIN_REFUSED = (
    "append refused: the previous hash is not the stored chain head "
    "(the log or its head was changed outside the controller)"
)


def check_snapshot_link(
    run_id: str, position: int, link: str, hash_at: Callable[[int], str]
) -> None:
    """The entry at a snapshot's position must still carry the hash the snapshot recorded."""
    found = hash_at(position)
    if found != link:
        raise ChainError(
            run_id, position,
            f"the snapshot there recorded chain hash {link[:16]}..., the entry now carries "
            f"{(found or 'none')[:16]}...: the log was altered after the snapshot",
        )
