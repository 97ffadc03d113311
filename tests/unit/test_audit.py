"""Audit over hand-built logs: every invariant violation found at its position, clean logs pass."""

from __future__ import annotations

import csv
import io
from typing import Any, Callable

import pytest

from events.codec import encode
from events.memory_store import MemoryEventStore
from replay.audit import build_report, first_cross_check_problem, write_csv
from controller.projector import Projector
from tests.unit.log_builder import LogBuilder
from tests.unit.random_log import random_run


def store_of(b: LogBuilder, garbage_at: dict[int, bytes] | None = None) -> MemoryEventStore:
    """The builder's log in a memory store; ``garbage_at`` replaces entries by raw bytes."""
    store = MemoryEventStore()
    for stored in b.events:
        data = (garbage_at or {}).get(stored.position) or encode(stored.event)
        store.append_raw(b.run_id, data, event_type=type(stored.event).__name__,
                         event_id=stored.event.event_id)
    return store


def audit(b: LogBuilder, **kw: Any):
    return build_report(Projector(store_of(b, **kw)).get(b.run_id))


def _ready(b: LogBuilder) -> LogBuilder:
    """Started, g1 and g2 committed at v0 (window 1, two groups per step)."""
    return b.start().group("g1").group("g2")


# Each builds a log whose LAST event breaks a rule; the audit must name that position.
VIOLATIONS: list[Any] = [
    pytest.param(lambda b: _ready(b).restart().admit("g3", epoch=1), "stale epoch", id="stale-epoch"),
    pytest.param(lambda b: _ready(b).train_step(["g1", "g2"]).begin_step().microbatch(["g1"]),
                 "only committed groups", id="double-consumption"),
    pytest.param(lambda b: _ready(b).train_step(["g1"]).publish().train_step(["g2"]).begin_step()
                 .microbatch(["g3"]), "never admitted", id="claim-unknown-group"),
    pytest.param(lambda b: b.start().group("g1").group("g2").group("g3").train_step(["g1"])
                 .train_step(["g2"]).begin_step().microbatch(["g3"]), "outside the window",
                 id="lag-beyond-window"),
    pytest.param(lambda b: _ready(b).begin_step().microbatch(["g1"]).finish_step(trainer_version=2),
                 "expected 1 (base + 1)", id="version-jump"),
    pytest.param(lambda b: _ready(b).begin_step().microbatch(["g1"]).begin_step(),
                 "while step 0 is open", id="two-open-steps"),
    pytest.param(lambda b: _ready(b).train_step(["g1", "g2"]).release(["g1"]),
                 "before a checkpoint covers them", id="release-before-checkpoint"),
    pytest.param(lambda b: _ready(b).evict("g1").begin_step().microbatch(["g1"]),
                 "g1 is evicted", id="claim-evicted"),
    pytest.param(lambda b: _ready(b).begin_step(base=3), "base_trainer_version 3", id="wrong-base"),
]


@pytest.mark.parametrize("build, reason", VIOLATIONS)
def test_violation_found_at_its_position(build: Callable[[LogBuilder], LogBuilder], reason: str):
    b = build(LogBuilder(window=1, groups_per_step=2))
    bad = b.last_position
    b.worker_lost()  # a valid-looking event after it: the audit still names the first problem
    report = audit(b)
    assert not report.ok
    assert report.problem["kind"] == "invariant"
    assert report.problem["position"] == bad
    assert reason in report.problem["reason"]
    assert report.checked_through == bad - 1
    assert report.log_end == bad + 1


@pytest.mark.parametrize("garbage", [b"{not json", b'{"type": "NoSuchEvent", "epoch": 1}',
                                     b'{"type": "StepBegun", "epoch": 1}'])
def test_malformed_entry_reported_by_position(garbage: bytes):
    b = _ready(LogBuilder()).train_step(["g1", "g2"]).publish()
    report = audit(b, garbage_at={5: garbage})
    assert report.problem["kind"] == "malformed"
    assert report.problem["position"] == 5
    assert report.checked_through == 4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clean_random_runs_pass(seed: int):
    b = random_run(seed, 40, p_rewind=0.05, p_restart=0.05, p_abort=0.05)
    report = audit(b)
    assert report.ok, report.problem
    assert report.checked_through == report.log_end == b.last_position
    state = b.fold()
    assert len(report.history) == len([s for s in state.steps.values() if s.status.value == "finished"])
    assert report.summary["trainer_version"] == state.trainer_version
    assert len(report.epochs) == len(state.epochs)
    assert len(report.rewinds) == len(state.rewinds)


