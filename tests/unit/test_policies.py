"""Table tests of the staleness policies: given a log, when a policy runs, then a decision."""

from __future__ import annotations

import math

import msgspec
import pytest

from controller.core import policies, reducer
from controller.core.decisions import Stamp
from events import schema as ev
from tests.unit.log_builder import LogBuilder


# -- admission ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, build, dispatch, window, allowed, reason_part",
    [
        ("empty buffer opens the gate", lambda b: b, 0, 1, True, ""),
        (
            "capacity reached closes it",
            lambda b: b.admit("g1").admit("g2").admit("g3").admit("g4"),
            0, 1, False, "buffer full",
        ),
        (
            "window 0: one step's worth of groups only",
            lambda b: b.admit("g1").admit("g2"),
            0, 0, False, "buffer full",
        ),
        (
            "committed groups count as live",
            lambda b: b.admit("g1").commit("g1").admit("g2").commit("g2").admit("g3"),
            0, 1, True, "",
        ),
        (
            "consumed groups free the buffer",
            lambda b: b.admit("g1").commit("g1").admit("g2").commit("g2")
            .begin_step().microbatch(["g1", "g2"]).finish_step()
            .admit("g3").admit("g4").admit("g5"),
            1, 1, True, "",
        ),
        (
            "generators behind the trainer close the window",
            lambda b: b.admit("g1").commit("g1").admit("g2").commit("g2")
            .begin_step().microbatch(["g1", "g2"]).finish_step()
            .admit("g3").admit("g4"),
            0, 1, False, "window closed",
        ),
    ],
)
def test_admission(name, build, dispatch, window, allowed, reason_part):
    state = build(LogBuilder(window=1, groups_per_step=2).start()).fold()
    capacity = 2 * (window + 1)
    got = policies.admission(
        state, dispatch_version=dispatch, window=window, groups_per_step=2, capacity=capacity
    )
    assert got.allowed is allowed, name
    assert reason_part in got.reason


@pytest.mark.parametrize("basis", ["oldest_token", "newest_token"])
def test_the_lag_clause_holds_for_either_window_basis(basis):
    """A group dispatched at v0 while the trainer is at v1 with a step's worth ahead of
    it ends, if short, with every token at v0 and is trained at v2: lag 2 by its newest
    token as well. Before, the newest basis kept only the capacity clause and admitted
    it, and eviction threw it away."""
    b = LogBuilder(window=1, groups_per_step=2).start(config={"staleness": {"window_basis": basis}})
    b.admit("g1").commit("g1").admit("g2").commit("g2")
    b.begin_step().microbatch(["g1", "g2"]).finish_step().admit("g3").admit("g4")
    state = b.fold()
    assert state.window_basis == basis and state.trainer_version == 1
    got = policies.admission(state, dispatch_version=0, window=1, groups_per_step=2, capacity=4)
    assert not got.allowed and "window closed" in got.reason
    assert policies.admission(state, dispatch_version=1, window=1, groups_per_step=2,
                              capacity=4).allowed


_ROOM_LOGS = {
    "empty": lambda b: b,
    "two buffered": lambda b: b.admit("g1").commit("g1").admit("g2").commit("g2"),
    "after a step": lambda b: b.admit("g1").commit("g1").admit("g2").commit("g2")
    .begin_step().microbatch(["g1", "g2"]).finish_step().publish(1).admit("g3"),
    "full": lambda b: b.admit("g1").admit("g2").admit("g3").admit("g4"),
    "a step not yet published": lambda b: b.group("g1").group("g2")
    .begin_step().microbatch(["g1", "g2"]).finish_step().admit("g3"),
}


@pytest.mark.parametrize("log", sorted(_ROOM_LOGS))
@pytest.mark.parametrize("window", [0, 1, 2])
@pytest.mark.parametrize("limit", [1, 3, 8])
@pytest.mark.parametrize("basis", ["live", "per_version"])
def test_admission_room_equals_that_many_single_admissions(log, window, limit, basis):
    """A batch of admissions (one generator call) decides exactly what singles would."""
    builder = _ROOM_LOGS[log](LogBuilder(window=window, groups_per_step=2).start())
    gate = dict(window=window, groups_per_step=2, capacity=2 * (window + 1), basis=basis)
    state = builder.fold()
    dispatch = state.weight_version
    room = policies.admission_room(state, limit=limit, dispatch_version=dispatch, **gate)
    singles = 0
    while singles < limit and policies.admission(
        builder.fold(), dispatch_version=dispatch, **gate
    ).allowed:
        builder.admit(f"new{singles}")  # fold it in, then ask again
        singles += 1
    assert room == singles


