"""The compact wire form: value structs leave their default-valued fields out.

``Segment``, ``EnvCall``, ``EnvResult`` and ``SegmentFlush`` are written without the
fields that hold their default (``docs/segments.md``, "Fields that may be left out").
Every log before that wrote every field; both forms must decode to the same values,
an old log's chain and fold must still verify when the current code continues it, and
a snapshot written with every field must still load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from controller.config import load_config
from controller.core.state import decode_state, encode_state
from controller.projector import Projector
from events import codec
from events.chain import Chain
from events.memory_store import MemoryEventStore
from events.redis_store import RedisEventStore
from events.redis_store.layout import APPEND, events_key, meta_key
from events.redis_store.connection import run_script
from events.schema import EnvCall, EnvResult, Segment, SegmentFlush
from replay.chain_audit import audit_log
from sim.harness import SimSpec, simulate
from sim.timings import Lognormal, SyntheticTimings
from tests.unit.test_event_codec import COMPACT_TYPES, GOLDEN, _load

COMPACT = Path(__file__).resolve().parents[1] / "fixtures" / "golden_compact.jsonl"


def _compact() -> dict[str, bytes]:
    lines = [line for line in COMPACT.read_bytes().splitlines() if line.strip()]
    return {msgspec.json.decode(line)["type"]: line for line in lines}


def test_the_compact_fixture_holds_exactly_the_types_written_shorter() -> None:
    assert sorted(_compact()) == sorted(COMPACT_TYPES)
    for name, event in GOLDEN.items():
        full = msgspec.json.encode(codec.full_form(event))
        assert (codec.encode(event) != full) == (name in COMPACT_TYPES), name


@pytest.mark.parametrize("type_name", COMPACT_TYPES)
def test_compact_bytes_decode_and_reencode_identically(type_name: str) -> None:
    line = _compact()[type_name]
    event = codec.decode(line, position=5)
    assert event == GOLDEN[type_name] == codec.decode(_load()[type_name], position=5)
    assert codec.encode(event) == line
    assert len(line) < len(_load()[type_name])


def _left_out(full: Any, compact: Any, where: str = "") -> list[str]:
    """Paths of the keys ``full`` has and ``compact`` lacks (the two must agree elsewhere)."""
    if isinstance(full, dict):
        out = []
        for key, value in full.items():
            if key in compact:
                out += _left_out(value, compact[key], f"{where}.{key}")
            else:
                out.append(f"{where}.{key}={msgspec.json.encode(value).decode()}")
        assert set(compact) <= set(full), where
        return out
    if isinstance(full, list):
        assert len(full) == len(compact), where
        return [p for i, (f, c) in enumerate(zip(full, compact)) for p in _left_out(f, c, f"{where}[{i}]")]
    assert full == compact, where
    return []


def test_only_default_valued_fields_of_values_are_left_out() -> None:
    # the episode pause: every kind of omission, and nothing of the event's own fields
    # (``schema_version`` must stay: a missing one would read as the current version)
    full = msgspec.json.decode(_load()["EpisodeTurnsRecorded"])
    compact = msgspec.json.decode(_compact()["EpisodeTurnsRecorded"])
    assert _left_out(full, compact) == [
        '.results[0].ended=false', '.results[0].end_reason=""', '.results[0].restart=0',
        '.flushes[0].weight_version=null', '.flushes[0].segments[0].stopped=false',
        '.flushes[1].kind="model"', '.calls[0].restart=0',
    ]
    assert compact["schema_version"] == 1


def test_a_value_with_nothing_at_its_default_is_written_whole() -> None:
    # the compact form loses nothing: what differs from a default is always written
    result = EnvResult(sample=1, turn=2, reward=0.0, ended=True, end_reason="done",
                       observation_tokens=3, info={"a": 1}, restart=2)
    raw = msgspec.json.decode(msgspec.json.encode(result))
    assert set(raw) == set(EnvResult.__struct_fields__)
    assert msgspec.json.decode(msgspec.json.encode(result), type=EnvResult) == result
    for value in (Segment(sample=0, start=0, length=1, key="k", turn=1, stopped=True),
                  EnvCall(sample=0, turn=1, request="r", restart=1),
                  SegmentFlush(kind="observation", weight_version=3, segments=[])):
        assert set(msgspec.json.decode(msgspec.json.encode(value))) == set(type(value).__struct_fields__)


# -- an old log (every field written) continued by this code ------------------------


def _episode_run() -> MemoryEventStore:
    cfg = load_config(None, [
        "run.steps=3", "rollout.num_generators=4", "train.groups_per_step=4",
        "train.groups_per_microbatch=2", "rollout.partial.enabled=true",
        "rollout.samples_per_group=2", "rollout.partial.record_linger_s=0"])
    timings = SyntheticTimings(generation=Lognormal(20.0, 0.8), train_per_sequence_s=0.05,
                               finish=1.0, publish=2.0, checkpoint=5.0, seed=5)
    store = MemoryEventStore()
    simulate(store, SimSpec(config=cfg, timings=timings, run_id="ep", episode_turns=3))
    return store


def _write_as_before(store: RedisEventStore, run_id: str, events: list[Any]) -> None:
    """Append ``events`` as the code before the compact form did: every field written,
    chained, through the same append script (one batch)."""
    epoch = store.claim_epoch(run_id)
    entries = [(type(e).__name__, e.event_id, msgspec.json.encode(codec.full_form(e)))
               for e in events]
    hashes = Chain(run_id).links(Chain(run_id).genesis, 1, entries)
    args: list[Any] = [epoch, 0, len(events), "", "sha256"]
    for entry, link in zip(entries, hashes):
        args += (*entry, link)
    run_script(store.client, APPEND, (events_key(run_id), meta_key(run_id)), args)


def _longer_in_full(state: Any) -> bool:
    return len(msgspec.msgpack.encode(codec.full_form(state))) > len(encode_state(state))


def test_an_old_log_continued_by_this_code_audits_and_folds_the_same(redis_url: str) -> None:
    memory = _episode_run()
    events = [stored.event for stored in memory.read("ep")]
    assert any(type(e).__name__ == "EpisodeTurnsRecorded" for e in events)
    # split where the state holds in-flight episode values, so the old snapshot there
    # really has default-valued fields written
    half, want = next((p, st) for p in range(len(events) // 2, len(events))
                      if _longer_in_full(st := Projector(memory).get("ep", until=p).state))
    store = RedisEventStore(redis_url)
    try:
        store.delete_run("ep") if store.run_exists("ep") else None
        _write_as_before(store, "ep", events[:half])
        old = [raw.data for raw in store.read_raw("ep")]
        assert all(b'"restart":0' in d for d in old if b"EpisodeTurnsRecorded" in d[:40])
        # this code goes on with the run: compact entries, chained after the old ones
        rest = events[half:]
        store.append("ep", rest, expected_position=half, epoch=1)
        new = [raw.data for raw in store.read_raw("ep", half + 1)]
        assert not any(b'"restart":0' in d for d in new)
        result, chain = audit_log(store, "ep", None)
        assert chain.status == "ok", chain.describe()
        assert [s.event for s in store.read("ep")] == events
        # a snapshot the code before wrote (every field of every value) still loads
        before = msgspec.msgpack.encode(codec.full_form(want))
        assert encode_state(decode_state(before)) == encode_state(want)
        assert store.save_snapshot("ep", half, before)
        resumed = Projector(store).get("ep")
        assert resumed.problem is None and result.problem is None
        assert encode_state(resumed.state) == encode_state(result.state)
    finally:
        store.close()
