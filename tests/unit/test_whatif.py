"""What-if: re-running the policies over a recorded log.

The recorded logs come from a simulation that drives ``controller.core.policies`` the way
``controller.loop`` does (admission gate, evict-then-select per microbatch, selection
re-checked after every event, aborts), so "what-if with the recorded settings gives the
recorded batches" is tested against the loop's own decision procedure.
"""

from __future__ import annotations

import random

import pytest

from controller.config import load_config
from controller.core import policies
from controller.core.fold import fold
from controller.core.reducer import apply
from controller.core.segments import InflightSegments, record_flush
from controller.core.state import initial_state
from events.memory_store import MemoryEventStore
from events.schema import Segment, SegmentsRecorded
from replay import whatif
from replay.whatif_sim import _moved_runs
from sim.harness import SimSpec
from sim.harness import simulate as simulate_run
from sim.timings import Lognormal, SyntheticTimings
from tests.unit.log_builder import LogBuilder


def loop_like_run(
    seed: int, *, policy: str, window: int, gps: int = 4, gpm: int = 2, steps: int = 25,
    p_fail: float = 0.05, p_abort: float = 0.05,
) -> LogBuilder:
    rng = random.Random(seed)
    b = LogBuilder(run_id=f"loop-{seed}", window=window, groups_per_step=gps, samples_per_group=2)
    state = initial_state()

    def sync() -> None:
        for stored in b.events[state.position:]:
            apply(state, stored)

    config = {"staleness": {"selection": policy, "window_versions": window},
              "train": {"groups_per_step": gps, "groups_per_microbatch": gpm}}
    b.start(config=config)
    sync()
    capacity = gps * (window + 1)
    in_flight: list[str] = []
    retry: list[str] = []
    t = {"phase": "select", "want": min(gpm, gps), "busy": 0, "ids": [], "claimed": 0}
    finished = 0

    def try_select() -> None:
        for gid, lag in policies.to_evict(state, trainer_version=state.trainer_version, window=window):
            b.evict(gid, lag=lag)
            sync()
        ids = policies.select(state, policy, t["want"])  # type: ignore[arg-type]
        if len(ids) < t["want"]:
            return
        if state.open_step is None:
            b.begin_step()
            sync()
        t.update(phase="train", ids=ids, busy=rng.randint(0, 3))

    def trainer_tick() -> int:
        if t["phase"] == "select":
            try_select()
        elif t["busy"] > 0:
            t["busy"] -= 1
        elif t["phase"] == "train":
            if rng.random() < p_abort:
                b.abort_step("trainer error")
                sync()
                t.update(phase="select", want=min(gpm, gps), claimed=0)
                try_select()
                return 0
            b.microbatch(t["ids"])
            sync()
            t["claimed"] += len(t["ids"])
            if t["claimed"] < gps:
                t.update(phase="select", want=min(gpm, gps - t["claimed"]))
                try_select()
            else:
                t.update(phase="finish", busy=rng.randint(0, 2))
        else:  # finish
            b.finish_step()
            b.publish()
            sync()
            t.update(phase="select", want=min(gpm, gps), claimed=0)
            try_select()
            return 1
        return 0

    n = 0
    while finished < steps:
        r = rng.random()
        gate = policies.admission(state, dispatch_version=state.weight_version, window=window,
                                  groups_per_step=gps, capacity=capacity)
        if r < 0.45 and gate.allowed:
            if retry:
                gid = retry.pop(0)
            else:
                gid, n = f"g{n:05d}", n + 1
            b.admit(gid)
            in_flight.append(gid)
        elif r < 0.9 and in_flight:
            gid = in_flight.pop(rng.randrange(len(in_flight)))
            if rng.random() < p_fail:
                b.fail(gid)
                retry.append(gid)
            else:
                b.commit(gid)
        sync()
        finished += trainer_tick()
    return b


def _pairs(b: LogBuilder):
    return [(s.position, s.event) for s in b.events]


CASES = [(seed, policy, window) for seed in (0, 1, 2)
         for policy in policies.SELECTION_POLICIES for window in (0, 1, 2)]


@pytest.mark.parametrize("seed, policy, window", CASES)
def test_recorded_settings_reproduce_recorded_batches_exactly(seed, policy, window):
    b = loop_like_run(seed, policy=policy, window=window)
    state = fold(b.events)
    settings = whatif.recorded_settings(state)
    got = settings.summary()
    assert got["staleness.selection"] == policy and got["staleness.window_versions"] == window
    assert got["train.groups_per_microbatch"] == 2
    result = whatif.simulate(_pairs(b), settings)
    recorded = whatif.recorded_batches(state)
    got = {s.step: s.microbatches for s in result.finished()}
    assert got == recorded
    aborted = [s.step for s in result.steps if s.status == "aborted"]
    assert aborted == [s.step for s in state.steps.values() if s.status.value == "aborted"]
    cmp = whatif.compare(state, result)
    assert cmp["steps"]["different"] == 0
    assert cmp["recorded"]["lag_mean"] == cmp["what_if"]["lag_mean"]
    assert result.lateness_s == 0.0
    assert result.stopped == "end of log"


