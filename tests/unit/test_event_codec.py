"""Golden bytes: every event type as written by schema version 1 must decode forever.

``tests/fixtures/golden_events.jsonl`` holds one line per event type, every field
populated. The file is written once and then only read: a schema change that breaks
old logs fails here. To add a fixture for a *new* type, add its value to ``GOLDEN`` and
run ``python -m tests.unit.test_event_codec --regenerate`` deliberately (it only
appends types missing from the file; existing lines are never rewritten).

When a type gains an optional field, its golden line is superseded by one that sets the
field, and the old line moves, byte for byte, to ``tests/fixtures/golden_history.jsonl``.
That file is only appended to: every line in it must still decode, to the current
golden value with the fields it lacks at their defaults.

The lines here have every field written (``codec.full_form``), as every log before the
compact form did. Where this code writes fewer bytes (a value struct's default-valued
fields left out), ``tests/fixtures/golden_compact.jsonl`` holds the bytes it writes
(``tests/unit/test_compact_events.py``); ``--regenerate`` appends to both.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

from events import codec
from events.errors import EventDecodeError
from events.schema import (
    EVENT_TYPES,
    CheckpointRejected,
    CheckpointSaved,
    ControllerStarted,
    EnvCall,
    EnvResult,
    EnvStepsCompleted,
    EnvStepsRequested,
    EpisodeTurnsRecorded,
    EpisodesRestarted,
    Event,
    GroupCommitted,
    GroupEvicted,
    GroupFailed,
    MicrobatchTrained,
    PayloadsReleased,
    RolloutAdmitted,
    RunFinished,
    RunRewound,
    RunStarted,
    RunStopped,
    Segment,
    SegmentFlush,
    SegmentsDropped,
    SegmentsRecorded,
    StepAborted,
    StepBegun,
    StepFinished,
    WeightsPublished,
    WorkerLost,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "golden_events.jsonl"

#: the types whose golden value has a default-valued field in a value struct: this code
#: writes them shorter than their golden line (``golden_compact.jsonl``)
COMPACT_TYPES = ("EnvStepsCompleted", "EnvStepsRequested", "EpisodeTurnsRecorded", "SegmentsRecorded")

_TS = 1_717_171_717.125

#: The value each golden line must decode to (every field set, none left at a default).
GOLDEN: dict[str, Event] = {
    "RunStarted": RunStarted(
        event_id="run:r-golden:started", epoch=1, ts=_TS, schema_version=1,
        run_id="r-golden", config={"model": "tiny", "lr": 1e-05, "window_versions": 2, "tags": ["a", "b"]},
        seed=1234, code_version="0.1.0+g1a2b3c", window_versions=2, groups_per_step=8, samples_per_group=4,
    ),
    "ControllerStarted": ControllerStarted(
        event_id="controller:1:started", epoch=1, ts=_TS + 1, schema_version=1, host="node-7", pid=31337,
    ),
    "RolloutAdmitted": RolloutAdmitted(
        event_id="group:g0042:admitted:a2", epoch=1, ts=_TS + 2, schema_version=1, group_id="g0042",
        attempt=2, prompt_index=42, prompt_ref="gsm8k/train.jsonl#42", weight_version=3, n_samples=4,
        sample_seed=987654321, generator="generator-1",
    ),
    "GroupCommitted": GroupCommitted(
        event_id="group:g0042:committed:a2", epoch=1, ts=_TS + 3, schema_version=1, group_id="g0042",
        attempt=2, weight_version_start=3, weight_version_end=4,
        payload_keys=["g0042/a2/0", "g0042/a2/1", "g0042/a2/2", "g0042/a2/3"],
        rewards=[1.0, 0.0, 0.5, -0.25], lengths=[17, 128, 64, 1],
        version_runs=[[3, 17], [3, 100, 4, 28], [3, 60, 4, 4], [4, 1]],
    ),
    "SegmentsRecorded": SegmentsRecorded(
        event_id="group:g0042:segments:a2:k1", epoch=1, ts=_TS + 16.5, schema_version=1,
        group_id="g0042", attempt=2, index=1, kind="model", weight_version=4,
        segments=[
            Segment(sample=0, start=64, length=64, key="r/g0042/a2/s0/k1", turn=3, stopped=False),
            Segment(sample=3, start=17, length=1, key="r/g0042/a2/s3/k1", turn=3, stopped=True),
        ],
    ),
    "SegmentsDropped": SegmentsDropped(
        event_id="group:g0042:segments-dropped:a3", epoch=2, ts=_TS + 16.75, schema_version=1,
        group_id="g0042", attempt=3, keys=["r/g0042/a2/s3/k1"],
        reason="1 recorded segment row(s) gone from the data plane, first r/g0042/a2/s3/k1; "
               "those samples restart from the prompt (MissingPayloadError: partition 'r': "
               "missing keys ['r/g0042/a2/s3/k1'])",
    ),
    "GroupFailed": GroupFailed(
        event_id="group:g0043:failed:a1", epoch=1, ts=_TS + 4, schema_version=1, group_id="g0043",
        attempt=1, reason="generator-1 lost",
    ),
    "GroupEvicted": GroupEvicted(
        event_id="group:g0044:evicted", epoch=1, ts=_TS + 5, schema_version=1, group_id="g0044",
        reason="lag 3 past window 2", lag=3,
    ),
    "StepBegun": StepBegun(
        event_id="step:12:begun", epoch=1, ts=_TS + 6, schema_version=1, step=12, base_trainer_version=11,
    ),
    "MicrobatchTrained": MicrobatchTrained(
        event_id="step:12:microbatch:1", epoch=1, ts=_TS + 7, schema_version=1, step=12, index=1,
        group_ids=["g0042", "g0045"], num_sequences=8, num_tokens=1234,
    ),
    "StepFinished": StepFinished(
        event_id="step:12:finished", epoch=1, ts=_TS + 8, schema_version=1, step=12, trainer_version=12,
        metrics={"loss": 0.125, "reward_mean": 0.5, "kl": 0.001953125}, grad_norm=1.5,
        weights_digest="sha256:0badc0ffee",
    ),
    "StepAborted": StepAborted(
        event_id="step:13:aborted", epoch=1, ts=_TS + 9, schema_version=1, step=13, reason="restart",
    ),
    "WeightsPublished": WeightsPublished(
        event_id="weights:12:published", epoch=1, ts=_TS + 10, schema_version=1, weight_version=12,
        generators=["generator-0", "generator-1"],
    ),
    "CheckpointSaved": CheckpointSaved(
        event_id="checkpoint:12:saved", epoch=1, ts=_TS + 11, schema_version=1, trainer_version=12,
        uri="file:///runs/r-golden/ckpt/v12", sha256="ab" * 32,
    ),
    "CheckpointRejected": CheckpointRejected(
        event_id="checkpoint:12:rejected", epoch=2, ts=_TS + 12, schema_version=1, trainer_version=12,
        uri="file:///runs/r-golden/ckpt/v12", reason="sha256 mismatch",
    ),
    "PayloadsReleased": PayloadsReleased(
        event_id="release:12", epoch=2, ts=_TS + 13, schema_version=1, group_ids=["g0042", "g0045"],
    ),
    "WorkerLost": WorkerLost(
        event_id="worker:trainer-0:lost:1", epoch=2, ts=_TS + 14, schema_version=1, worker="trainer-0",
        role="trainer", reason="actor died: exit code 137",
    ),
    "RunRewound": RunRewound(
        event_id="run:r-golden:rewound:1", epoch=2, ts=_TS + 15, schema_version=1, to_trainer_version=10,
        lost_steps=[10, 12], lost_group_ids=["g0040", "g0042", "g0045"], reason="payloads lost; user rewind",
    ),
    "RunFinished": RunFinished(
        event_id="run:r-golden:finished", epoch=2, ts=_TS + 16, schema_version=1, reason="budget reached",
    ),
    "RunStopped": RunStopped(
        event_id="run:stopped:e2:p40", epoch=2, ts=_TS + 17, schema_version=1,
        reason="32 groups failed in a row (none committed since log position 7), all with: "
               "ValueError: cannot sample from an empty prompt (on generator-0)",
        cause="ValueError: cannot sample from an empty prompt",
    ),
    "EnvStepsRequested": EnvStepsRequested(
        event_id="group:g0042:env:requested:a2:k0", epoch=1, ts=_TS + 18, schema_version=1,
        group_id="g0042", attempt=2, index=0, env="calculator", dedupes_by_key=True,
        calls=[
            EnvCall(sample=0, turn=1, request="3f2a9c0d1e4b5a67", restart=0),
            EnvCall(sample=2, turn=1, request="0b1c2d3e4f506172", restart=1),
        ],
        agent=True,
    ),
    "EnvStepsCompleted": EnvStepsCompleted(
        event_id="group:g0042:env:completed:a2:k1", epoch=1, ts=_TS + 19, schema_version=1,
        group_id="g0042", attempt=2, index=1,
        results=[
            EnvResult(sample=0, turn=1, reward=0.125, ended=False, end_reason="",
                      observation_tokens=5, info={"tool": "calculator"}, restart=0),
            EnvResult(sample=2, turn=1, reward=0.0, ended=True, end_reason="done",
                      observation_tokens=0, info={"error": "not a call"}, restart=1),
        ],
    ),
    "EpisodesRestarted": EpisodesRestarted(
        event_id="group:g0042:restarted:a2", epoch=1, ts=_TS + 20, schema_version=1,
        group_id="g0042", attempt=2, samples=[1, 3],
        reason="turn 2 of env 'ledger' has no result and the env cannot deduplicate",
    ),
    "EpisodeTurnsRecorded": EpisodeTurnsRecorded(
        event_id="group:g0042:turns:a2:k3:e2", epoch=1, ts=_TS + 21, schema_version=1,
        group_id="g0042", attempt=2, segment_index=3, env_index=2,
        results=[EnvResult(sample=0, turn=2, reward=0.25, ended=False, end_reason="",
                           observation_tokens=4, info={"tool": "calculator"}, restart=0)],
        flushes=[
            SegmentFlush(kind="observation", weight_version=None, segments=[
                Segment(sample=0, start=80, length=4, key="r/g0042/a2/s0/k3", turn=2, stopped=False)]),
            SegmentFlush(kind="model", weight_version=5, segments=[
                Segment(sample=0, start=84, length=16, key="r/g0042/a2/s0/k4", turn=3, stopped=True)]),
        ],
        env="calculator", dedupes_by_key=True,
        calls=[EnvCall(sample=0, turn=3, request="9a8b7c6d5e4f3021", restart=0)],
        agent=True,
    ),
}


def _load() -> dict[str, bytes]:
    lines = [line for line in FIXTURE.read_bytes().splitlines() if line.strip()]
    out: dict[str, bytes] = {}
    for line in lines:
        name = msgspec.json.decode(line)["type"]
        assert name not in out, f"two golden lines for {name}"
        out[name] = line
    return out


def test_every_event_type_has_a_golden_fixture() -> None:
    missing = sorted(set(EVENT_TYPES) - set(_load()))
    assert not missing, (
        f"no golden fixture for {missing}: add them to GOLDEN and run "
        "'python -m tests.unit.test_event_codec --regenerate'"
    )
    assert set(GOLDEN) == set(EVENT_TYPES)


@pytest.mark.parametrize("type_name", sorted(EVENT_TYPES))
def test_golden_bytes_decode_and_reencode_identically(type_name: str) -> None:
    line = _load()[type_name]
    event = codec.decode(line, position=7)
    assert type(event) is EVENT_TYPES[type_name]
    assert event == GOLDEN[type_name]
    # every field written, as every log before the compact form was: the full form
    # gives those bytes back; what this code writes is golden_compact.jsonl's line for
    # the types that carry values (tests/unit/test_compact_events.py), these bytes for
    # the others
    assert msgspec.json.encode(codec.full_form(event)) == line
    if type_name not in COMPACT_TYPES:
        assert codec.encode(event) == line


@pytest.mark.parametrize("type_name", sorted(EVENT_TYPES))
def test_golden_fixture_populates_every_field(type_name: str) -> None:
    raw = msgspec.json.decode(_load()[type_name])
    fields = set(EVENT_TYPES[type_name].__struct_fields__)
    assert fields | {"type"} == set(raw)


BAD_ENTRIES = [
    pytest.param(b"\x00\xffnot json", "not a JSON object", id="garbage"),
    pytest.param(b"[1, 2]", "not a JSON object", id="array"),
    pytest.param(b'{"event_id": "x", "epoch": 1, "ts": 0.0}', "missing or non-string 'type'", id="no-type"),
    pytest.param(
        b'{"type": "StepExploded", "event_id": "x", "epoch": 1, "ts": 0.0, "schema_version": 1}',
        "unknown event type 'StepExploded'",
        id="unknown-type",
    ),
    pytest.param(
        b'{"type": "StepAborted", "event_id": "x", "epoch": 1, "ts": 0.0, "schema_version": 2, "step": 1, "reason": "r"}',
        "schema_version 2, newer than this code",
        id="future-schema-version",
    ),
    pytest.param(
        b'{"type": "StepAborted", "event_id": "x", "epoch": 1, "ts": 0.0, "schema_version": 0, "step": 1, "reason": "r"}',
        "invalid schema_version 0",
        id="zero-schema-version",
    ),
    pytest.param(
        b'{"type": "StepAborted", "event_id": "x", "epoch": 1, "ts": 0.0, "schema_version": 1, "reason": "r"}',
        "invalid StepAborted",
        id="missing-field",
    ),
    pytest.param(
        b'{"type": "StepAborted", "event_id": "x", "epoch": 1, "ts": 0.0, "schema_version": 1, "step": "one", "reason": "r"}',
        "invalid StepAborted",
        id="wrong-field-type",
    ),
]


@pytest.mark.parametrize(("data", "reason"), BAD_ENTRIES)
def test_bad_entries_raise_decode_error_with_position(data: bytes, reason: str) -> None:
    with pytest.raises(EventDecodeError) as info:
        codec.decode(data, position=4242)
    assert info.value.position == 4242
    assert reason in info.value.reason
    assert "position 4242" in str(info.value)


def test_missing_schema_version_reads_as_current() -> None:
    data = b'{"type": "StepAborted", "event_id": "x", "epoch": 1, "ts": 0.0, "step": 1, "reason": "r"}'
    assert codec.decode(data, position=1) == StepAborted(event_id="x", epoch=1, ts=0.0, step=1, reason="r")


#: RolloutAdmitted as written before the admission recorded its generator (the golden
#: line's bytes until then): an old log's admissions still decode, with generator "".
HISTORY = FIXTURE.with_name("golden_history.jsonl")


def _history() -> list[bytes]:
    return [line for line in HISTORY.read_bytes().splitlines() if line.strip()]


def test_history_holds_the_superseded_lines() -> None:
    # RolloutAdmitted gained ``generator``: its first golden line is kept here
    assert "RolloutAdmitted" in [msgspec.json.decode(line)["type"] for line in _history()]


@pytest.mark.parametrize("line", _history(), ids=lambda b: msgspec.json.decode(b)["type"])
def test_a_superseded_golden_line_still_decodes(line: bytes) -> None:
    raw = msgspec.json.decode(line)
    want = GOLDEN[raw["type"]]
    lacking = {
        f.name: (f.default if f.default is not msgspec.NODEFAULT else f.default_factory())
        for f in msgspec.structs.fields(type(want)) if f.encode_name not in raw
    }
    assert lacking, "a history line must lack a field the current golden line sets"
    assert codec.decode(line, position=3) == msgspec.structs.replace(want, **lacking)


# -- upcasters: a log written before a schema change still decodes ----------------------

#: A GroupFailed as a release with an older schema wrote it: the field now called
#: ``reason`` was ``why`` at version 1 and ``cause`` at version 2.
OLD_GROUP_FAILED = (
    b'{"type":"GroupFailed","event_id":"group:g7:failed:a1","epoch":3,"ts":12.5,'
    b'"schema_version":1,"group_id":"g7","attempt":1,"why":"generator lost"}'
)


def _rename(old: str, new: str):
    def upcast(raw: dict) -> dict:
        raw = dict(raw)
        raw[new] = raw.pop(old)
        return raw

    return upcast


@pytest.fixture
def schema_v3(monkeypatch: pytest.MonkeyPatch) -> None:
    """The codec as a release at schema version 3 runs it, with that release's upcasters."""
    monkeypatch.setattr(codec, "CURRENT_SCHEMA_VERSION", 3)
    monkeypatch.setitem(codec.UPCASTERS, ("GroupFailed", 1), _rename("why", "cause"))
    monkeypatch.setitem(codec.UPCASTERS, ("GroupFailed", 2), _rename("cause", "reason"))


