"""Policy what-if: re-run the pure admission/selection/eviction policies over a recorded log.

    rl-controller staleness --run R --what-if window=0 --what-if policy=oldest_first

The recorded stream of group events (admitted, committed, failed) is replayed in log
order into a fresh state; the trainer follows the recorded schedule of steps
(StepBegun, MicrobatchTrained, StepFinished/StepAborted), but which groups each
microbatch takes, and which groups are evicted, is decided again by
``controller.core.policies`` with the what-if settings, exactly as the controller's
train side (``controller.training``) does:

* a step's first microbatch is selected right before its StepBegun; each later one
  at the earliest point after the previous microbatch where the policy can fill it
  (the loop re-checks after every append);
* every selection is ``policies.plan_microbatch`` -- the loop's own call: evict at the
  current trainer_version, then select ``min(groups_per_microbatch, groups_per_step -
  claimed)`` groups.

The simulated state changes only through the reducer (``replay.whatif_sim``), so a
what-if obeys every invariant of a real run -- a lag outside [0, window] cannot be
reported.

Assumptions (printed with every result, see docs/replay.md):

1. Commits happen at their recorded times and in their recorded order; admission and
   generation are not re-simulated (the same groups exist, with the same samples).
2. A group's ``weight_version_start`` is the recorded one, shifted back by how many
   versions the what-if trainer is behind the recorded trainer when the group was
   admitted, and never newer than the what-if trainer_version at its commit
   (generators can only hold weights the what-if trainer has produced). While the
   what-if keeps pace -- always, with the recorded settings -- that is exactly the
   recorded start. Lag = what-if trainer_version at the step's start - that version.
3. Trainer steps take their recorded durations. The recorded intervals between trainer
   events include any time the recorded loop waited for data; the what-if trainer can
   only fall behind that schedule: when its policy cannot fill a microbatch in time it
   waits for later commits, and every later trainer event shifts by that wait.
4. Aborted steps abort at the same step, after the same number of microbatches.
5. The what-if stops at the first RunRewound (a rewind is a human decision about the
   recorded weights).

With the recorded window and policy, the what-if reproduces the recorded batches
exactly (the result's ``baseline_identical`` says so for a given log).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controller.config import Config
from controller.core.fold import Callback
from controller.core.policies import StalenessSection
from controller.core.state import GroupStatus, RunState, StepStatus
from controller.core.step_metrics import model_tokens
from events.schema import AnyEvent, RunStarted
from replay.settings import WhatIfError, apply_changes, parse_changes, recorded_config
from replay.whatif_sim import FED_EVENTS, SimResult, SimStep, Simulation, simulate
from workers.trainer.config import TrainSection

__all__ = [
    "ASSUMPTIONS", "SimResult", "SimStep", "Simulation", "WhatIf", "WhatIfError",
    "WhatIfSettings", "compare", "recorded_batches", "recorded_settings", "simulate",
    "what_if_settings",
]

ASSUMPTIONS = (
    "commits happen at their recorded times and in recorded order; admission and "
    "generation are not re-simulated",
    "a group's weight_version_start is the recorded one shifted back by the versions "
    "the what-if trainer is behind the recorded one at the group's admission, and never "
    "newer than the what-if trainer_version at its commit (equal to the recorded start "
    "while it keeps pace); lag = what-if trainer_version at the "
    "step's start - that version",
    "trainer steps take their recorded durations; the what-if trainer can only fall "
    "behind the recorded schedule (waiting for commits shifts every later step)",
    "aborted steps abort at the same step after the same number of microbatches",
    "the what-if stops at the first RunRewound",
)

#: the config keys this what-if varies (the policies'); timings are ``simulate``'s
POLICY_KEYS = (
    "staleness.window_versions", "staleness.selection", "train.groups_per_microbatch",
    "staleness.window_basis",
)


@dataclass(frozen=True)
class WhatIfSettings:
    """The tables the policies read, as recorded or changed: ``[staleness]`` (window,
    selection) and ``[train]`` (groups per step and per microbatch), not copies."""

    staleness: StalenessSection
    train: TrainSection

    @classmethod
    def of(cls, cfg: Config) -> WhatIfSettings:
        return cls(staleness=cfg.staleness, train=cfg.train)

    def summary(self) -> dict[str, Any]:
        """The values the policies ran with, by config key (the what-if vocabulary)."""
        out: dict[str, Any] = {}
        for key in (*POLICY_KEYS, "train.groups_per_step"):
            table, name = key.split(".")
            out[key] = getattr(getattr(self, table), name)
        return out


def recorded_settings(state: RunState) -> WhatIfSettings:
    """The policy settings the run recorded (its typed config, ``replay.settings``)."""
    return WhatIfSettings.of(recorded_config(state))


def what_if_settings(state: RunState, items: list[str]) -> WhatIfSettings:
    """The recorded settings with ``key=value`` items (window, policy, microbatch)."""
    changes = parse_changes(items, allowed=POLICY_KEYS)
    return WhatIfSettings.of(apply_changes(state, changes)) if changes else recorded_settings(state)


class WhatIf:
    """The what-if as an observer of the projector's fold (``controller.core.fold.Observer``):
    the settings are read off the run's RunStarted, every later group and trainer event
    feeds the :class:`Simulation`; :meth:`result` once the fold is done."""

    def __init__(self, items: list[str]) -> None:
        parse_changes(items, allowed=POLICY_KEYS)  # a bad key fails before the log is read
        self.items = items
        self.simulation: Simulation | None = None

    def watches(self) -> dict[type, Callback]:
        out: dict[type, Callback] = {RunStarted: self._started}
        out.update(dict.fromkeys(FED_EVENTS, self._feed))
        return out

    def _started(self, event: AnyEvent, position: int, state: RunState) -> None:
        self.simulation = Simulation(what_if_settings(state, self.items))

    def _feed(self, event: AnyEvent, position: int, state: RunState) -> None:
        if self.simulation is not None:
            self.simulation.feed(position, event)

    def result(self) -> SimResult:
        if self.simulation is None:
            raise WhatIfError("--what-if: the log has no RunStarted to take the settings from")
        return self.simulation.finish()


# -- comparison with the recorded run ---------------------------------------------------------


def _lag_stats(lags: list[int], tokens: list[int]) -> dict[str, float]:
    total = sum(tokens)
    return {
        "groups": len(lags),
        "lag_mean": sum(lags) / len(lags) if lags else 0.0,
        "lag_max": max(lags, default=0),
        "lag_token_weighted": sum(l * t for l, t in zip(lags, tokens)) / total if total else 0.0,
    }


def recorded_batches(state: RunState) -> dict[int, list[list[str]]]:
    """Finished steps' microbatches as recorded (before the first rewind's lost steps too)."""
    return {
        s.step: [list(mb) for mb in s.microbatches]
        for s in state.steps.values()
        if s.status is StepStatus.FINISHED
    }


def compare(state: RunState, result: SimResult) -> dict[str, Any]:
    """Recorded vs what-if: batch composition, lag, evictions (JSON-ready)."""
    recorded = recorded_batches(state)
    groups = state.groups
    rec_lags, rec_tok, sim_lags, sim_tok = [], [], [], []
    same = differ = 0
    overlap = 0
    per_step = []
    for step in result.finished():
        mine = step.microbatches
        theirs = recorded.get(step.step)
        identical = theirs == mine
        same += identical
        differ += theirs is not None and not identical
        if theirs is not None:
            rec_ids = {g for mb in theirs for g in mb}
            overlap += len(rec_ids & set(step.group_ids))
        sim_lags += step.lags
        # model tokens, as the staleness report weighs them: the same groups, the same
        # samples in both columns (assumption 1), so the recorded state has their counts
        sim_tok += [model_tokens(groups[g]) for g in step.group_ids]
        per_step.append(
            {
                "step": step.step,
                "identical": identical,
                "lag_mean": sum(step.lags) / len(step.lags) if step.lags else 0.0,
                "lag_max": max(step.lags, default=0),
                "groups": step.group_ids,
            }
        )
    for record in state.steps.values():
        if record.status is StepStatus.FINISHED:
            for gid in record.group_ids:
                group = state.groups[gid]
                rec_lags.append(group.lag or 0)
                rec_tok.append(model_tokens(group))
    evicted_recorded = sum(
        1 for g in state.groups.values() if g.status is GroupStatus.EVICTED
    )
    rec_groups = sum(len(v) for mbs in recorded.values() for v in mbs)
    return {
        "settings": result.settings.summary(),
        "assumptions": list(ASSUMPTIONS),
        "stopped": result.stopped,
        "steps": {
            "recorded_finished": len(recorded),
            "what_if_finished": len(result.finished()),
            "identical": same,
            "different": differ,
        },
        "group_overlap_fraction": overlap / rec_groups if rec_groups else 1.0,
        "recorded": {**_lag_stats(rec_lags, rec_tok), "evicted": evicted_recorded},
        "what_if": {**_lag_stats(sim_lags, sim_tok), "evicted": len(result.evicted)},
        "trainer_delay_s": result.lateness_s,
        "per_step": per_step,
    }
