"""Which appends wake the pumps (controller/journal.py): a pause's records change
nothing a pump waits on and do not wake them; a batch with anything else does."""

from __future__ import annotations

import asyncio

from controller.journal import Journal
from controller.startup import create_run
from events import schema as ev
from events.memory_store import MemoryEventStore
from events.values import EnvCall, EnvResult, Segment


def _completed(journal: Journal, index: int, sample: int) -> ev.EnvStepsCompleted:
    return journal.make(
        ev.EnvStepsCompleted, event_id=ev.env_steps_event_id("g1", "completed", 1, index),
        group_id="g1", attempt=1, index=index,
        results=[EnvResult(sample=sample, turn=1, reward=0.5, ended=True, end_reason="done")])


def test_a_pause_does_not_wake_the_pumps_and_a_commit_riding_with_it_does() -> None:
    writer = create_run(MemoryEventStore(), "r", config={}, seed=0, code_version="t",
                        window_versions=1, groups_per_step=1, samples_per_group=2)
    journal = Journal(writer)
    woken: list[bool] = []

    async def append(*events: ev.Event) -> None:
        journal._wake.clear()  # what a pump does before it waits
        await journal.append(*events)
        woken.append(journal._wake.is_set())

    async def main() -> None:
        await append(journal.make(
            ev.RolloutAdmitted, event_id=ev.group_event_id("g1", "admitted", 1), group_id="g1",
            attempt=1, prompt_index=0, prompt_ref="p:0", weight_version=0, n_samples=2,
            sample_seed=1))
        await append(journal.make(
            ev.SegmentsRecorded, event_id=ev.segments_event_id("g1", 1, 0), group_id="g1",
            attempt=1, index=0, kind="model", weight_version=0, segments=[
                Segment(sample=i, start=0, length=4, key=f"seg:{i}", turn=1, stopped=True)
                for i in (0, 1)]), journal.make(
            ev.EnvStepsRequested, event_id=ev.env_steps_event_id("g1", "requested", 1, 0),
            group_id="g1", attempt=1, index=0, env="e", dedupes_by_key=True,
            calls=[EnvCall(sample=i, turn=1, request=f"q{i}") for i in (0, 1)]))
        await append(_completed(journal, 1, 0))
        await append(_completed(journal, 2, 1), journal.make(
            ev.GroupCommitted, event_id=ev.group_event_id("g1", "committed", 1), group_id="g1",
            attempt=1, weight_version_start=0, weight_version_end=0, payload_keys=["k0", "k1"],
            rewards=[0.5, 0.5], lengths=[4, 4]))

    asyncio.run(main())
    assert woken == [True, False, False, True]
    assert writer.state.groups["g1"].committed_position == writer.position
