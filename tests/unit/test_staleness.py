"""Staleness analysis and plots over hand-built logs with known lags, waits and evictions."""

from __future__ import annotations

import pytest

from controller.core.state import StepStatus
from replay import staleness
from replay.plots import plot_data, write_plot
from controller.projector import Projector
from tests.unit.log_builder import LogBuilder
from tests.unit.random_log import random_run
from tests.unit.test_audit import store_of


def analyze(b: LogBuilder) -> staleness.StalenessReport:
    trace = staleness.Trace()
    result = Projector(store_of(b)).get(b.run_id, observers=[trace])
    assert result.problem is None
    return staleness.analyze(result.state, trace)


def _two_steps() -> LogBuilder:
    """window 2, two groups per step; step 1 trains g3 at lag 1 (start 0) and g4 at lag 0."""
    b = LogBuilder(window=2, groups_per_step=2, dt=1.0, t0=0.0).start()
    b.group("g1").group("g2")                                   # positions 3..6
    b.admit("g3")                                               # dispatched at v0
    b.train_step(["g1", "g2"], microbatch_groups=2).publish()   # v1
    b.commit("g3", start=0, end=1, lengths=[10, 10])            # crossed the update
    b.admit("g4").commit("g4", lengths=[30, 30])                # start 1
    b.train_step(["g3", "g4"], microbatch_groups=1).publish()
    return b


def test_per_step_lag_wait_and_crossing():
    b = _two_steps()
    report = analyze(b)
    s0, s1 = report.steps
    assert (s0.lag_mean, s0.lag_max, s0.crossed_update) == (0.0, 0, 0)
    assert (s1.lag_mean, s1.lag_max) == (0.5, 1)
    assert s1.lag_token_weighted == pytest.approx((1 * 20 + 0 * 60) / 80)
    assert s1.crossed_update == 1
    assert report.gate_method.startswith("gate closed while live groups >= capacity or ")
    # waits: commit ts -> ts of the microbatch that trained the group (ts = position)
    state = b.fold()
    pos = {e.event.group_id: e.position for e in b.events if type(e.event).__name__ == "GroupCommitted"}
    mbs = [e for e in b.events if type(e.event).__name__ == "MicrobatchTrained"]
    assert s0.wait_max_s == mbs[0].position - pos["g1"]
    assert s1.wait_mean_s == pytest.approx(((mbs[1].position - pos["g3"]) + (mbs[2].position - pos["g4"])) / 2)
    assert report.summary["groups_consumed"] == 4
    assert report.summary["crossed_update"] == 1
    assert report.lag_histogram == {0: 3, 1: 1}
    assert state.steps[1].status is StepStatus.FINISHED


def test_evictions_are_counted_in_the_step_they_delayed():
    b = LogBuilder(window=0, groups_per_step=1).start()
    b.group("g1").group("g2").train_step(["g1"]).publish()
    b.evict("g2", lag=1).group("g3").train_step(["g3"]).publish()
    report = analyze(b)
    assert [s.evicted for s in report.steps] == [0, 1]
    assert report.summary["evicted"] == 1


def test_gate_closed_time_from_live_groups():
    # capacity = 1 * (0 + 1) = 1: closed from g1's admission (buffer full), then from
    # StepFinished until v1 is published (generators behind: window closed).
    b = LogBuilder(window=0, groups_per_step=1, dt=1.0, t0=0.0).start()
    b.admit("g1")                   # pos 3, ts 3: live 1 -> closed
    b.commit("g1")                  # pos 4
    b.train_step(["g1"])            # pos 5..7: consumed at ts 7, but v1 not published
    b.publish()                     # pos 8: open
    b.admit("g2")                   # pos 9: closed again (not counted: nothing after it)
    report = analyze(b)
    assert report.summary["gate_closed_s"] == pytest.approx(8 - 3)
    assert report.summary["observed_span_s"] == pytest.approx(9 - 3)
    assert report.capacity == 1


