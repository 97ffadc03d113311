"""The failure budget in the pure core: given events, then streaks; given a state, then
the decision (``controller.core.failures``, ``decisions.run_stopped``)."""

from __future__ import annotations

import pytest

from controller.config import ConfigError, load_config
from controller.core import decisions
from controller.core.decisions import Stamp
from controller.core.errors import InvariantViolation
from controller.core.failures import FailuresSection, ready_at, stop_reason
from events import schema as ev
from replay.point import state_at
from tests.unit.log_builder import LogBuilder

BOOM = "ValueError: cannot sample from an empty prompt"


def _failed_calls(b: LogBuilder, worker: str, groups: list[str], cause: str = BOOM) -> LogBuilder:
    for g in groups:
        b.admit(g, generator=worker)
    for g in groups:
        b.fail(g, f"{worker}: {cause}")
    return b


def test_failures_on_a_worker_count_in_a_row_until_one_of_its_groups_commits():
    b = LogBuilder(run_id="f").start()
    _failed_calls(b, "generator-0", ["g1", "g2"])
    f = b.fold().failures
    assert (f.in_row, f.cause, f.first_worker, f.same_cause) == (2, BOOM, "generator-0", True)
    assert f.workers["generator-0"].in_row == 2 and f.since_position == 5
    b.admit("g3", generator="generator-0").commit("g3")
    f = b.fold().failures
    assert f.in_row == 0 and "generator-0" not in f.workers and not f.dispatched


def test_a_commit_elsewhere_ends_the_run_streak_but_not_the_sick_workers():
    b = LogBuilder(run_id="f").start()
    _failed_calls(b, "generator-0", ["g1", "g2"])
    b.admit("g3", generator="generator-1").commit("g3")
    f = b.fold().failures
    assert f.in_row == 0 and f.workers["generator-0"].in_row == 2


def test_failures_nobody_can_be_blamed_for_count_for_nothing():
    """A restart's repair of in-flight groups, and logs older than the generator field."""
    b = LogBuilder(run_id="f").start()
    b.admit("g1", generator="generator-0").admit("g2")  # g2: an old log's admission
    b.restart().fail("g1", "controller restart: generation was in flight")
    b.fail("g2", "generator-0: " + BOOM)
    f = b.fold().failures
    assert f.in_row == 0 and not f.workers


def test_the_budget_stops_with_the_first_cause_and_says_whether_all_shared_it():
    b = LogBuilder(run_id="f").start()
    _failed_calls(b, "generator-0", ["g1", "g2"])
    assert stop_reason(b.fold().failures, 3) is None
    _failed_calls(b, "generator-1", ["g3"], "RuntimeError: reward service down")
    reason = stop_reason(b.fold().failures, 3)
    assert reason == (
        "3 groups failed in a row (none committed since log position 5), the first with: "
        f"{BOOM} (on generator-0)"
    )
    same = _failed_calls(LogBuilder(run_id="s").start(), "generator-0", ["g1", "g2", "g3"])
    assert ", all with: " + BOOM in stop_reason(same.fold().failures, 3)


def test_the_decision_is_a_ready_made_event_and_is_taken_once():
    b = _failed_calls(LogBuilder(run_id="f").start(), "generator-0", ["g1", "g2"])
    state = b.fold()
    at = Stamp(epoch=state.epoch, ts=50.0, position=state.position + 1)
    stop = decisions.run_stopped(state, 2, at)
    assert stop == ev.RunStopped(
        event_id=ev.run_stopped_id(state.epoch, state.position + 1), epoch=state.epoch, ts=50.0,
        reason=stop_reason(state.failures, 2), cause=BOOM,
    )
    b.append(stop)
    stopped = b.fold()
    assert stopped.failures.stopped == stop.reason
    assert decisions.run_stopped(stopped, 2, at) is None  # stopped already
    assert state_at(stopped, 50.0)["stopped"] == stop.reason  # what `replay` shows


def test_a_new_controller_gets_a_fresh_budget():
    b = _failed_calls(LogBuilder(run_id="f").start(), "generator-0", ["g1", "g2"])
    state = b.fold()
    b.append(decisions.run_stopped(state, 2, Stamp(state.epoch, 1.0, state.position + 1)))
    b.restart()
    f = b.fold().failures
    assert f.stopped is None and f.in_row == 0 and not f.workers


def test_run_stopped_after_the_run_finished_is_a_violation():
    b = LogBuilder(run_id="f").start().finish_run()
    b.append(ev.RunStopped(event_id="x", epoch=b.epoch, ts=1.0, reason="r", cause="c"))
    with pytest.raises(InvariantViolation, match="RunStopped after RunFinished"):
        b.fold()


@pytest.mark.parametrize(("failed_groups", "delay"), [
    (1, 0.1), (2, 0.1), (3, 0.2), (4, 0.2), (5, 0.4), (8, 0.8), (14, 6.4), (16, 10.0), (40, 10.0),
])
def test_a_workers_next_call_waits_longer_after_each_failed_call(failed_groups, delay):
    """Two groups per call: failed calls = ceil(groups / 2); the delay doubles per call."""
    b = LogBuilder(run_id="f").start()
    _failed_calls(b, "generator-0", [f"g{i}" for i in range(failed_groups)])
    f = b.fold().failures
    last = f.workers["generator-0"].last_ts
    assert ready_at(f, "generator-0", FailuresSection(), groups_per_call=2) == pytest.approx(last + delay)
    assert ready_at(f, "generator-1", FailuresSection(), groups_per_call=2) == 0.0


def test_the_budget_defaults_to_eight_calls_or_two_per_generator():
    assert FailuresSection().budget(1, 4) == 32
    assert FailuresSection().budget(1, 1) == 8
    assert FailuresSection().budget(16, 4) == 128
    assert FailuresSection(max_in_row=5).budget(16, 4) == 5


@pytest.mark.parametrize(("setting", "key"), [
    ("failures.backoff_max_s=0", "failures.backoff_max_s"),
    ("failures.max_in_row=-1", "failures.max_in_row"),
    ("failures.backoff_s=-0.5", "failures.backoff_s"),
])
def test_a_bad_setting_is_refused_naming_its_key(setting, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [setting])
