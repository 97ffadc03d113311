"""Parsing stream replies (events/redis_store/replies.py): the fast path of ``raw_entry``."""

from __future__ import annotations

import pytest

from events.errors import EventDecodeError
from events.redis_store.replies import raw_entry

FULL = {b"type": b"GroupFailed", b"id": b"group:g1:failed:a1", b"data": b'{"x":1}', b"h": b"ab" * 32}


@pytest.mark.parametrize(
    "fields",
    [
        FULL,
        {k: v for k, v in FULL.items() if k != b"h"},  # a log from before chains
        {b"data": b"{}"},
        {**FULL, b"type": b"\xff\xfe"},  # not UTF-8: replaced, as the general path does
        {**FULL, b"extra": b"1"},  # a field the store never writes: general path
        {"type": "GroupFailed", "id": "i", "data": "{}"},  # text fields: general path
    ],
    ids=["chained", "unchained", "data-only", "bad-utf8", "extra-field", "text"],
)
def test_bytes_id_fast_path_builds_what_the_general_path_builds(fields: dict) -> None:
    # A text id always takes the general path; a bytes id takes the fast one when it can.
    fast, general = raw_entry(b"0-42", fields), raw_entry("0-42", fields)
    assert fast == general
    assert fast.position == 42 and isinstance(fast.data, bytes)


@pytest.mark.parametrize("entry_id", [b"1-42", b"0-", b"0-4x", "0-\u00b2".encode(), b"42"])
def test_an_id_that_is_not_a_position_is_named(entry_id: bytes) -> None:
    with pytest.raises((EventDecodeError, ValueError)):
        raw_entry(entry_id, FULL)