def test_capacity_comes_from_the_config_when_set():
    b = LogBuilder(window=1, groups_per_step=2).start(config={"staleness": {"buffer_groups": 9}})
    assert staleness.capacity_of(b.fold()) == 9
    assert staleness.capacity_of(LogBuilder(window=1, groups_per_step=2).start().fold()) == 4


def test_plot_data_and_png(tmp_path):
    b = random_run(3, 25)
    report = analyze(b)
    data = plot_data(report)
    state = b.fold()
    finished = [s for s in state.steps.values() if s.status is StepStatus.FINISHED]
    assert len(data["lag_per_step"]["step"]) == len(finished) == 25
    assert len(data["reward_vs_lag"]["lag"]) == sum(len(s.group_ids) for s in finished)
    assert 0 < len(data["occupancy"]["t_s"]) == len(data["occupancy"]["live"])
    assert max(data["occupancy"]["live"]) <= report.capacity
    out = write_plot(report, tmp_path / "sub" / "staleness.png")
    assert out.exists() and out.stat().st_size > 10_000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_a_lag_whose_mean_is_outside_its_interquartile_range(tmp_path):
    """A converged run: nearly every group at reward 1.0, so q25 = q75 = 1.0 above the
    mean (this raised matplotlib's "yerr must not contain negative values")."""
    report = analyze(random_run(3, 25))
    report.reward_vs_lag = [(0, 1.0)] * 30 + [(0, 0.0), (1, 1.0), (1, 1.0), (1, 0.2)]
    by_lag = plot_data(report)["reward_by_lag"]
    assert by_lag["mean"][0] < by_lag["q25"][0] == by_lag["q75"][0] == 1.0
    out = write_plot(report, tmp_path / "converged.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_occupancy_is_downsampled_to_the_limit():
    b = random_run(4, 60)
    trace = staleness.Trace()
    result = Projector(store_of(b)).get(b.run_id, observers=[trace])
    report = staleness.analyze(result.state, trace, max_points=50)
    assert len(report.occupancy) <= 50 < len(trace.ts)


def test_report_is_json_ready():
    import msgspec

    report = analyze(_two_steps())
    data = msgspec.json.decode(msgspec.json.encode(report.to_dict()))
    assert data["summary"]["lag_max"] == 1
    assert data["lag_histogram"] == {"0": 3, "1": 1}


def test_plot_summaries_per_lag_mean_and_bounded_occupancy_bins():
    from replay.plots import OCCUPANCY_BINS, bin_occupancy, reward_by_lag

    by_lag = reward_by_lag([(0, 0.2), (1, 1.0), (0, 0.4), (1, 0.0), (1, 0.5)])
    assert by_lag["lag"] == [0, 1] and by_lag["count"] == [2, 3]
    assert by_lag["mean"] == pytest.approx([0.3, 0.5])
    assert by_lag["q25"][1] == pytest.approx(0.25) and by_lag["q75"][1] == pytest.approx(0.75)
    t = [i * 0.01 for i in range(10_000)]
    live = [i % 7 for i in range(10_000)]
    binned = bin_occupancy(t, live, [0] * 10_000)
    assert 0 < len(binned["t_s"]) <= OCCUPANCY_BINS
    assert min(binned["live_min"]) == 0 and max(binned["live_max"]) == 6
    assert bin_occupancy([5.0], [3], [1])["live_mean"] == [3]
    report = analyze(random_run(4, 200))
    data = plot_data(report)
    assert len(data["occupancy_binned"]["t_s"]) <= OCCUPANCY_BINS
    assert sum(data["reward_by_lag"]["count"]) == len(data["reward_vs_lag"]["lag"])


def test_the_lag_panel_has_each_token_at_its_own_version(tmp_path):
    """g1's samples record 4 tokens each at v0, then sample 0 runs 2 more at v2 (a flush
    at every refit): trained at base 2, the group's lag is 2 but its 10 tokens' mean is
    (8 x 2 + 2 x 0) / 10, and sample 0 spans v0..v2."""
    b = LogBuilder(window=3, groups_per_step=1, samples_per_group=2, dt=1.0, t0=0.0).start()
    b.group("w0").train_step(["w0"]).publish()  # v1
    b.admit("g1", weight_version=0).flush("g1", {0: (0, 4), 1: (0, 4, True)}, version=0)
    b.group("w1").train_step(["w1"]).publish()  # v2
    b.commit("g1", start=0, end=2, lengths=[6, 4])
    b.train_step(["g1"]).publish()
    data = plot_data(analyze(b))["lag_per_step"]
    assert data["step"][-1] == 2 and data["lag_max"][-1] == 2
    assert data["token_lag_mean"][-1] == pytest.approx(16 / 10)
    assert data["max_partial_span"] == [0, 0, 2]
    assert write_plot(analyze(b), tmp_path / "s.png").stat().st_size > 10_000


@pytest.mark.parametrize("basis", ["live", "per_version"])
@pytest.mark.parametrize("seed", [0, 1, 3])  # runs with rewinds among the rest
def test_the_gate_trace_is_the_gate_over_random_runs(seed, basis):
    """Through failures, evictions, aborted steps, restarts and rewinds, the trace's
    gate (its own count of claimed groups, the recorded basis) is the controller's gate
    on the folded state after every event it samples."""
    import msgspec

    from controller.core import policies

    # window 2: a step finished and not yet published leaves the lag clause room, so only
    # the per-version budget (8 groups, 4 per step) closes the gate there
    b = random_run(seed, 30, window=2, p_rewind=0.05, p_restart=0.05, p_abort=0.05)
    first = b.events[0]
    capacity = 8 if basis == "per_version" else 12
    config = {**first.event.config,
              "staleness": {"budget_basis": basis, "buffer_groups": capacity}}
    b.events[0] = msgspec.structs.replace(first, event=msgspec.structs.replace(first.event, config=config))
    trace, checked, disagreements = staleness.Trace(), [], []

    class Judge:
        def watches(self):
            def check(event, position, state):
                gate = policies.admission(
                    state, dispatch_version=state.weight_version, window=state.window_versions,
                    groups_per_step=state.groups_per_step, capacity=capacity, basis=basis)
                checked.append(position)
                if bool(trace.gate_closed[-1]) == gate.allowed:
                    disagreements.append((position, type(event).__name__, gate.reason))
            return {cls: check for cls in trace.watches()}

    result = Projector(store_of(b)).get(b.run_id, observers=[trace, Judge()])
    assert result.problem is None and result.state.rewinds
    assert disagreements == [] and len(checked) == len(trace.gate_closed) > 100
    assert any(trace.gate_closed)


def test_the_gate_line_says_what_each_budget_basis_counts_against_capacity():
    """Each ``staleness.budget_basis`` has its own line, built from what it counts."""
    from typing import get_args

    from controller.core.policies import BudgetBasis
    from replay.staleness import CAPACITY_COUNTS, describe_gate

    assert set(CAPACITY_COUNTS) == set(get_args(BudgetBasis))
    rest = ("capacity or trainer_version + live // groups_per_step - weight_version > window, "
            "evaluated after each event that changes them (generator availability is not in "
            "the log and not counted)")
    assert describe_gate("live") == "gate closed while live groups >= " + rest
    assert describe_gate("per_version") == (
        "gate closed while live groups + groups trained since the last publish >= " + rest)


def test_steps_a_rewind_discarded_are_not_counted_as_finished():
    # after run --resume --rewind-to-checkpoint the summary said 2 steps finished while
    # the run's version (and audit's steps_finished) counted 1
    b = LogBuilder(window=1, groups_per_step=1).start().checkpoint()
    b.group("g1").train_step(["g1"]).publish().checkpoint()
    b.group("g2").train_step(["g2"]).publish().rewind(1, reason="payloads lost")
    report = analyze(b)
    assert [s.lost for s in report.steps] == [False, True]
    assert (report.summary["steps_finished"], report.summary["steps_lost"]) == (1, 1)
