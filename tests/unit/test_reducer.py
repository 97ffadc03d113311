"""Given events -> then state (or then InvariantViolation at the last event's position)."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from controller.core.errors import InvariantViolation
from controller.core.fold import fold
from controller.core.reducer import apply
from controller.core.state import GroupStatus, StepStatus, initial_state
from tests.unit.log_builder import LogBuilder

Build = Callable[[LogBuilder], LogBuilder]


def _builder() -> LogBuilder:
    return LogBuilder(run_id="r1", window=1, groups_per_step=2, samples_per_group=2)


def _two_groups(b: LogBuilder, *first: str) -> LogBuilder:
    """Started; the groups ``first`` then g1 and g2 committed at weight version 0."""
    b.start()
    for gid in first:
        b.group(gid)
    return b.group("g1").group("g2")


def _trained(b: LogBuilder, *first: str) -> LogBuilder:
    """Steps 0 and 1 finished (trainer_version 2) on g1 and g2, published."""
    return _two_groups(b, *first).train_step(["g1"]).publish().train_step(["g2"]).publish()


# -- violations: the last event of the log is the bad one ----------------------------------

VIOLATIONS: list[Any] = [
    # run, controller, epochs, positions
    pytest.param(lambda b: b.admit("g1"), "first event of a run must be RunStarted", id="first-not-run-started"),
    pytest.param(lambda b: b.start().run_started(), "RunStarted again", id="run-started-twice"),
    pytest.param(lambda b: b.run_started(epoch=0), "epoch >= 1", id="run-started-epoch-0"),
    pytest.param(lambda b: b.run_started(groups_per_step=0), "groups_per_step >= 1", id="run-started-bad-config"),
    pytest.param(lambda b: b.start().controller_started(1), "not newer than epoch 1", id="controller-same-epoch"),
    pytest.param(lambda b: b.start().restart().controller_started(1), "not newer than epoch 2", id="controller-older-epoch"),
    pytest.param(lambda b: b.start().restart().admit("g1", epoch=1), "stale epoch 1", id="stale-epoch"),
    pytest.param(lambda b: b.start().admit("g1", epoch=2), "epoch 2 was never claimed", id="unclaimed-epoch"),
    pytest.param(lambda b: b.start().finish_run().finish_run(), "already finished", id="finished-twice"),
    pytest.param(lambda b: _two_groups(b).begin_step().finish_run(), "while step 0 is open", id="finish-run-open-step"),
    # admission
    pytest.param(lambda b: b.start().admit("g1", attempt=2), "must be attempt 1", id="new-group-attempt-2"),
    pytest.param(lambda b: b.start().admit("g1").admit("g1"), "only a failed group is re-admitted", id="readmit-in-flight"),
    pytest.param(lambda b: _two_groups(b).admit("g1"), "g1 is committed", id="readmit-committed"),
    pytest.param(lambda b: b.start().admit("g1").fail("g1").admit("g1", attempt=3), "expected 2", id="readmit-wrong-attempt"),
    pytest.param(lambda b: b.start().finish_run().admit("g1"), "admitted after RunFinished", id="admit-after-finish"),
    pytest.param(lambda b: b.start().admit("g1", n_samples=0), "n_samples 0", id="admit-no-samples"),
    # commit / fail / evict
    pytest.param(lambda b: b.start().commit("g1"), "never admitted", id="commit-unknown"),
    pytest.param(lambda b: b.start().group("g1").commit("g1"), "is committed, not admitted", id="commit-twice"),
    pytest.param(lambda b: b.start().admit("g1").commit("g1", attempt=2), "does not match the admitted attempt 1", id="commit-wrong-attempt"),
    pytest.param(lambda b: b.start().admit("g1").commit("g1", rewards=[1.0]), "same non-zero length, got 2/1/2", id="commit-ragged"),
    pytest.param(lambda b: b.start().admit("g1").commit("g1", n=0), "same non-zero length, got 0/0/0", id="commit-empty"),
    pytest.param(lambda b: b.start().admit("g1").commit("g1", start=1, end=0), "weight_version_end 0 < start 1", id="commit-end-before-start"),
    pytest.param(lambda b: b.start().admit("g1").commit("g1", lengths=[2**63, 1]), "a length is not an int64", id="commit-length-overflow"),
    pytest.param(lambda b: b.start().admit("g1").fail("g1").commit("g1"), "is failed, not admitted", id="commit-failed"),
    pytest.param(lambda b: b.start().group("g1").fail("g1"), "is committed, not admitted", id="fail-committed"),
    pytest.param(lambda b: b.start().admit("g1").fail("g1", attempt=2), "does not match", id="fail-wrong-attempt"),
    pytest.param(lambda b: b.start().fail("g1"), "never admitted", id="fail-unknown"),
    pytest.param(lambda b: b.start().admit("g1").evict("g1"), "g1 is admitted", id="evict-in-flight"),
    pytest.param(lambda b: _two_groups(b).begin_step().microbatch(["g1"]).evict("g1"), "g1 is claimed", id="evict-claimed"),
    pytest.param(lambda b: _two_groups(b).evict("g1").evict("g1"), "g1 is evicted", id="evict-twice"),
    pytest.param(lambda b: b.start().evict("gx"), "gx is unknown", id="evict-unknown"),
    # steps
    pytest.param(lambda b: b.start().begin_step().begin_step(), "step 1 begun while step 0 is open", id="begin-while-open"),
    pytest.param(lambda b: b.start().begin_step(step=1), "expected step 0", id="begin-skips-number"),
    pytest.param(lambda b: _two_groups(b).begin_step().abort_step().begin_step(step=0), "expected step 1", id="begin-reuses-aborted-number"),
    pytest.param(lambda b: b.start().begin_step(base=1), "base_trainer_version 1 != trainer_version 0", id="begin-wrong-base"),
    pytest.param(lambda b: b.start().finish_run().begin_step(), "begun after RunFinished", id="begin-after-finish"),
    pytest.param(lambda b: _two_groups(b).microbatch(["g1"], step=0), "no step is open", id="microbatch-no-open-step"),
    pytest.param(lambda b: _two_groups(b).begin_step().microbatch(["g1"], step=5), "step 5 is not open (step 0 is)", id="microbatch-wrong-step"),
    pytest.param(lambda b: _two_groups(b).begin_step().microbatch(["g1"], index=1), "index 1, expected 0", id="microbatch-wrong-index"),
    pytest.param(lambda b: _two_groups(b).begin_step().microbatch(["g1"]).microbatch(["g2"], index=0), "index 0, expected 1", id="microbatch-repeated-index"),
    pytest.param(lambda b: _two_groups(b).begin_step().microbatch([]), "at least one group", id="microbatch-empty"),
    pytest.param(lambda b: _two_groups(b).begin_step().microbatch(["g1", "g1"]), "no duplicate ids", id="microbatch-duplicate"),
    pytest.param(lambda b: b.start().admit("g1").begin_step().microbatch(["g1"]), "g1 is admitted; only committed", id="microbatch-uncommitted"),
    pytest.param(lambda b: _two_groups(b).begin_step().microbatch(["g1"]).microbatch(["g2", "g1"]), "already claimed by step 0", id="microbatch-claimed-twice"),
    pytest.param(lambda b: _two_groups(b).evict("g1").begin_step().microbatch(["g1"]), "g1 is evicted", id="microbatch-evicted"),
    pytest.param(lambda b: _two_groups(b).begin_step().microbatch(["gx"]), "gx was never admitted", id="microbatch-unknown"),
    pytest.param(lambda b: _two_groups(b).train_step(["g1"]).begin_step().microbatch(["g1"]), "g1 is consumed", id="consumed-twice"),
    pytest.param(
        lambda b: _trained(b, "g0").begin_step().microbatch(["g0"]),
        "lag 2 at trainer_version 2 is outside the window [0, 1]",
        id="microbatch-lag-past-window",
    ),
    pytest.param(
        lambda b: b.start().admit("g1").commit("g1", start=3, end=3).begin_step().microbatch(["g1"]),
        "lag -3 at trainer_version 0 is outside the window",
        id="microbatch-negative-lag",
    ),
    pytest.param(lambda b: b.start().finish_step(step=0), "no step is open", id="finish-no-open-step"),
    pytest.param(lambda b: _two_groups(b).begin_step().microbatch(["g1"]).finish_step(step=1), "step 1 is not open", id="finish-wrong-step"),
    pytest.param(lambda b: b.start().begin_step().finish_step(), "without any microbatch", id="finish-no-microbatch"),
    pytest.param(lambda b: _two_groups(b).begin_step().microbatch(["g1"]).finish_step(trainer_version=2), "expected 1 (base + 1)", id="finish-skips-version"),
    pytest.param(lambda b: _two_groups(b).begin_step().microbatch(["g1"]).finish_step(trainer_version=0), "expected 1 (base + 1)", id="finish-same-version"),
    pytest.param(lambda b: b.start().abort_step(step=0), "no step is open", id="abort-no-open-step"),
    pytest.param(lambda b: b.start().begin_step().abort_step(step=3), "step 3 is not open", id="abort-wrong-step"),
    # weights and checkpoints
    pytest.param(lambda b: b.start().publish(1), "published ahead of trainer_version 0", id="publish-ahead"),
    pytest.param(lambda b: _trained(b).publish(1), "published after 2", id="publish-backwards"),
    pytest.param(lambda b: b.start().checkpoint(1), "the trainer is at 0", id="checkpoint-ahead"),
    pytest.param(lambda b: b.start().checkpoint(-1), "the trainer is at 0", id="checkpoint-negative"),
    # payload release
    pytest.param(lambda b: _two_groups(b).release(["g1"]), "before a checkpoint covers them: group g1 is committed", id="release-committed"),
    pytest.param(lambda b: b.start().admit("g1").release(["g1"]), "g1 is admitted", id="release-in-flight"),
    pytest.param(lambda b: _two_groups(b).begin_step().microbatch(["g1"]).release(["g1"]), "g1 is claimed", id="release-claimed"),
    pytest.param(lambda b: _two_groups(b).train_step(["g1"]).release(["g1"]), "consumed by step 0, newest usable checkpoint is trainer_version -1", id="release-no-checkpoint"),
    pytest.param(lambda b: _trained(b).checkpoint(1).release(["g2"]), "consumed by step 1, newest usable checkpoint is trainer_version 1", id="release-older-checkpoint"),
    pytest.param(lambda b: _trained(b).checkpoint().reject_checkpoint(2).release(["g2"]), "newest usable checkpoint is trainer_version -1", id="release-rejected-checkpoint"),
    pytest.param(lambda b: _trained(b).checkpoint().release(["g1"]).release(["g1"]), "already released", id="release-twice"),
    pytest.param(lambda b: _trained(b).checkpoint().release(["g1", "g1"]), "duplicate group ids", id="release-duplicate"),
    pytest.param(lambda b: b.start().release(["gx"]), "unknown group gx", id="release-unknown"),
    # rewind
    pytest.param(lambda b: _trained(b).checkpoint(0).begin_step().rewind(0), "while step 2 is open", id="rewind-open-step"),
    pytest.param(lambda b: _trained(b).rewind(3), "ahead of trainer_version 2", id="rewind-ahead"),
    pytest.param(lambda b: _trained(b).checkpoint(0).rewind(1), "no usable checkpoint", id="rewind-no-checkpoint"),
    pytest.param(lambda b: _trained(b).checkpoint(1).reject_checkpoint(1).rewind(1), "no usable checkpoint", id="rewind-rejected-checkpoint"),
    pytest.param(lambda b: _trained(b).checkpoint(0).rewind(0, lost_steps=[1]), "must be exactly the steps after it: [0, 1]", id="rewind-wrong-lost-steps"),
    pytest.param(lambda b: _trained(b).checkpoint(0).rewind(0, lost_group_ids=["g1"]), "exactly the groups of the lost steps", id="rewind-wrong-lost-groups"),
    pytest.param(lambda b: _trained(b).checkpoint(0).rewind(0, lost_group_ids=["g1", "g2", "g2"]), "exactly the groups", id="rewind-duplicate-lost-groups"),
    pytest.param(
        lambda b: _trained(b).checkpoint(2).checkpoint(0).rewind(0).group("g3").train_step(["g3"]).group("g4").train_step(["g4"]).rewind(2),
        "no usable checkpoint",
        id="rewind-to-a-lost-checkpoint",
    ),
]


def _gap(b: LogBuilder) -> LogBuilder:
    b.start()
    b.next_position += 1
    return b.admit("g1")


VIOLATIONS.append(pytest.param(_gap, "position must follow 2 (gapless)", id="position-gap"))


@pytest.mark.parametrize(("build", "reason"), VIOLATIONS)
def test_violation_names_the_position_and_leaves_state_intact(build: Build, reason: str) -> None:
    log = build(_builder()).build()
    *prefix, bad = log
    state = fold(prefix)
    before = state.copy()
    with pytest.raises(InvariantViolation) as info:
        apply(state, bad)
    err = info.value
    assert err.position == bad.position
    assert reason in err.reason
    assert err.event_id == bad.event.event_id
    assert f"position {bad.position} ({bad.event.event_id})" in str(err)
    assert state == before  # validate-then-mutate: nothing half-applied


# -- accepted logs: then state -------------------------------------------------------------

Check = Callable[[Any], Any]

ACCEPTED: list[Any] = [
    pytest.param(
        lambda b: b.start(),
        lambda s: (s.started, s.run_id, s.epoch, [e.epoch for e in s.epochs], s.window_versions, s.groups_per_step, s.samples_per_group, s.position),
        (True, "r1", 1, [1], 1, 2, 2, 2),
        id="start",
    ),
    pytest.param(
        lambda b: b.run_started(epoch=3).controller_started(3).restart(),
        lambda s: (s.epoch, [e.epoch for e in s.epochs]),
        (3 + 1, [3, 4]),
        id="run-started-claims-first-epoch",
    ),
    pytest.param(
        lambda b: b.run_started().restart().admit("g1"),
        lambda s: (s.epoch, s.groups["g1"].status),
        (2, GroupStatus.ADMITTED),
        id="first-controller-may-take-a-newer-epoch",
    ),
    pytest.param(
        lambda b: b.start().finish_run("done").restart(),
        lambda s: (s.finished, s.finished_reason, s.epoch),
        (False, None, 2),
        id="restart-resumes-finished-run",
    ),
    pytest.param(
        lambda b: b.start().finish_run("done"),
        lambda s: (s.finished, s.finished_reason),
        (True, "done"),
        id="finish-run",
    ),
    pytest.param(
        lambda b: b.start().admit("g1"),
        lambda s: (s.groups["g1"].status, s.groups["g1"].attempt, [g.group_id for g in s.in_flight()], list(s.buffer), s.groups["g1"].admitted_position),
        (GroupStatus.ADMITTED, 1, ["g1"], [], 3),
        id="admit",
    ),
    pytest.param(
        lambda b: b.start().admit("g1").publish(0).commit("g1", start=0, end=0),
        lambda s: (s.groups["g1"].status, s.in_flight(), list(s.buffer), s.groups["g1"].payload_keys, s.groups["g1"].committed_position),
        (GroupStatus.COMMITTED, [], ["g1"], ("g1/a1/0", "g1/a1/1"), 5),
        id="commit",
    ),
    pytest.param(
        lambda b: b.start().admit("g1").fail("g1", "oom").admit("g1").commit("g1"),
        lambda s: (s.groups["g1"].status, s.groups["g1"].attempt, list(s.buffer)),
        (GroupStatus.COMMITTED, 2, ["g1"]),
        id="fail-then-readmit",
    ),
    pytest.param(
        lambda b: b.start().admit("g1").fail("g1", "oom"),
        lambda s: (s.groups["g1"].status, s.groups["g1"].failed_reason, s.in_flight(), [g.group_id for g in s.failed_groups()]),
        (GroupStatus.FAILED, "oom", [], ["g1"]),
        id="fail",
    ),
    pytest.param(
        lambda b: _two_groups(b).evict("g1", "stale", lag=3),
        lambda s: (s.groups["g1"].status, s.groups["g1"].evicted_reason, s.groups["g1"].evicted_lag, list(s.buffer)),
        (GroupStatus.EVICTED, "stale", 3, ["g2"]),
        id="evict",
    ),
    pytest.param(
        lambda b: _two_groups(b).begin_step().microbatch(["g2"]),
        lambda s: (s.step_status, s.groups["g2"].status, s.groups["g2"].claimed_step, s.groups["g2"].lag, list(s.buffer), s.open_step.microbatches, s.open_step.num_sequences),
        (StepStatus.OPEN, GroupStatus.CLAIMED, 0, 0, ["g1"], [("g2",)], 2),
        id="microbatch-claims",
    ),
    pytest.param(
        lambda b: _two_groups(b).begin_step().microbatch(["g2"]).microbatch(["g1"]).finish_step(),
        lambda s: (
            s.step_status, s.trainer_version, s.next_step, s.groups["g1"].status, s.groups["g1"].consumed_step,
            s.steps[0].status, s.steps[0].microbatches, s.steps[0].group_ids, s.steps[0].trainer_version,
            s.step_for_version(1).step, s.steps[0].num_sequences,
        ),
        (StepStatus.IDLE, 1, 1, GroupStatus.CONSUMED, 0, StepStatus.FINISHED, [("g2",), ("g1",)], ("g2", "g1"), 1, 0, 4),
        id="finish-consumes",
    ),
    pytest.param(
        lambda b: b.start().group("g1").group("g2").group("g3").begin_step().microbatch(["g3"]).microbatch(["g1"]).abort_step("worker died"),
        lambda s: (
            list(s.buffer), s.groups["g1"].status, s.groups["g1"].claimed_step, s.groups["g1"].lag,
            s.trainer_version, s.next_step, s.steps[0].status, s.steps[0].trainer_version, s.steps[0].abort_reason,
        ),
        (["g1", "g2", "g3"], GroupStatus.COMMITTED, None, None, 0, 1, StepStatus.ABORTED, None, "worker died"),
        id="abort-returns-groups-in-commit-order",
    ),
    pytest.param(
        lambda b: _two_groups(b).begin_step().microbatch(["g1"]).abort_step().begin_step().microbatch(["g1"]).finish_step(),
        lambda s: (s.next_step, sorted(s.steps), s.steps[1].trainer_version, s.groups["g1"].consumed_step),
        (2, [0, 1], 1, 1),
        id="step-after-abort-takes-next-number",
    ),
    pytest.param(
        lambda b: _trained(b),
        lambda s: (s.trainer_version, s.weight_version),
        (2, 2),
        id="publish",
    ),
    pytest.param(
        lambda b: _trained(b).publish(2),
        lambda s: s.weight_version,
        2,
        id="republish-same-version",
    ),
    pytest.param(
        lambda b: _trained(b, "g0").evict("g0", lag=2).release(["g0"]),
        lambda s: (s.groups["g0"].status, s.groups["g0"].payload_released, s.released_groups),
        (GroupStatus.EVICTED, True, 1),
        id="release-evicted-any-time",
    ),
    pytest.param(
        lambda b: b.start().admit("g1").fail("g1").release(["g1"]),
        lambda s: (s.groups["g1"].status, s.groups["g1"].payload_released),
        (GroupStatus.FAILED, True),
        id="release-failed-any-time",
    ),
    pytest.param(
        lambda b: _trained(b).checkpoint(1).release(["g1"]),
        lambda s: (s.groups["g1"].status, s.groups["g1"].payload_released, s.groups["g2"].status, s.latest_checkpoint().trainer_version),
        (GroupStatus.RELEASED, True, GroupStatus.CONSUMED, 1),
        id="release-covered",
    ),
    pytest.param(
        lambda b: _trained(b).checkpoint(0).checkpoint(2).reject_checkpoint(2),
        lambda s: (s.latest_checkpoint().trainer_version, [c.rejected for c in s.checkpoints], len(s.rejected_checkpoints)),
        (0, [False, True], 1),
        id="reject-checkpoint",
    ),
    pytest.param(
        lambda b: b.start().worker_lost("trainer-0", "trainer", "oom"),
        lambda s: [(w.worker, w.role, w.reason, w.position) for w in s.workers_lost],
        [("trainer-0", "trainer", "oom", 3)],
        id="worker-lost",
    ),
    pytest.param(
        lambda b: _trained(b).checkpoint(0).checkpoint(2).reject_checkpoint(2).rewind(0, reason="payloads gone"),
        lambda s: (
            s.trainer_version, s.weight_version, s.groups["g1"].status, s.groups["g2"].status,
            s.steps[0].lost, s.steps[1].lost, s.version_steps, [c.lost for c in s.checkpoints],
            s.rewinds[0].from_trainer_version, s.rewinds[0].lost_steps, s.next_step,
        ),
        (0, 0, GroupStatus.LOST, GroupStatus.LOST, True, True, {}, [False, True], 2, [0, 1], 2),
        id="rewind",
    ),
    pytest.param(
        lambda b: _trained(b).checkpoint(1).release(["g1"]).rewind(1).release(["g2"]).group("g3").begin_step().microbatch(["g3"]).finish_step().checkpoint(2),
        lambda s: (
            s.groups["g1"].status, s.groups["g2"].status, s.groups["g2"].payload_released, s.steps[2].base_trainer_version,
            s.trainer_version, s.step_for_version(2).step, s.latest_checkpoint().trainer_version, s.released_groups,
        ),
        (GroupStatus.RELEASED, GroupStatus.LOST, True, 1, 2, 2, 2, 2),
        id="train-on-after-rewind",
    ),
    pytest.param(
        lambda b: _trained(b).checkpoint(1).rewind(1).publish(),
        lambda s: (s.weight_version, s.trainer_version),
        (1, 1),
        id="rewind-lowers-weight-version",
    ),
]


@pytest.mark.parametrize(("build", "observe", "expected"), ACCEPTED)
def test_accepted_log_then_state(build: Build, observe: Check, expected: Any) -> None:
    log = build(_builder()).build()
    state = fold(log)
    assert observe(state) == expected
    assert state.position == log[-1].position
    assert state.copy() == state


def test_on_policy_window_zero_accepts_lag_zero_only() -> None:
    b = LogBuilder(window=0).start().group("g1").train_step(["g1"]).publish().group("g2")
    state = fold(b.build())
    assert state.groups["g1"].lag == 0 and state.groups["g2"].weight_version_start == 1
    late = LogBuilder(window=0).start().group("g1").group("g2").train_step(["g1"]).begin_step().microbatch(["g2"])
    with pytest.raises(InvariantViolation, match="lag 1 at trainer_version 1"):
        fold(late.build())


def test_state_helpers_read_buffer_and_in_flight_in_order() -> None:
    b = LogBuilder().start().admit("a").admit("b").admit("c").commit("c").commit("a")
    state = fold(b.build())
    assert [g.group_id for g in state.committed_groups_in_order()] == ["c", "a"]
    assert [g.group_id for g in state.iter_buffer()] == ["c", "a"]
    assert [g.group_id for g in state.in_flight()] == ["b"]
    assert state.lag_of(state.groups["c"]) == 0 and state.lag_of(state.groups["b"]) is None
    assert state.latest_checkpoint() is None and state.covered_trainer_version() == -1
    assert state.finished_steps() == []


def test_apply_updates_in_place_and_copy_is_independent() -> None:
    log = LogBuilder().start().admit("g1").build()
    state = fold(log[:2])
    snapshot = state.copy()
    assert apply(state, log[2]) is state
    assert "g1" in state.groups and "g1" not in snapshot.groups
    assert initial_state() == initial_state() and initial_state().position == 0
