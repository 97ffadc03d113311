"""SegmentsRecorded in the reducer: given events -> then state, or the violation it names."""

from __future__ import annotations

import re
from typing import Any

import pytest

from controller.core.decisions import Stamp
from controller.core.errors import InvariantViolation
from controller.core.policies import plan_microbatch
from controller.core.segments import token_lags
from tests.unit.log_builder import LogBuilder, assert_violation


def _b(config: dict[str, Any] | None = None) -> LogBuilder:
    return LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=2).start(config=config)


def _at_version(b: LogBuilder, version: int) -> LogBuilder:
    """Train ``version`` one-group steps on fresh groups (trainer_version = version)."""
    for k in range(version):
        b.group(f"w{k}").train_step([f"w{k}"]).publish()
    return b


VIOLATIONS = [
    pytest.param(lambda b: b.flush("g1", {0: (0, 3)}), "never admitted", id="unknown-group"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 3)}, index=1), "flush index 1, expected 0", id="index-gap"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 3)}, version=1), "newer than trainer_version 0", id="future-version"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 3)}, version=None), "a model flush with weight_version None", id="model-without-version"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 3)}, kind="observation"), "observation flush with weight_version 0", id="observation-with-version"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 3)}).flush("g1", {0: (2, 3)}), "starts at token 2, but 3 are recorded", id="overlap"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (1, 3)}), "starts at token 1, but 0 are recorded", id="gap"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 3, True)}).flush("g1", {0: (3, 1)}), "sample 0 already stopped", id="after-stop"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {2: (0, 3)}), "outside the group of 2", id="bad-sample"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 0)}), "length >= 1", id="empty-segment"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {}), "no segments", id="no-segments"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 30)}).commit("g1"), "sample 0: 16 tokens committed but 30 were recorded", id="commit-shorter"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {1: (0, 3, True)}).commit("g1"), "sample 1: 17 tokens committed but 3 were recorded and it had stopped", id="commit-after-stop"),
    pytest.param(lambda b: _at_version(b, 2).admit("g1").flush("g1", {0: (0, 3)}, version=1).commit("g1", start=2, end=2), "recorded versions 1..1 outside the commit's 2..2", id="commit-versions"),
    pytest.param(lambda b: _at_version(b, 2).admit("g1", weight_version=1).commit("g1", start=1, end=2, lengths=[3, 5], version_runs=[[1, 3], [1, 2, 2, 2]]), re.escape("sample 1: version_runs [1, 2, 2, 2] do not encode its 5 tokens"), id="runs-short"),
    pytest.param(lambda b: _at_version(b, 2).admit("g1", weight_version=1).commit("g1", start=1, end=2, lengths=[3, 5], version_runs=[[1, 3]]), "version_runs for 1 samples, 2 committed", id="runs-samples"),
    pytest.param(lambda b: _at_version(b, 2).admit("g1", weight_version=1).commit("g1", start=1, end=2, lengths=[3, 5], version_runs=[[1, 3], [2, 2, 1, 3]]), re.escape("sample 1: version_runs [2, 2, 1, 3] not rising within 1..2"), id="runs-falling"),
    pytest.param(lambda b: _at_version(b, 3).admit("g1", weight_version=1).commit("g1", start=1, end=2, lengths=[3, 5], version_runs=[[1, 3], [1, 2, 3, 3]]), re.escape("sample 1: version_runs [1, 2, 3, 3] not rising within 1..2"), id="runs-past-end"),
    pytest.param(lambda b: _at_version(b, 2).admit("g1", weight_version=1).flush("g1", {0: (0, 2), 1: (0, 2)}, version=1).commit("g1", start=1, end=2, lengths=[3, 5], version_runs=[[1, 3], [1, 1, 2, 4]]), re.escape("sample 1: version_runs [1, 1, 2, 4] disagree with its recorded versions 1..1"), id="runs-vs-flush"),
    # right at both ends of what was recorded, wrong in the middle: tokens 2..3 were flushed at v2
    pytest.param(lambda b: _at_version(b, 3).admit("g1", weight_version=1).flush("g1", {0: (0, 2)}, version=1).flush("g1", {0: (2, 2)}, version=2).flush("g1", {0: (4, 2)}, version=3).commit("g1", start=1, end=3, lengths=[6, 2], version_runs=[[1, 4, 3, 2], [3, 2]]), re.escape("sample 0: version_runs [1, 4, 3, 2] disagree with its recorded versions 1..3"), id="runs-vs-middle-flush"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 3)}).drop_segments("g1", ["g1/a1/s0/k0"]), "only the attempt that failed may drop them, the group is admitted", id="drop-while-sampling"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 3)}).fail("g1").drop_segments("g1", ["g1/a1/s1/k0"]), "g1/a1/s1/k0 is not a segment the group recorded", id="drop-unknown-key"),
    pytest.param(lambda b: b.admit("g1").fail("g1").drop_segments("g1", ["g1/a1/s0/k0"]), "no recorded segments to drop", id="drop-nothing-recorded"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 3)}).fail("g1").drop_segments("g1", []), "a drop names no key", id="drop-no-key"),
    pytest.param(lambda b: b.admit("g1").flush("g1", {0: (0, 3)}).fail("g1").admit("g1").fail("g1").drop_segments("g1", ["g1/a1/s0/k0"], attempt=1), "dropped by attempt 1; only the attempt that failed", id="drop-by-an-older-attempt"),
]


@pytest.mark.parametrize(("build", "message"), VIOLATIONS)
def test_violation_names_the_flush_and_leaves_state_intact(build, message):
    assert_violation(build(_b()).build(), message)