def test_the_smallest_buffer_depends_on_the_budget_basis():
    """The live basis needs every step the window allows; the per-version budget restarts
    at each publish, so one step's groups cannot deadlock it (``Config`` checks both)."""
    assert policies.min_capacity(4, 1, "live") == policies.full_capacity(4, 1) == 8
    assert policies.min_capacity(4, 2, "live") == 12
    assert policies.min_capacity(4, 1, "per_version") == policies.min_capacity(4, 2, "per_version") == 4


# -- the per-version budget (verl's run-ahead, staleness.budget_basis) ----------------


def test_a_finished_step_frees_its_budget_only_when_its_weights_are_published():
    b = LogBuilder(window=1, groups_per_step=2).start()
    b.group("g1").group("g2").begin_step().microbatch(["g1", "g2"]).finish_step().admit("g3")
    state = b.fold()
    gate = dict(dispatch_version=0, window=1, groups_per_step=2, capacity=3)
    assert policies.live_groups(state) == 1 and policies.consumed_since_publish(state) == 2
    assert policies.admission(state, **gate).allowed  # live: 1 < 3, lag 1 + 1 // 2 - 0 <= 1
    got = policies.admission(state, **gate, basis="per_version")
    assert not got.allowed
    assert got.reason == "version budget spent (3/3: 1 live groups, 2 trained since the last publish)"
    state = b.publish(1).fold()
    assert policies.budget_count(state, "per_version") == 1
    assert policies.admission(state, **{**gate, "dispatch_version": 1}, basis="per_version").allowed


def test_claimed_groups_hold_their_budget_under_either_basis():
    b = LogBuilder(window=1, groups_per_step=2).start().group("g1").group("g2").group("g3")
    state = b.begin_step().microbatch(["g1", "g2"]).fold()
    for basis in ("live", "per_version"):
        assert policies.budget_count(state, basis) == 3
        got = policies.admission(state, dispatch_version=0, window=1, groups_per_step=2,
                                 capacity=3, basis=basis)
        assert not got.allowed, basis


def test_steps_finished_behind_the_publish_count_until_theirs_lands():
    b = LogBuilder(window=2, groups_per_step=2).start().group("g1").group("g2").group("g3")
    b.group("g4").train_step(["g1", "g2"], 2).train_step(["g3", "g4"], 2)
    assert policies.consumed_since_publish(b.fold()) == 4
    assert policies.consumed_since_publish(b.publish(1).fold()) == 2
    assert policies.consumed_since_publish(b.publish(2).fold()) == 0


@pytest.mark.parametrize("groups_per_step", [4, 16, 512])
@pytest.mark.parametrize("threshold", [0.0, 0.1, 0.5, 1.0, 1.5, 2.0, 2.75])
def test_a_window_of_ceil_threshold_leaves_the_budget_to_close_the_gate(groups_per_step, threshold):
    """docs/scale.md's porting rule: with window = ceil(staleness_threshold) every group
    verl's budget allows after a sync is admitted (the lag clause never binds first); a
    window one smaller would refuse some of them once the threshold is over 1."""
    g = groups_per_step
    cap = int(g * (1 + threshold))  # verl's max_required_samples, in groups
    window = math.ceil(threshold)

    def admits_all(win: int) -> bool:
        return all(policies.gate_open(live, 3, dispatch_version=3, window=win, groups_per_step=g,
                                      capacity=cap, budgeted=live) for live in range(cap))

    assert admits_all(window)
    assert not policies.gate_open(cap, 3, dispatch_version=3, window=window, groups_per_step=g,
                                  capacity=cap, budgeted=cap)
    if threshold > 1:
        assert not admits_all(window - 1)


def test_failed_and_evicted_groups_leave_the_per_version_count_at_once():
    """Where the count departs from verl's on purpose: verl's counter only grows between
    syncs, so a sample it started would hold its room until the next one; a group that
    failed or was evicted trains nothing here, so its room is free at once."""
    b = LogBuilder(window=1, groups_per_step=2).start().admit("g1").group("g2").admit("g3")
    assert policies.budget_count(b.fold(), "per_version") == 3
    b.fail("g1").evict("g2", lag=2)
    assert policies.budget_count(b.fold(), "per_version") == 1