def test_history_names_groups_weight_versions_lag_and_checkpoints():
    b = LogBuilder(window=1, groups_per_step=2).start().checkpoint()
    b.group("g1").group("g2").train_step(["g1", "g2"]).publish()
    b.group("g3").admit("g4").commit("g4", start=0, end=1)  # g4 dispatched before v1 arrived
    b.train_step(["g3", "g4"]).publish().checkpoint().release(["g1", "g2", "g3", "g4"])
    b.reject_checkpoint(2).restart().worker_lost("trainer-0", "trainer").finish_run()
    report = audit(b)
    assert report.ok
    v1, v2 = report.history
    assert (v1.trainer_version, v1.step, v2.trainer_version) == (1, 0, 2)
    assert [(g["group_id"], g["lag"]) for g in v2.groups] == [("g3", 0), ("g4", 1)]
    assert v2.groups[1]["weight_version_end"] == 1
    assert v2.checkpoints == ["ckpt/v2 (rejected)"]
    assert v1.metrics["loss"] == pytest.approx(0.5)
    assert len(report.epochs) == 2 and report.summary["restarts"] == 1
    assert report.workers_lost[0]["worker"] == "trainer-0"
    assert report.rejected_checkpoints[0]["trainer_version"] == 2


def test_aborts_and_rewinds_are_listed():
    b = LogBuilder(window=1, groups_per_step=1).start().checkpoint()
    b.group("g1").begin_step().microbatch(["g1"]).abort_step("worker error")
    b.train_step(["g1"]).publish().checkpoint()
    b.group("g2").train_step(["g2"]).publish().rewind(1, reason="payloads lost")
    report = audit(b)
    assert report.ok
    assert report.aborts[0]["step"] == 0 and report.aborts[0]["groups_returned"] == ["g1"]
    assert report.rewinds[0]["lost_steps"] == [2] and report.rewinds[0]["lost_group_ids"] == ["g2"]
    assert [r.lost for r in report.history] == [False, True]


def test_cross_check_catches_what_a_reducer_bug_would_hide():
    b = _ready(LogBuilder(window=1, groups_per_step=2)).train_step(["g1", "g2"])
    state = b.fold()
    assert first_cross_check_problem(state) is None
    state.groups["g2"].weight_version_start = -5  # as if the reducer had let lag 5 through
    problem = first_cross_check_problem(state)
    assert problem is not None and problem.position == state.steps[0].ended_position
    assert "lag 5" in problem.reason


def test_csv_has_one_row_per_version():
    b = random_run(7, 12)
    report = audit(b)
    out = io.StringIO()
    write_csv(report, out)
    rows = list(csv.reader(io.StringIO(out.getvalue())))
    assert rows[0][0] == "trainer_version"
    assert len(rows) == 1 + len(report.history)
    assert [int(r[0]) for r in rows[1:]] == [h.trainer_version for h in report.history]


@pytest.mark.parametrize("flag", [False, True])
def test_a_bad_key_file_is_named_as_where_it_came_from(capsys, monkeypatch, tmp_path, flag):
    # checked before the store is opened: no server is needed (port 1 answers nothing)
    from cli.main import main

    short = tmp_path / "short.key"
    short.write_bytes(b"abc")
    monkeypatch.setenv("RLC_CHAIN_KEY_FILE", str(short))
    argv = ["audit", "--run", "r1", "--redis-url", "redis://127.0.0.1:1/0"]
    with pytest.raises(SystemExit) as code:
        main(argv + (["--chain-key-file", str(short)] if flag else []))
    _, err = capsys.readouterr()
    source = "--chain-key-file" if flag else "RLC_CHAIN_KEY_FILE"
    assert code.value.code == 2
    assert err == f"rl-controller: error: {source} '{short}': key has 3 bytes; need at least 16\n"
