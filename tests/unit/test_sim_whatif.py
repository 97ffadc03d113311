"""Timing what-if: reproduce a recorded run; a wider window on a log solved by hand.

The hand-built log (window 0, 2 generators, 2 groups per step in one microbatch, one
group per call): in every step the even group generates in 10 s, the odd one in 11 s,
the microbatch trains in 8 s, finishing and refit take no time. So:

* window 0 (recorded): generate (11 s) then train (8 s): 19 s per step, lag 0;
* window 1: the odd generator never stops (11 s per group, back to back) and the
  trainer (8 s) keeps up: step k ends at 11 (k + 1) + 8, i.e. 11 S + 8 for S steps,
  every group after the first step trained one version behind (mean lag (S - 1) / S).
"""

from __future__ import annotations

import json

import pytest

from controller.config import config_to_dict, load_config
from controller.core.fold import fold_raw
from events import schema as ev
from events.memory_store import MemoryEventStore
from sim.harness import SimSpec, simulate
from sim.timeline import timeline_of
from sim.timings import Lognormal, SyntheticTimings
from sim.whatif import run_whatif

STEPS = 5


def hand_log(store, run_id: str = "hand") -> None:
    """Append the window-0 run described in the module docstring."""
    cfg = load_config(None, [
        f"run.steps={STEPS}", "rollout.num_generators=2", "rollout.groups_per_call=1",
        "rollout.samples_per_group=2", "train.groups_per_step=2",
        "train.groups_per_microbatch=2", "staleness.window_versions=0",
        "checkpoint.every_steps=1000",
    ])
    epoch = store.claim_epoch(run_id)
    t0 = 1_000.0
    events: list[ev.Event] = [
        ev.RunStarted(epoch=epoch, ts=t0, event_id=ev.run_started_id(run_id), run_id=run_id,
                      config=config_to_dict(cfg), seed=0, code_version="hand",
                      window_versions=0, groups_per_step=2, samples_per_group=2),
        ev.ControllerStarted(epoch=epoch, ts=t0, event_id=ev.controller_started_id(epoch),
                             host="h", pid=1),
        ev.WeightsPublished(epoch=epoch, ts=t0, event_id="weights:0", weight_version=0,
                            generators=["generator-0", "generator-1"]),
    ]
    for k in range(STEPS):
        start = t0 + 19 * k
        pair = [f"g{2 * k:06d}", f"g{2 * k + 1:06d}"]
        for i, gid in enumerate(pair):
            events.append(ev.RolloutAdmitted(
                epoch=epoch, ts=start, event_id=ev.group_event_id(gid, "admitted", 1),
                group_id=gid, attempt=1, prompt_index=2 * k + i, prompt_ref="p",
                weight_version=k, n_samples=2, sample_seed=0))
        for i, gid in enumerate(pair):
            events.append(ev.GroupCommitted(
                epoch=epoch, ts=start + 10 + i, event_id=ev.group_event_id(gid, "committed", 1),
                group_id=gid, attempt=1, weight_version_start=k, weight_version_end=k,
                payload_keys=[f"{gid}/0", f"{gid}/1"], rewards=[0.0, 1.0], lengths=[5, 5]))
        begun, done = start + 11, start + 19
        events += [
            ev.StepBegun(epoch=epoch, ts=begun, event_id=ev.step_event_id(k, "begun"), step=k,
                         base_trainer_version=k),
            ev.MicrobatchTrained(epoch=epoch, ts=done, event_id=ev.microbatch_event_id(k, 0),
                                 step=k, index=0, group_ids=pair, num_sequences=4, num_tokens=20),
            ev.StepFinished(epoch=epoch, ts=done, event_id=ev.step_event_id(k, "finished"), step=k,
                            trainer_version=k + 1, metrics={}, grad_norm=1.0, weights_digest="d"),
            ev.WeightsPublished(epoch=epoch, ts=done, event_id=f"weights:{k + 1}",
                                weight_version=k + 1, generators=["generator-0", "generator-1"]),
        ]
    store.append(run_id, events, expected_position=0, epoch=epoch)


def test_hand_log_is_valid_and_reads_as_described():
    store = MemoryEventStore()
    hand_log(store)
    state = fold_raw((e.position, e.data) for e in store.read_raw("hand"))
    assert state.trainer_version == STEPS
    timeline, timings = timeline_of(store, "hand")
    assert timeline.wall_s == 19 * STEPS
    assert timings.generation["g000000"] == 10 and timings.generation["g000001"] == 11
    assert timings.microbatches[0] == [8.0] and timings.finish[0] == 0.0
    assert timeline.trainer_idle_s == 11 * STEPS