def test_smaller_window_removes_lag_and_evicts_more():
    b = loop_like_run(3, policy="ready_first", window=2, steps=40)
    state = fold(b.events)
    base = whatif.recorded_settings(state)
    recorded = whatif.compare(state, whatif.simulate(_pairs(b), base))
    assert recorded["recorded"]["lag_max"] == 2  # the run did use its window
    for window in (0, 1):
        cmp = whatif.compare(
            state, whatif.simulate(_pairs(b), whatif.what_if_settings(state, [f"window={window}"]))
        )
        assert cmp["what_if"]["lag_max"] <= window
        assert cmp["what_if"]["lag_mean"] < recorded["recorded"]["lag_mean"]
        assert cmp["what_if"]["evicted"] > cmp["recorded"]["evicted"]
        assert cmp["steps"]["different"] > 0


def test_bigger_window_keeps_groups_that_were_evicted():
    # window 0, one group per step: g2 (generated at v0) is evicted once v1 exists.
    b = LogBuilder(window=0, groups_per_step=1).start(
        config={"staleness": {"selection": "in_order"}, "train": {"groups_per_microbatch": 1}}
    )
    b.group("g1").group("g2").train_step(["g1"]).publish()
    b.evict("g2", lag=1).group("g3").train_step(["g3"]).publish()
    state = fold(b.events)
    base = whatif.recorded_settings(state)
    same = whatif.compare(state, whatif.simulate(_pairs(b), base))
    assert same["steps"]["identical"] == 2 and same["what_if"]["evicted"] == 1
    wider = whatif.simulate(_pairs(b), whatif.what_if_settings(state, ["window=1"]))
    cmp = whatif.compare(state, wider)
    assert cmp["recorded"]["evicted"] == 1 and cmp["what_if"]["evicted"] == 0
    assert [s.group_ids for s in wider.finished()] == [["g1"], ["g2"]]
    assert [s.lags for s in wider.finished()] == [[0], [1]]
    assert cmp["what_if"]["lag_max"] == 1 and cmp["recorded"]["lag_max"] == 0


def test_policy_change_changes_composition_not_group_set_size():
    b = loop_like_run(5, policy="in_order", window=1, steps=30, p_abort=0.0)
    state = fold(b.events)
    base = whatif.recorded_settings(state)
    result = whatif.simulate(_pairs(b), whatif.what_if_settings(state, ["policy=oldest_first"]))
    assert all(len(s.group_ids) == 4 for s in result.finished())
    assert all(0 <= lag <= 1 for s in result.finished() for lag in s.lags)


@pytest.mark.parametrize("item, message", [
    ("window=-1", "staleness.window_versions must be >= 0"),
    ("window=x", "staleness.window_versions: Expected `int`"),
    ("policy=random", "choose one of"),
    ("microbatch=0", "train.groups_per_microbatch must be > 0"),
    ("speed=3", "key one of"),
    ("window", "key one of"),
    # known keys this what-if cannot replay point to the one that can
    ("generators=4", r"rollout.num_generators is not replayed .*`rl-controller simulate --run RUN "
                     r"--what-if generators=4"),
    ("budget_basis=per_version", r"staleness.budget_basis is not replayed .* simulate"),
])
def test_bad_what_if_names_the_key(item, message):
    state = fold(LogBuilder(window=1, groups_per_step=4).start().events)
    with pytest.raises(whatif.WhatIfError, match=message):
        whatif.what_if_settings(state, [item])


@pytest.mark.parametrize("table", ["train", "staleness", "rollout", "checkpoint"])
def test_a_recorded_table_that_is_not_a_table_is_a_config_error(table):
    # a tampered RunStarted: the loader's one line, not a TypeError from filling it in
    from controller.config import ConfigError
    from replay.settings import recorded_config

    state = fold(LogBuilder(window=1, groups_per_step=4).start(config={table: 5}).events)
    with pytest.raises(ConfigError) as err:
        recorded_config(state)
    assert str(err.value) == (f"run 'run-test': its recorded config does not load: config (log): "
                              f"{table}: Expected `object`, got `int`")