def test_a_resumed_group_continues_across_attempts_and_sums_its_versions():
    b = _at_version(_b(), 3)
    b.admit("g1", weight_version=1).flush("g1", {0: (0, 4), 1: (0, 4)}, version=1)
    b.flush("g1", {0: (4, 2, True), 1: (4, 2)}, version=2)
    b.fail("g1").admit("g1")  # attempt 2 resumes: sample 1 goes on at token 6
    b.flush("g1", {1: (6, 4)}, version=3, index=0)
    # commit: sample 0 stopped at 6; sample 1 has 6 + 4 recorded and 2 more at v3
    b.commit("g1", start=1, end=3, lengths=[6, 12])
    state = b.fold()
    g = state.groups["g1"]
    assert "g1" not in state.inflight
    assert (g.weight_version_start, g.weight_version_end) == (1, 3)
    assert g.version_token_sum == 1 * 8 + 2 * 4 + 3 * 4 + 3 * 2
    assert g.partial_span == 2  # sample 1: v1 .. v3
    oldest, newest, mean = token_lags(4, 1, 3, g.version_token_sum, 18)
    assert (oldest, newest) == (3, 1) and mean == pytest.approx(4 - 34 / 18)


def test_version_runs_give_every_token_its_version_after_the_last_flush():
    # a refit closes a segment without a flush: sample 1's tail spans v1 and v2, so the
    # commit's runs, not "the tail is at the newest version", give the exact sum
    b = _at_version(_b(), 2).admit("g1", weight_version=1)
    b.flush("g1", {0: (0, 2), 1: (0, 2)}, version=1)
    b.commit("g1", start=1, end=2, lengths=[3, 6], version_runs=[[1, 3], [1, 4, 2, 2]])
    g = b.fold().groups["g1"]
    assert g.version_token_sum == 1 * 3 + 1 * 4 + 2 * 2  # the old rule: 1*2 + 1*2 + 2*5
    assert g.partial_span == 1
    # and without any flush: exact too, where the bounds counted each token at the start
    b = _at_version(_b(), 2).admit("g1", weight_version=1)
    b.commit("g1", start=1, end=2, lengths=[3, 6], version_runs=[[1, 3], [1, 4, 2, 2]])
    assert b.fold().groups["g1"].version_token_sum == 11


def test_without_flushes_the_commits_bounds_stand_for_every_token():
    state = _at_version(_b(), 2).admit("g1").commit("g1", start=1, end=2, lengths=[3, 5]).fold()
    g = state.groups["g1"]
    assert (g.version_token_sum, g.partial_span) == (8, 1)


@pytest.mark.parametrize(("basis", "claimable"), [("oldest_token", False), ("newest_token", True)])
def test_the_window_bounds_the_oldest_or_the_newest_token(basis, claimable):
    b = _b(config={"staleness": {"window_basis": basis}})
    b.admit("g1").flush("g1", {0: (0, 2), 1: (0, 2)}, version=0)
    _at_version(b, 2)  # two refits while g1 is in flight
    b.commit("g1", start=0, end=2)  # its tail was sampled by version 2
    state = b.fold()
    assert state.window_basis == basis
    plan = plan_microbatch(state, window=1, selection="ready_first", groups_per_step=1,
                           groups_per_microbatch=1, at=Stamp(epoch=1, ts=0.0, position=0))
    assert (plan.group_ids == ("g1",)) is claimable
    assert ([(e.group_id, e.lag) for e in plan.evictions] == [("g1", 2)]) is (not claimable)
    b.begin_step().microbatch(["g1"])
    if claimable:
        assert b.fold().groups["g1"].lag == 2  # the oldest token's lag is what it records
    else:
        with pytest.raises(InvariantViolation, match="lag 2 at trainer_version 2 is outside"):
            b.fold()


def test_a_dropped_sample_restarts_from_the_prompt_and_the_others_keep_their_tokens():
    b = _at_version(_b(), 2)
    b.admit("g1").flush("g1", {0: (0, 4), 1: (0, 4)}, version=1).flush("g1", {0: (4, 2), 1: (4, 2)}, version=2)
    b.fail("g1").admit("g1").fail("g1", reason="MissingPayloadError")
    b.drop_segments("g1", ["g1/a1/s1/k1"])  # sample 1 lost a row: all its segments go
    state = b.fold()
    rec = state.inflight["g1"]
    assert rec.recorded == [6, 0] and rec.first_version == [1, -1] and rec.last_version == [2, -1]
    assert (rec.version_token_sum, rec.model_tokens) == (1 * 4 + 2 * 2, 6)
    assert [[s.sample for s in f.segments] for f in rec.flushes] == [[0], [0]]
    # attempt 3: sample 1 starts again at token 0 (shorter than it had been), sample 0 at 6
    b.admit("g1").flush("g1", {1: (0, 3), 0: (6, 1)}, version=2, index=0)
    b.commit("g1", start=1, end=2, lengths=[7, 3])
    g = b.fold().groups["g1"]
    assert g.version_token_sum == 1 * 4 + 2 * 2 + 2 * 3 + 2 * 1


def test_dropping_every_recorded_sample_forgets_the_group_s_segments():
    b = _b().admit("g1").flush("g1", {0: (0, 3), 1: (0, 2)}).fail("g1")
    state = b.drop_segments("g1", ["g1/a1/s0/k0", "g1/a1/s1/k0"]).fold()
    assert "g1" not in state.inflight
    b.admit("g1").flush("g1", {0: (0, 1)}, index=0)  # a fresh start is accepted
    assert b.fold().inflight["g1"].recorded == [1, 0]