def test_recorded_settings_reproduce_the_hand_log_and_a_wider_window_is_as_solved():
    store = MemoryEventStore()
    hand_log(store)
    result = run_whatif(store, "hand",
                        [{"staleness.window_versions": "1"}, {"staleness.window_versions": "2"}])
    repro = result.reproduction()
    assert repro["commit_order_identical"] and repro["batches_identical"]
    assert repro["wall_s_simulated"] == pytest.approx(19 * STEPS, abs=1e-6)
    w1 = result.scenarios[1].timeline
    assert w1.wall_s == pytest.approx(11 * STEPS + 8, abs=1e-6)
    assert sum(w1.lags) / len(w1.lags) == pytest.approx((STEPS - 1) / STEPS)
    assert max(w1.lags) == 1
    w2 = result.scenarios[2].timeline  # more room cannot beat the odd generator's pace
    assert w2.wall_s <= w1.wall_s + 1e-6 and max(w2.lags) >= 1


def test_a_simulated_run_is_reproduced_exactly():
    cfg = load_config(None, [
        "run.steps=8", "rollout.num_generators=6", "rollout.groups_per_call=2",
        "train.groups_per_step=8", "train.groups_per_microbatch=4",
        "staleness.window_versions=1", "staleness.selection=ready_first",
        "checkpoint.every_steps=4",
    ])
    timings = SyntheticTimings(generation=Lognormal(30.0, 0.7), train_per_sequence_s=0.1,
                               finish=2.0, publish=3.0, checkpoint=7.0, seed=5)
    store = MemoryEventStore()
    simulate(store, SimSpec(config=cfg, timings=timings, run_id="rec", start_s=5_000.0))
    result = run_whatif(store, "rec", [{"staleness.window_versions": "0"}])
    repro = result.reproduction()
    assert repro["commit_order_identical"] and repro["batches_identical"], repro
    assert repro["wall_relative_error"] < 1e-9
    sync = result.scenarios[1].timeline
    assert sync.wall_s > result.recorded.wall_s and max(sync.lags) == 0
    json.dumps(result.to_dict())  # the CLI's --json output


def test_a_misspelt_what_if_lists_the_short_names_and_never_mentions_set():
    from replay.settings import WhatIfError
    from sim.whatif import parse_scenario, scenario_config

    with pytest.raises(WhatIfError) as err:
        parse_scenario("windw=2")
    assert "windw" in str(err.value) and "window, " in str(err.value) and "generators" in str(err.value)
    assert "--set" not in str(err.value)
    with pytest.raises(WhatIfError) as err:
        scenario_config(load_config(None, []), parse_scenario("window=wide"), 5)
    assert str(err.value).startswith("--what-if staleness.window_versions=wide: ")
    assert "--set" not in str(err.value)
    # one key twice (a short name and its dotted key here) was silently the last value
    with pytest.raises(WhatIfError, match=r"staleness.window_versions is given twice \(1 and 2\)"):
        parse_scenario("window=1,staleness.window_versions=2")
    assert parse_scenario("window=1,window_versions=1") == {"staleness.window_versions": "1"}


def test_a_per_version_budget_is_a_what_if_of_its_own():
    """verl's budget below the live basis' capacity: refused alone, naming the rule;
    accepted with ``budget_basis``, which ``basis`` (the window's) is not."""
    from replay.settings import WhatIfError
    from sim.whatif import parse_scenario, scenario_config

    recorded = load_config(None, ["train.groups_per_step=8", "staleness.window_versions=1"])
    with pytest.raises(WhatIfError, match=r"^--what-if staleness.buffer_groups=9: .* >= "
                                          r"train.groups_per_step \* "):
        scenario_config(recorded, parse_scenario("buffer=9"), 5)
    cfg = scenario_config(recorded, parse_scenario("budget_basis=per_version,buffer=9"), 5)
    assert (cfg.staleness.budget_basis, cfg.buffer_capacity) == ("per_version", 9)
    with pytest.raises(WhatIfError, match="staleness.window_basis: Invalid enum value 'per_version'"):
        scenario_config(recorded, parse_scenario("basis=per_version,buffer=9"), 5)


@pytest.mark.parametrize("text", ["task.name=x", "train.lr=0.5", "window=1,model.d_model=8"])
def test_a_key_the_simulator_does_not_model_is_refused_naming_the_keys_it_does(text):
    """``task.name=x`` was a scenario identical to the recorded run: the simulator replays
    recorded durations, rewards and lengths, whatever the task, model or learning rate."""
    from replay.settings import WhatIfError
    from sim.whatif import SIMULATED_KEYS, parse_scenario

    key = text.split(",")[-1].split("=")[0]
    with pytest.raises(WhatIfError) as err:
        parse_scenario(text)
    message = str(err.value)
    assert message.startswith(f"--what-if {text.split(',')[-1]}: the simulator does not model "
                              f"{key}"), message
    assert message.endswith("it models " + ", ".join(SIMULATED_KEYS)), message
    assert "\n" not in message