def test_what_if_stops_at_a_rewind():
    b = LogBuilder(window=1, groups_per_step=1).start().checkpoint()
    b.group("g1").train_step(["g1"]).publish().checkpoint().group("g2").train_step(["g2"]).rewind(1)
    b.group("g3").train_step(["g3"])
    state = fold(b.events)
    result = whatif.simulate(_pairs(b), whatif.recorded_settings(state))
    assert result.stopped.startswith("RunRewound at position")
    assert [s.group_ids for s in result.finished()] == [["g1"], ["g2"]]


def test_what_if_never_reports_a_negative_lag():
    """A group admitted at v1 whose generation started only after v2 was published
    (the last group of a several-group call) records weight_version_start 2 > the
    trainer_version at its admission. With window=0 the what-if trainer stays at v1
    waiting for it; it must not train it at a lag of -1 (on a 6-step default run this
    printed ``lag_mean -0.062`` next to ``lag_max 0``)."""
    b = LogBuilder(run_id="neg-lag", window=1, groups_per_step=1, samples_per_group=2)
    b.start(config={"staleness": {"selection": "in_order", "window_versions": 1},
                    "train": {"groups_per_step": 1, "groups_per_microbatch": 1}})
    b.admit("a").admit("b").commit("a", start=0, end=0)
    b.begin_step().microbatch(["a"]).finish_step().publish()
    b.commit("b", start=0, end=0).admit("c")
    b.begin_step().microbatch(["b"]).finish_step().publish()
    b.commit("c", start=2, end=2).admit("d")
    b.begin_step().microbatch(["c"]).finish_step().publish()
    b.commit("d", start=3, end=3)
    state = fold(b.events)
    assert [g.lag for g in map(state.groups.get, "abc")] == [0, 1, 0]  # the recorded run

    base = whatif.recorded_settings(state)
    assert whatif.simulate(_pairs(b), base).finished()  # sanity: the baseline trains
    result = whatif.simulate(_pairs(b), whatif.what_if_settings(state, ["window=0"]))
    lags = [lag for step in result.finished() for lag in step.lags]
    assert lags and min(lags) >= 0, lags
    stats = whatif.compare(state, result)["what_if"]
    assert 0 <= stats["lag_mean"] <= stats["lag_max"] == 0


def test_a_smaller_window_replays_commits_whose_tokens_span_refits():
    # in-flight groups whose windows span refits commit with version_runs; the what-if
    # moves every version by the group's shift (assumption 2), the runs' included --
    # unmoved, window 0 refused such a commit ("not rising within 2..2")
    cfg = load_config(None, [
        "run.steps=6", "rollout.num_generators=4", "rollout.groups_per_call=1",
        "train.groups_per_step=2", "train.groups_per_microbatch=2",
        "rollout.partial.enabled=true", "rollout.partial.segment_tokens=16",
        "rollout.samples_per_group=2"])
    timings = SyntheticTimings(generation=Lognormal(20.0, 0.8), train_per_sequence_s=0.05,
                               finish=1.0, publish=2.0, checkpoint=5.0, seed=5,
                               tokens_per_sample=64, lengths_follow_time=True)
    store = MemoryEventStore()
    simulate_run(store, SimSpec(config=cfg, timings=timings, run_id="rf"))
    stored = list(store.read("rf"))
    assert any(s.event.version_runs for s in stored if type(s.event).__name__ == "GroupCommitted")
    state = fold(stored)
    pairs = [(s.position, s.event) for s in stored]
    recorded = whatif.simulate(pairs, whatif.recorded_settings(state))
    assert recorded.stopped == "end of log"
    result = whatif.simulate(pairs, whatif.what_if_settings(state, ["window=0"]))
    assert max((lag for s in result.steps for lag in s.lags), default=0) == 0  # and no violation


def test_moved_runs_keep_recorded_tokens_at_their_flushes_versions():
    rec = InflightSegments.empty(2, 1)
    flush = SegmentsRecorded(epoch=1, ts=0.0, event_id="f", group_id="g", attempt=1, index=0,
                             kind="model", weight_version=0,
                             segments=[Segment(sample=0, start=0, length=3, key="k")])
    record_flush(rec, flush)  # recorded at v3 by the run, moved to v0 when it was applied
    moved = lambda v: max(0, v - 2)  # noqa: E731
    # sample 0: 3 recorded tokens (v3, moved then to v0), then v3 x2, v4 x1, v5 x4
    assert _moved_runs([3, 5, 4, 1, 5, 4], moved, rec, 0) == [0, 3, 1, 2, 2, 1, 3, 4]
    # sample 1: nothing recorded; v1 and v2 both move to v0 (one run), v3 to v1
    assert _moved_runs([1, 2, 2, 3, 3, 1], moved, rec, 1) == [0, 5, 1, 1]
