"""How long a lingering append of pauses waits (``PartialRecorder``): one linger for a
lone pause, ``record_linger_max`` lingers in all once another pause joined within the first.

The recorder runs as the controller runs it -- a real journal and writer over the
in-memory store, calls that pause by callback (``controller.pausing``) -- on the
simulator's virtual clock, so the times below are exact.
"""

from __future__ import annotations

import asyncio

import pytest

from controller.journal import Journal
from controller.partial import PartialRecorder
from controller.pausing import PausingCall
from controller.startup import create_run
from events import schema as ev
from events.memory_store import MemoryEventStore
from sim.clock import VirtualTimeLoop
from workers.generator.config import PartialSection
from workers.api import GenerationOutcome, GenerationRequest, Segment, SegmentFlush

LINGER_S = 1.0


class _TimedStore(MemoryEventStore):
    """The in-memory store, noting each append's loop time and its flushes."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        self.flushes: list[tuple[float, int]] = []

    def append(self, run_id, events, **kwargs):  # type: ignore[no-untyped-def]
        n = sum(type(e) is ev.SegmentsRecorded for e in events)
        if n:
            self.flushes.append((self.loop.time(), n))
        return super().append(run_id, events, **kwargs)


class _Busy:
    """A generator whose next call never returns (the group goes on generating)."""

    name = "gen"

    def generate(self, reqs: list[GenerationRequest]) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()


def _flushed(group: int) -> list[GenerationOutcome]:
    seg = Segment(sample=0, start=0, length=1, key=f"row{group}")
    return [GenerationOutcome(payload_keys=[], rewards=[], lengths=[], weight_version_start=0,
                              weight_version_end=0, status="flushed",
                              flush=SegmentFlush(kind="model", weight_version=0, segments=[seg]))]


def _appends(pause_at: list[float], in_flight: int = 100, siblings: int = 0,
             linger_max: int = PartialSection().record_linger_max) -> list[tuple[float, int]]:
    """(loop time, flushes) of each append when groups pause at ``pause_at`` (one group
    per call, 100 calls in flight: the linger never ends because nobody else can join)."""
    loop = VirtualTimeLoop()
    store = _TimedStore(loop)

    async def main() -> None:
        writer = create_run(store, "r", config={}, seed=0, code_version="test", window_versions=1,
                            groups_per_step=1, samples_per_group=1)
        journal = Journal(writer, clock=loop.time)
        await journal.append(*[journal.make(
            ev.RolloutAdmitted, event_id=ev.group_event_id(f"g{i}", "admitted", 1), group_id=f"g{i}",
            attempt=1, prompt_index=i, prompt_ref=f"prompt:{i}", weight_version=0, n_samples=1,
            sample_seed=i) for i in range(len(pause_at))])
        recorder = PartialRecorder(journal, None, linger_s=LINGER_S, in_flight=lambda: in_flight,
                                   siblings=siblings, linger_max=linger_max)
        for i, at in enumerate(pause_at):
            returned = loop.create_future()
            req = GenerationRequest(group_id=f"g{i}", attempt=1, prompt_index=i, n_samples=1, seed=i)
            PausingCall(_Busy(), [req], returned,  # type: ignore[arg-type]
                        lambda call, outs: recorder.hold(call, outs, []))
            loop.call_at(at, returned.set_result, _flushed(i))
        await asyncio.sleep(max(pause_at) + 10 * LINGER_S)
        await recorder.settle(1.0)

    with asyncio.Runner(loop_factory=lambda: loop) as runner:
        runner.run(main())
    return store.flushes


def test_a_lone_pause_waits_one_linger():
    assert _appends([10.0, 20.0]) == [(11.0, 1), (21.0, 1)]


def test_a_pause_that_joins_within_the_first_linger_extends_the_wait_to_linger_max():
    assert PartialSection().record_linger_max == 4
    # a fixed window from the first pause recorded these in two appends, at 1.0 (three
    # pauses) and 2.8 (two); now the joins within the first second make it wait four
    assert _appends([0.0, 0.5, 0.9, 1.8, 2.6]) == [(4.0, 5)]
    assert _appends([0.0, 0.5, 2.5]) == [(4.0, 3)]
    # ... and no longer: a pause after the wait ended starts the next append
    assert _appends([0.1 * i for i in range(10)] + [4.5]) == [(4.0, 10), (5.5, 1)]


def test_a_join_after_the_first_linger_is_the_next_append():
    # the first pause waited its one linger alone; the second starts an append of its own
    assert _appends([0.0, 1.5, 1.9]) == [(1.0, 1), (5.5, 2)]


def test_with_fewer_other_calls_in_flight_than_siblings_a_pause_is_appended_at_once():
    # 8 calls in flight, the pausing one among them: 7 others, fewer than 8
    assert _appends([10.0, 20.0], in_flight=8, siblings=8) == [(10.0, 1), (20.0, 1)]


def test_with_as_many_other_calls_as_siblings_the_linger_is_as_before():
    assert _appends([10.0, 20.0], in_flight=9, siblings=8) == [(11.0, 1), (21.0, 1)]
    assert _appends([0.0, 0.5, 2.5], in_flight=9, siblings=8) == [(4.0, 3)]


def test_record_linger_siblings_is_a_checked_config_key():
    assert PartialSection().record_linger_siblings == 8
    with pytest.raises(Exception, match="rollout.partial.record_linger_siblings"):
        PartialSection(record_linger_siblings=-1)


def test_record_linger_max_sets_how_many_lingers_a_joined_append_waits():
    pauses = [0.0, 0.5, 2.5, 5.0, 7.9]
    # one linger: a join does not extend the wait
    assert _appends(pauses, linger_max=1) == [(1.0, 2), (3.5, 1), (6.0, 1), (8.9, 1)]
    # eight: every pause of the first eight seconds shares one append
    assert _appends(pauses, linger_max=8) == [(8.0, 5)]
    # a lone pause waits one linger whatever the maximum
    assert _appends([10.0, 20.0], linger_max=8) == [(11.0, 1), (21.0, 1)]


def test_record_linger_max_is_a_checked_config_key():
    for bad in (0, -1):
        with pytest.raises(Exception, match="rollout.partial.record_linger_max"):
            PartialSection(record_linger_max=bad)
