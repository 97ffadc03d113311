"""``controller.publish = "behind"``: a version published behind the next step, in virtual time.

The trainer's weights change only at ``finish_train_step``, so the train pump publishes
version v while the next step begins and trains, and that step's finish waits for the
publish. The real controller runs on the virtual clock with fixed durations -- generation
0.5 s, one 5 s microbatch per step, finish 1 s, publish P -- so every figure below is
known by hand:

* in line, a step takes microbatch + finish + publish: 5 + 1 + P;
* behind the next step, it takes max(microbatch, publish) + finish: the publish hides
  under the microbatch when P <= 5, and the finish waits for the rest when P > 5.
"""

from __future__ import annotations

import pytest

from controller.config import load_config
from events import schema as ev
from events.memory_store import MemoryEventStore
from sim.harness import SimSpec, simulate
from sim.timeline import timeline_of
from sim.timings import Lognormal, SyntheticTimings

STEPS = 6
MICROBATCH_S, FINISH_S = 5.0, 1.0


def _run(publish_s: float, overlap: bool):
    cfg = load_config(None, [
        f"run.steps={STEPS}", "rollout.num_generators=8", "rollout.groups_per_call=1",
        "train.groups_per_step=4", "train.groups_per_microbatch=4",
        "staleness.window_versions=2", "checkpoint.every_steps=1000",
        f"controller.publish={'behind' if overlap else 'in_line'}",
    ])
    timings = SyntheticTimings(
        generation=Lognormal(0.5), train_per_sequence_s=0.0, microbatch_fixed_s=MICROBATCH_S,
        finish=FINISH_S, publish=publish_s,
    )
    store = MemoryEventStore()
    simulate(store, SimSpec(config=cfg, timings=timings, run_id="o"))
    return store


def _finished_ts(store) -> list[float]:
    return [s.event.ts for s in store.read("o") if isinstance(s.event, ev.StepFinished)]


@pytest.mark.parametrize("publish_s", [3.0, 10.0])
def test_a_step_takes_what_the_schedule_says(publish_s):
    behind, in_line = _run(publish_s, overlap=True), _run(publish_s, overlap=False)
    period = lambda ts: [b - a for a, b in zip(ts, ts[1:])]  # noqa: E731
    assert period(_finished_ts(in_line)) == pytest.approx(
        [MICROBATCH_S + FINISH_S + publish_s] * (STEPS - 1), abs=1e-9
    )
    assert period(_finished_ts(behind)) == pytest.approx(
        [max(MICROBATCH_S, publish_s) + FINISH_S] * (STEPS - 1), abs=1e-9
    )
    # The timeline charges the trainer only what it waited for: the whole publish in
    # line, the part the microbatch did not cover behind the next step.
    tl_behind, _ = timeline_of(behind, "o")
    tl_in_line, _ = timeline_of(in_line, "o")
    assert tl_in_line.refit_wait_s == pytest.approx(publish_s * (STEPS - 1), abs=1e-9)
    assert tl_behind.refit_wait_s == pytest.approx(
        max(0.0, publish_s - MICROBATCH_S) * (STEPS - 1), abs=1e-9
    )
    assert tl_behind.refit_s == tl_in_line.refit_s == pytest.approx(publish_s * (STEPS - 1))
    assert tl_behind.trainer_idle_s == pytest.approx(tl_in_line.trainer_idle_s, abs=1e-9)


def test_a_version_is_published_before_the_next_finish_and_after_the_next_begin():
    events = [s.event for s in _run(10.0, overlap=True).read("o")]
    finished = {e.trainer_version: i for i, e in enumerate(events) if isinstance(e, ev.StepFinished)}
    published = {e.weight_version: i for i, e in enumerate(events) if isinstance(e, ev.WeightsPublished)}
    begun = {e.step: i for i, e in enumerate(events) if isinstance(e, ev.StepBegun)}
    assert sorted(published) == list(range(STEPS + 1))  # every version, the last included
    for v in range(1, STEPS):
        # step v (base version v) began while v was being published, and finished after
        assert finished[v] < begun[v] < published[v] < finished[v + 1]
    assert finished[STEPS] < published[STEPS]  # the last version in line: a run ends published
