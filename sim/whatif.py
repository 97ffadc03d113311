"""Timing what-if: re-run a recorded run in virtual time under other settings.

``rl-controller simulate --run R --what-if window=2 --what-if generators=16,policy=ready_first``

From the recorded log (``sim.timeline``) come each group's generation time, each step's
microbatch / finish times, refit and checkpoint times, rewards and lengths; from its
``RunStarted`` the resolved config. Each scenario is that config with some keys changed,
run by the real controller on the virtual clock (``sim.harness``) with the recorded
durations replayed per group and per step (group ``g000042`` takes its recorded time in
every scenario). The first scenario is always the recorded settings: it must reproduce
the recorded order of commits and the recorded batches exactly, and the recorded wall
time within :data:`WALL_TOLERANCE` -- the residue is the part of the recorded
controller's latency the log does not show.

The changes are spelled as for the staleness what-if (``replay.settings``: one key
table, the recorded config read typed); the plot is ``replay.plots.write_timing_plot``.

Assumptions: :data:`ASSUMPTIONS` (printed with every result; see docs/scale.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controller.config import Config, ConfigError
from controller.projector import Projector
from events.memory_store import MemoryEventStore
from events.store import EventStore
from replay.settings import (
    WhatIfError, parse_changes, recorded_config, what_if_error, with_changes,
)
from sim.harness import SimOutcome, SimSpec, simulate
from sim.timeline import Timeline, TimelineObserver, timeline_of

ASSUMPTIONS = (
    "a group takes its recorded generation time (commit ts - admission ts, plus the "
    "recorded loop's reaction time before its admission) whichever generator runs it and "
    "however many run at once; a call carrying several groups ends with its slowest",
    "all groups of a call start on the weights the generator held when the call started "
    "(a real generator that works through a call's groups one by one may start a later "
    "group on newer weights: recorded lag can be lower by up to 1 for such groups)",
    "groups the recorded run never admitted draw a recorded group's time, rewards and "
    "lengths (seeded by group id)",
    "a step's microbatches and finish take their recorded times (step by step, by index); "
    "refit, checkpoints and payload releases their recorded times",
    "the simulated controller itself takes no time beyond the recorded reaction times "
    "the groups carry",
    "failures, aborts and worker losses are not replayed",
)

#: the baseline's wall time must be within this fraction of the recorded one
WALL_TOLERANCE = 0.05


#: the config keys a scenario may change: those the simulated controller, its generators
#: and trainer act on (``sim.harness``). Every other key (the task, model, sampling,
#: learning rate, store...) would simulate exactly the recorded run: durations, rewards
#: and lengths are replayed as recorded.
SIMULATED_KEYS = (
    "staleness.window_versions", "staleness.window_basis", "staleness.selection",
    "staleness.buffer_groups", "staleness.budget_basis",
    "rollout.num_generators", "rollout.groups_per_call", "rollout.backend",
    "rollout.vllm.chunk_tokens", "rollout.partial.enabled", "rollout.partial.segment_tokens",
    "rollout.partial.flush_on_refit",
    "train.groups_per_step", "train.groups_per_microbatch",
    "checkpoint.every_steps", "checkpoint.async_save",
    "controller.publish", "controller.snapshot_every_events",
    "controller.snapshot_events_per_mib",
)


class SimulateError(ValueError):
    """A log that cannot be simulated; the message says why."""


def parse_scenario(text: str) -> dict[str, str]:
    """``"window=2,generators=16"`` -> {config key: value} (``replay.settings`` keys);
    a key outside :data:`SIMULATED_KEYS` is refused, naming the keys it may be."""
    changes = parse_changes([text])
    for key, value in changes.items():
        if key not in SIMULATED_KEYS:
            raise WhatIfError(
                f"--what-if {key}={value}: the simulator does not model {key} (it replays "
                f"the recorded durations, rewards and lengths); it models "
                + ", ".join(SIMULATED_KEYS)
            )
    return changes


def scenario_config(recorded: Config, changes: dict[str, str], steps: int) -> Config:
    try:
        return with_changes(recorded, {**changes, "run.steps": str(steps)})
    except ConfigError as err:
        raise what_if_error(changes, err) from None


@dataclass
class Scenario:
    name: str
    changes: dict[str, str]
    config: Config
    timeline: Timeline
    outcome: SimOutcome


@dataclass
class WhatIfResult:
    run_id: str
    recorded: Timeline
    scenarios: list[Scenario]

    @property
    def baseline(self) -> Scenario:
        return self.scenarios[0]

    def reproduction(self) -> dict[str, Any]:
        rec, sim = self.recorded, self.baseline.timeline
        wall_err = abs(sim.wall_s - rec.wall_s) / rec.wall_s if rec.wall_s else 0.0
        return {
            "commit_order_identical": rec.commit_order == sim.commit_order,
            "batches_identical": rec.batches == sim.batches,
            "wall_s_recorded": rec.wall_s,
            "wall_s_simulated": sim.wall_s,
            "wall_relative_error": wall_err,
            "wall_tolerance": WALL_TOLERANCE,
            "within_tolerance": wall_err <= WALL_TOLERANCE,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "assumptions": list(ASSUMPTIONS),
            "recorded": self.recorded.summary(),
            "reproduction": self.reproduction(),
            "scenarios": [
                {"name": s.name, "changes": s.changes, **s.timeline.summary(),
                 "controller_cpu_ms_per_group": 1e3 * s.outcome.controller_cpu_s
                 / max(1, s.timeline.groups_consumed),
                 "simulated_in_s": s.outcome.real_s}
                for s in self.scenarios
            ],
        }


def run_whatif(store: EventStore, run_id: str, scenarios: list[dict[str, str]]) -> WhatIfResult:
    """Simulate the recorded settings, then each scenario, from one recorded log (read
    by one fold of the projector, the timeline an observer of it)."""
    recording = TimelineObserver()
    state = Projector(store).get(run_id, observers=[recording]).require()
    recorded, timings = recording.result()
    if recorded.steps == 0:
        raise SimulateError(f"run {run_id} has no finished step to simulate")
    recorded_cfg = recorded_config(state)
    start = recorded.first_admission_ts or 0.0
    out = []
    for i, changes in enumerate([{}, *scenarios]):
        cfg = scenario_config(recorded_cfg, changes, recorded.steps)
        sim_store = MemoryEventStore()
        sim_id = f"{run_id}-sim{i}"
        outcome = simulate(sim_store, SimSpec(config=cfg, timings=timings, run_id=sim_id, start_s=start))
        timeline, _ = timeline_of(sim_store, sim_id)
        name = "recorded settings" if not changes else ", ".join(f"{k}={v}" for k, v in changes.items())
        out.append(Scenario(name, changes, cfg, timeline, outcome))
    return WhatIfResult(run_id, recorded, out)