def test_old_version_decodes_through_each_upcaster_in_turn(schema_v3: None) -> None:
    event = codec.decode(OLD_GROUP_FAILED, position=9)
    assert event == GroupFailed(
        event_id="group:g7:failed:a1", epoch=3, ts=12.5, schema_version=3,
        group_id="g7", attempt=1, reason="generator lost",
    )


def test_a_missing_upcaster_names_the_type_and_version(
    schema_v3: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(codec.UPCASTERS, ("GroupFailed", 2))
    with pytest.raises(EventDecodeError) as info:
        codec.decode(OLD_GROUP_FAILED, position=9)
    assert info.value.position == 9
    assert "no upcaster for GroupFailed schema_version 2" in info.value.reason


def test_without_upcasters_the_old_fixture_does_not_decode() -> None:
    # At the real schema version the old field name is a decode error, so the tests
    # above pass only because the upcasters ran.
    with pytest.raises(EventDecodeError, match="invalid GroupFailed"):
        codec.decode(OLD_GROUP_FAILED, position=9)


def _regenerate() -> None:
    """Append golden lines for types that have none. Never rewrites an existing line."""
    existing = _load() if FIXTURE.exists() else {}
    added = [name for name in GOLDEN if name not in existing]
    with FIXTURE.open("ab") as out:
        for name in added:
            out.write(msgspec.json.encode(codec.full_form(GOLDEN[name])) + b"\n")
    compact = [name for name in added if codec.encode(GOLDEN[name]) != msgspec.json.encode(
        codec.full_form(GOLDEN[name]))]
    with FIXTURE.with_name("golden_compact.jsonl").open("ab") as out:
        for name in compact:
            out.write(codec.encode(GOLDEN[name]) + b"\n")
    print(f"appended {len(added)} golden line(s): {', '.join(added) or 'none'}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(__doc__)
    _regenerate()
