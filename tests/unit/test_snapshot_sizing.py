"""When the controller saves a snapshot: every ``snapshot_every`` events while the state
is small, then spaced by the last snapshot's size (``snapshot_events_per_mib``), so the
snapshots' cost per event is bounded and recovery's tail is bounded by the snapshot."""

from __future__ import annotations

from controller.log_writer import LogWriter
from controller.startup import create_run
from events import schema as ev
from events.memory_store import MemoryEventStore

RUN = "snap-run"


def _writer(every: int, per_mib: int) -> tuple[MemoryEventStore, LogWriter]:
    store = MemoryEventStore()
    writer = create_run(store, RUN, config={}, seed=0, code_version="test", window_versions=1,
                        groups_per_step=2, samples_per_group=2)
    writer.snapshot_every, writer.snapshot_events_per_mib = every, per_mib
    return store, writer


def _admit(writer: LogWriter, i: int) -> None:
    gid = f"g{i:05d}"
    writer.append(writer.make(
        ev.RolloutAdmitted, event_id=ev.group_event_id(gid, "admitted", 1), group_id=gid,
        attempt=1, prompt_index=i, prompt_ref=f"p{i}", weight_version=0, n_samples=2,
        sample_seed=i))


def _snapshots(store: MemoryEventStore, writer: LogWriter, events: int) -> list[tuple[int, int]]:
    """(position, size in bytes) of each snapshot saved while appending ``events``."""
    seen: list[tuple[int, int]] = []
    for i in range(events):
        _admit(writer, i)
        snap = store.load_snapshot(RUN)
        if snap is not None and (not seen or snap[0] != seen[-1][0]):
            seen.append((snap[0], len(snap[1])))
    return seen


def test_a_fixed_interval_without_sizing() -> None:
    store, writer = _writer(every=10, per_mib=0)
    positions = [p for p, _ in _snapshots(store, writer, 45)]
    assert positions == [10, 20, 30, 40]  # counted from the empty log


def test_snapshots_are_spaced_by_the_size_of_the_last_one() -> None:
    # 2**20 / 512 events per MiB: one event per 512 bytes of the last snapshot
    store, writer = _writer(every=10, per_mib=2**20 // 512)
    saved = _snapshots(store, writer, 600)
    assert saved[0][0] == 10  # nothing saved yet: the fixed interval
    for (before, size), (after, _) in zip(saved, saved[1:]):
        assert after - before == max(10, -(-size // 512))  # the first append reaching both
    # the state grows with each group, so the spacing does too (the sizing is exercised)
    gaps = [b - a for (a, _), (b, _) in zip(saved, saved[1:])]
    assert len(gaps) >= 4 and gaps[-1] > 10 * gaps[0]