def test_the_per_version_count_is_verls_staleness_counter():
    """verl (FullyAsyncRollouter): at each parameter sync ``staleness_samples`` is reset to
    the samples the trainer has not fetched; each sample started adds one; fetching and
    training free nothing. With in-line publishing our count equals it after every event."""
    b = LogBuilder(window=1, groups_per_step=2).start()
    unfetched, verl = set(), 0
    script = [
        ("admit", "g1"), ("admit", "g2"), ("admit", "g3"), ("commit", "g1"), ("commit", "g2"),
        ("begin", None), ("claim", ["g1", "g2"]), ("commit", "g3"), ("finish", None),
        ("publish", None), ("admit", "g4"), ("admit", "g5"), ("commit", "g5"), ("begin", None),
        ("claim", ["g3"]), ("commit", "g4"), ("claim", ["g4"]), ("admit", "g6"),
        ("finish", None), ("publish", None), ("admit", "g7"),
    ]
    seen = []
    for op, arg in script:
        if op == "admit":
            b.admit(arg)
            unfetched.add(arg)
            verl += 1
        elif op == "commit":
            b.commit(arg)
        elif op == "claim":
            b.microbatch(arg)
            unfetched -= set(arg)
        elif op == "begin":
            b.begin_step()
        elif op == "finish":
            b.finish_step()
        else:
            b.publish()
            verl = len(unfetched)
        got = policies.budget_count(b.fold(), "per_version")
        assert got == verl, (op, arg)
        seen.append(got)
    assert seen == [1, 2, 3, 3, 3, 3, 3, 3, 3, 1, 2, 3, 3, 3, 3, 3, 3, 4, 4, 2, 3]


# -- selection -----------------------------------------------------------------------


def _mixed_log():
    # g1 admitted first but committed last; g2 started on older weights than g3.
    return (
        LogBuilder(window=2, groups_per_step=4).start()
        .admit("g1").admit("g2").admit("g3")
        .commit("g3", start=1, end=1)
        .commit("g2", start=0, end=1)
        .commit("g1", start=1, end=1)
    )


@pytest.mark.parametrize(
    "policy, limit, expected",
    [
        ("ready_first", 3, ["g3", "g2", "g1"]),
        ("ready_first", 2, ["g3", "g2"]),
        ("oldest_first", 3, ["g2", "g3", "g1"]),
        ("in_order", 3, ["g1", "g2", "g3"]),
        ("in_order", 0, []),
    ],
)
def test_selection_orders(policy, limit, expected):
    assert policies.select(_mixed_log().fold(), policy, limit) == expected


def test_in_order_waits_for_the_head_of_line():
    state = (
        LogBuilder(window=1, groups_per_step=2).start()
        .admit("g1").admit("g2").commit("g2")
    ).fold()
    assert policies.select(state, "in_order", 2) == []
    assert policies.select(state, "ready_first", 2) == ["g2"]


def test_in_order_skips_groups_claimed_by_the_open_step():
    state = (
        LogBuilder(window=1, groups_per_step=4).start()
        .admit("g1").commit("g1").admit("g2").commit("g2").admit("g3").commit("g3")
        .begin_step().microbatch(["g1"])
    ).fold()
    assert policies.select(state, "in_order", 2) == ["g2", "g3"]


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="unknown selection policy 'newest'"):
        policies.select(_mixed_log().fold(), "newest", 1)  # type: ignore[arg-type]


# -- eviction ------------------------------------------------------------------------


def test_eviction_of_groups_past_the_window():
    state = (
        LogBuilder(window=1, groups_per_step=1).start()
        .admit("g1").commit("g1", start=0, end=0)
        .admit("g2").commit("g2", start=0, end=0)
        .admit("g3").commit("g3", start=0, end=0)
        .begin_step().microbatch(["g1"]).finish_step()
        .begin_step().microbatch(["g2"]).finish_step()
    ).fold()
    assert state.trainer_version == 2
    assert policies.to_evict(state, trainer_version=2, window=1) == [("g3", 2)]
    assert policies.to_evict(state, trainer_version=2, window=2) == []


# -- the train side's plan -----------------------------------------------------------

AT = Stamp(epoch=3, ts=123.5, position=40)


