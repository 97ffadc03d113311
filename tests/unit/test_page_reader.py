"""Pages read by forked children (controller/page_reader.py): the same pages as the
in-process read, errors reported as the in-process read reports them, children gone
when the fold stops early, and folds bitwise identical either way."""

from __future__ import annotations

import multiprocessing

import pytest

from controller.core.state import encode_state
from events.codec import encode
from events.memory_store import MemoryEventStore
from events.store import EncodedPage
from controller import page_reader
from controller.projector import Projector
from tests.unit.random_log import random_run

RUN = "sim-3"


@pytest.fixture(scope="module")
def store() -> MemoryEventStore:
    made = MemoryEventStore()
    for s in random_run(3, 60, window=2, groups_per_step=4).events:
        made.append_raw(RUN, encode(s.event), event_type=type(s.event).__name__)
    return made


def _fetch(store: MemoryEventStore, size: int):
    return lambda position: store.read_page(RUN, position, size)


def _in_process(store: MemoryEventStore, size: int, position: int):
    while True:
        page = store.read_page(RUN, position, size)
        if not page.data:
            return
        yield page
        if len(page.data) < size:
            return
        position = page.next_position


@pytest.mark.parametrize("readers", [1, 2, 3])
def test_children_read_the_pages_the_process_reads(store: MemoryEventStore, readers: int) -> None:
    fallback = lambda p: _in_process(store, 97, p)  # noqa: E731
    forked = list(page_reader.forked_pages(_fetch(store, 97), 5, 97, fallback, readers))
    assert forked == list(_in_process(store, 97, 5))
    assert sum(len(p.data) for p in forked) == store.last_position(RUN) - 4


def test_a_child_error_is_raised_by_the_in_process_read_from_that_page(store) -> None:
    def fetch(position: int) -> EncodedPage:
        if position >= 301:
            raise ValueError(f"cannot read {position}")
        return store.read_page(RUN, position, 100)

    def fallback(position: int):
        yield from ()
        fetch(position)

    pages = page_reader.forked_pages(fetch, 1, 100, fallback, 2)
    assert [p.first for p in (next(pages), next(pages), next(pages))] == [1, 101, 201]
    with pytest.raises(ValueError, match="cannot read 301"):
        next(pages)


def test_closing_early_stops_the_children(store: MemoryEventStore) -> None:
    pages = page_reader.forked_pages(_fetch(store, 10), 1, 10, lambda p: iter(()), 3)
    next(pages)
    pages.close()
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("rlc-page")]


def test_folds_are_identical_with_forked_readers(store, monkeypatch) -> None:
    in_process = Projector(store).get(RUN)
    monkeypatch.setattr(page_reader, "FORK_ABOVE_ENTRIES", 1)
    monkeypatch.setattr(page_reader, "reader_count", lambda: 2)
    forked = Projector(store).get(RUN)
    assert encode_state(forked.state) == encode_state(in_process.state)
    assert (forked.last_ts, forked.log_end) == (in_process.last_ts, in_process.log_end)
    stopped = Projector(store).get(RUN, stop_step=7)
    assert stopped.reached and stopped.state.trainer_version >= 1


def test_a_malformed_entry_is_named_with_forked_readers(monkeypatch) -> None:
    made = MemoryEventStore()
    events = random_run(4, 5).events
    for s in events:
        made.append_raw(RUN, encode(s.event), event_type=type(s.event).__name__)
    made.append_raw(RUN, b"{not json")
    expected = Projector(made).get(RUN).problem
    monkeypatch.setattr(page_reader, "FORK_ABOVE_ENTRIES", 1)
    assert Projector(made).get(RUN).problem == expected
    assert expected is not None and expected.position == len(events) + 1
