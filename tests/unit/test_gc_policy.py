"""The collector policy (``controller.gc``): applied only when configured, undone at the
loop's end, dropped records still freed, frozen cycles found by the doubling sweep."""

from __future__ import annotations

import gc
import weakref

import pytest

from controller.config import ConfigError, load_config
from controller.gc_policy import SWEEP_GROWTH, Collector
from events.memory_store import MemoryEventStore
from sim.harness import SimSpec, simulate
from sim.timings import Lognormal, SyntheticTimings


class Record:
    """A plain, weak-referenceable record (the state's own are untracked structs)."""

    def __init__(self, payload: dict) -> None:
        self.payload = payload
        self.me = None


@pytest.fixture
def collector():
    assert gc.get_freeze_count() == 0  # nothing else in this process freezes
    c = Collector("freeze")
    c.start()
    try:
        yield c
    finally:
        c.stop()
        assert gc.get_freeze_count() == 0
        gc.collect()
        c.after_append()  # the writer appends after the loop (RunFinished): no freeze
        assert gc.get_freeze_count() == 0


def test_default_leaves_the_collector_alone():
    c = Collector("default")
    c.start()
    gc.collect()
    c.after_append()
    c.step_boundary()
    assert gc.get_freeze_count() == 0
    c.stop()
    assert c.stats.freezes == c.stats.sweeps == 0


def test_freeze_freezes_the_state_and_each_full_collections_survivors(collector):
    assert collector.stats.sweeps == 1 and collector.stats.frozen > 0 and gc.get_freeze_count() > 0
    before = gc.get_freeze_count()
    kept = [[i] for i in range(5000)]  # lists: always tracked (an atomic dict is not)
    collector.after_append()
    assert gc.get_freeze_count() < before + len(kept), "no full collection: nothing new to freeze"
    gc.collect()  # as the interpreter's own full collections do
    collector.after_append()
    assert gc.get_freeze_count() >= before + len(kept)
    assert collector.stats.freezes == 1


def test_a_dropped_record_is_freed_though_frozen(collector):
    state = {i: Record({"rewards": [0.5] * 16}) for i in range(100)}
    gc.collect()
    collector.after_append()  # frozen now
    assert gc.is_tracked(state[0]) and gc.get_freeze_count() > 100
    dropped = weakref.ref(state.pop(7))
    assert dropped() is None  # reference counting, no collection needed


def test_a_frozen_cycle_waits_for_the_doubling_sweep(collector):
    cycle = Record({})
    cycle.me = cycle
    ref = weakref.ref(cycle)
    gc.collect()
    collector.after_append()  # the cycle is alive: frozen with the survivors
    del cycle
    gc.collect()
    assert ref() is not None  # frozen cyclic garbage: no collection sees it
    collector.step_boundary()
    assert ref() is not None, "a boundary before the heap doubled sweeps nothing"
    grown = [[i] for i in range(SWEEP_GROWTH * gc.get_freeze_count())]
    gc.collect()
    collector.after_append()
    collector.step_boundary()
    assert ref() is None and collector.stats.sweeps == 2
    assert gc.get_freeze_count() >= len(grown)


def _sim(policy: str):
    cfg = load_config(None, [
        "run.steps=3", "rollout.num_generators=4", "rollout.groups_per_call=1",
        "train.groups_per_step=4", "train.groups_per_microbatch=2", f"controller.gc={policy}",
    ])
    timings = SyntheticTimings(generation=Lognormal(20.0, 0.8), train_per_sequence_s=0.05,
                               finish=1.0, publish=2.0, checkpoint=5.0, seed=1)
    return simulate(MemoryEventStore(), SimSpec(config=cfg, timings=timings, run_id="gc"))


def test_the_controller_loop_applies_the_configured_policy():
    frozen = _sim("freeze")
    assert frozen.collector.sweeps >= 1 and frozen.collector.frozen > 0
    assert gc.get_freeze_count() == 0, "the loop's end unfreezes"
    plain = _sim("default")
    assert plain.collector.sweeps == plain.collector.freezes == 0
    assert plain.collector.frozen == 0
    # the policy changes no decision: the same schedule either way
    assert frozen.events == plain.events and frozen.virtual_s == plain.virtual_s


def test_a_bad_policy_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"controller\.gc: Invalid enum value 'off'"):
        load_config(None, ["controller.gc=off"])
