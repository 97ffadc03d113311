"""Parsing what Redis sends back for log reads (pure: no ``redis`` import).

``events.redis_store`` sends the commands; this module turns stream replies into
``RawEntry`` values and bulk pages into ``EncodedPage`` values, with the checks that
let a fast read trust a page: stream ids ``0-N`` at consecutive positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

import msgspec

from events.chain import HASH_FIELD
from events.errors import StoreDataError, StreamIdError
from events.store import ChainEntry, EncodedPage, RawEntry

_entry_fields = itemgetter(1)
_field_4 = itemgetter(4)
_field_5 = itemgetter(5)
_unpack_page = msgspec.msgpack.Decoder(list[str]).decode

_HASH = HASH_FIELD.encode()
#: the stream fields the store writes (``raw_entry``'s fast path takes only these)
_OWN_FIELDS = frozenset((b"type", b"id", b"data", _HASH))

#: (first entry id, last entry id, data fields) of one bulk read; data None: not trusted
PageReply = tuple[Any, Any, "list[Any] | None"]


def raw_entry(entry_id: bytes | str, fields: dict[Any, Any]) -> RawEntry:
    """One XRANGE/XREAD entry (fields as a dict) as a RawEntry."""
    # Fast path (audit's chain walk reads every entry through here): an id ``0-N`` in
    # ASCII digits and only the store's own bytes field names, as redis-py hands them
    # over. It builds exactly what the general path below builds.
    if (
        type(entry_id) is bytes
        and entry_id[:2] == b"0-"
        and entry_id[2:].isdigit()
        and fields.keys() <= _OWN_FIELDS
    ):
        get = fields.get
        t, i, d, h = get(b"type", b""), get(b"id", b""), get(b"data", b""), get(_HASH, b"")
        if type(t) is bytes and type(i) is bytes and type(d) is bytes and type(h) is bytes:
            return RawEntry(
                int(entry_id[2:]), d, t.decode(errors="replace"), i.decode(errors="replace"),
                h.decode(errors="replace"),
            )
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    if ms != "0" or not seq.isdigit():
        raise StreamIdError(None, f"stream entry id {text!r} is not a log position (0-N)")
    fields = {as_text(k): v for k, v in fields.items()}
    data = fields.get("data", b"")
    return RawEntry(
        position=int(seq),
        event_type=as_text(fields.get("type", b"")),
        event_id=as_text(fields.get("id", b"")),
        data=data.encode() if isinstance(data, str) else bytes(data),
        chain=as_text(fields.get(HASH_FIELD, b"")),
    )


def raw_entries(batch: Sequence[Any], before: int) -> list[RawEntry]:
    """An XRANGE reply as RawEntry values; ``before``: the position of the entry the
    reply follows. An entry whose stream id is not ``0-N`` (added by hand) is named by
    its id and the position it stands at: the one after the entry before it."""
    out: list[RawEntry] = []
    for entry_id, fields in batch:
        try:
            out.append(raw_entry(entry_id, fields))
        except StreamIdError as err:
            raise StreamIdError(out[-1].position + 1 if out else before + 1, err.reason) from None
    return out


def stored_int(value: bytes | str | int, key: str, field: str) -> int:
    """A whole number the store wrote into a hash field (epoch, chain length, snapshot
    position); one line naming the key and field when something else is there."""
    try:
        return int(value)
    except (TypeError, ValueError):
        raise StoreDataError(
            f"{key} field {field!r} holds {as_text(value)!r}, not a whole number: "  # type: ignore[arg-type]
            "it was changed outside rl-controller"
        ) from None


def as_text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def xrange_page(batch: Sequence[Any] | None) -> PageReply:
    """A raw XRANGE reply (as the compiled RESP parser returns it, no per-entry dicts).

    The data fields are picked out with C-level ``map``/``itemgetter`` passes when every
    entry has the store's own field order (type, id, data), with no Python per entry.
    """
    if not batch:
        return b"", b"", []
    fields = list(map(_entry_fields, batch))
    shape = set(map(len, fields))
    if (shape == {6} or shape == {8}) and list(map(_field_4, fields)).count(b"data") == len(fields):
        data = list(map(_field_5, fields))
    else:
        data = [_data_field(f) for f in fields]
    return batch[0][0], batch[-1][0], data


_f0, _f1, _f2, _f3, _f6, _f7 = (itemgetter(i) for i in (0, 1, 2, 3, 6, 7))
_isascii = bytes.isascii


def xrange_chain_page(batch: Sequence[Any] | None, start: int) -> list[ChainEntry] | None:
    """A raw XRANGE reply of chained entries as ``verify``'s tuples, picked out in C.

    Only when every entry has the store's own chained shape (type, id, data, h) and the
    ids are exactly ``0-start`` .. ``0-(start + n - 1)``; None otherwise (the caller
    then reads the page through ``read_raw``, which names what is wrong).
    """
    if not batch:
        return []
    fields = list(map(_entry_fields, batch))
    n = len(fields)
    if set(map(len, fields)) != {8} or not (
        list(map(_f0, fields)).count(b"type") == n
        and list(map(_f2, fields)).count(b"id") == n
        and list(map(_field_4, fields)).count(b"data") == n
        and list(map(_f6, fields)).count(_HASH) == n
    ):
        return None
    if _seq(batch[0][0]) != start or _seq(batch[-1][0]) != start + n - 1:
        return None
    types, ids, hashes = list(map(_f1, fields)), list(map(_f3, fields)), list(map(_f7, fields))
    # ASCII type, id and hash: the bytes are exactly what read_raw's text re-encodes to,
    # so every link is checked as through read_raw (anything else goes that way).
    if not all(map(_isascii, chain(types, ids, hashes))):
        return None
    return list(zip(
        range(start, start + n), types, ids, map(_field_5, fields), map(bytes.decode, hashes)
    ))


def scripted_page(reply: Sequence[Any]) -> PageReply:
    """The reply of ``layout.PAGE``: ids plus ONE msgpack string of data fields."""
    first, last, packed = reply
    try:
        return first, last, _unpack_page(packed) if packed else []
    except (msgspec.DecodeError, UnicodeDecodeError):  # not UTF-8: read_raw hands it over
        return first, last, None


def trusted_page(reply: PageReply, start: int) -> EncodedPage | None:
    """The page when it holds exactly the ids ``0-start`` .. ``0-(start + n - 1)``."""
    first, last, data = reply
    if data is None:
        return None
    if not data:
        return EncodedPage(start, [])
    lo, hi = _seq(first), _seq(last)
    # Stream ids increase strictly, so first 0-lo, last 0-hi and hi - lo + 1 entries
    # mean exactly the ids 0-lo .. 0-hi.
    if lo != start or hi - lo + 1 != len(data):
        return None
    return EncodedPage(start, data)


def _data_field(fields: list[bytes]) -> bytes:
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == b"data":
            return fields[i + 1]
    return b""


def _seq(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(seq) if ms == "0" and seq.isdigit() else -1