def _buffered_at_v2() -> LogBuilder:
    """Trainer at v2 (two 1-group steps); g3 started at v0 (lag 2), g4 at v1, g5 at v2."""
    return (
        LogBuilder(window=1, groups_per_step=1).start()
        .group("g1", start=0, end=0).group("g2", start=0, end=0)
        .group("g3", start=0, end=0)
        .begin_step().microbatch(["g1"]).finish_step().publish()
        .group("g4", start=1, end=1)
        .begin_step().microbatch(["g2"]).finish_step().publish()
        .group("g5", start=2, end=2)
    )


@pytest.mark.parametrize(
    "name, build, window, selection, per_step, per_mb, want, evicted, ids",
    [
        ("nothing buffered: wait for a full microbatch",
         lambda: LogBuilder(window=1, groups_per_step=4).start().admit("g1"),
         1, "in_order", 4, 2, 2, [], []),
        ("a full microbatch in admission order",
         lambda: LogBuilder(window=1, groups_per_step=4).start().group("g1").group("g2").group("g3"),
         1, "in_order", 4, 2, 2, [], ["g1", "g2"]),
        ("the claimed part of the open step shrinks the next microbatch",
         lambda: LogBuilder(window=1, groups_per_step=3).start().group("g1").group("g2")
         .group("g3").begin_step().microbatch(["g1", "g2"]),
         1, "in_order", 3, 2, 1, [], ["g3"]),
        ("a full step wants nothing more",
         lambda: LogBuilder(window=1, groups_per_step=2).start().group("g1").group("g2")
         .group("g3").begin_step().microbatch(["g1", "g2"]),
         1, "in_order", 2, 2, 0, [], []),
        ("too stale for the window: evicted first, never selected",
         _buffered_at_v2, 1, "in_order", 2, 2, 2, [("g3", 2)], ["g4", "g5"]),
        ("window 0 keeps only groups of the current version",
         _buffered_at_v2, 0, "ready_first", 2, 2, 2, [("g3", 2), ("g4", 1)], ["g5"]),
        ("in_order waits for the oldest admitted group",
         lambda: LogBuilder(window=1, groups_per_step=2).start().admit("g1").group("g2"),
         1, "in_order", 2, 1, 1, [], []),
        ("ready_first takes what is committed",
         lambda: LogBuilder(window=1, groups_per_step=2).start().admit("g1").group("g2"),
         1, "ready_first", 2, 1, 1, [], ["g2"]),
    ],
)
def test_plan_microbatch(name, build, window, selection, per_step, per_mb, want, evicted, ids):
    state = build().fold()
    plan = policies.plan_microbatch(
        state, window=window, selection=selection, groups_per_step=per_step,
        groups_per_microbatch=per_mb, at=AT,
    )
    assert plan.want == want, name
    assert [(e.group_id, e.lag) for e in plan.evictions] == evicted, name
    assert list(plan.group_ids) == ids, name
    assert plan.ready is (len(ids) == want), name


def test_plan_evictions_are_ready_made_events():
    """The plan's evictions go to the log as they are: canonical ids, the caller's stamp,
    and a reason naming the lag and the window; applied, they leave the selection valid."""
    state = _buffered_at_v2().fold()
    plan = policies.plan_microbatch(
        state, window=0, selection="in_order", groups_per_step=2, groups_per_microbatch=2, at=AT,
    )
    assert plan.evictions == (
        ev.GroupEvicted(event_id="group:g3:evicted", epoch=3, ts=123.5, group_id="g3",
                        reason="lag 2 > window 0", lag=2),
        ev.GroupEvicted(event_id="group:g4:evicted", epoch=3, ts=123.5, group_id="g4",
                        reason="lag 1 > window 0", lag=1),
    )
    for event in plan.evictions:  # the epoch of the log that built the state
        reducer.apply_event(state, msgspec.structs.replace(event, epoch=state.epoch),
                            state.position + 1)
    assert [g for g in state.buffer] == ["g5"]


# -- advantages ----------------------------------------------------------------------


def test_group_advantages_are_normalised_within_the_group():
    adv, zero = policies.group_advantages([1.0, 0.0, 1.0, 0.0])
    assert not zero
    assert adv == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)


def test_zero_variance_group_has_exactly_zero_advantages():
    adv, zero = policies.group_advantages([0.5, 0.5, 0.5])
    assert zero and adv == [0.0, 0.0, 0.0]
