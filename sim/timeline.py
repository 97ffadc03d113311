"""What a log says about time: per-group and per-step durations, and run-level figures.

The same function reads a recorded run and a simulated one, so the two are compared by
one definition. From the events' ``ts`` (write-ahead: intent before, fact after):

* a group's generation time = its ``GroupCommitted.ts - RolloutAdmitted.ts``, plus the
  recorded loop's reaction time before that admission (its ts - the last event before
  it that was not an admission):
  the simulated loop reacts at once, so the recorded latency travels with the group;
* microbatch 0 of a step = its ``MicrobatchTrained.ts - StepBegun.ts`` (begin included);
  microbatch i > 0 = its ts - max(previous microbatch's ts, latest commit of its groups)
  (the loop selects it as soon as both hold, then calls the trainer);
* finishing = ``StepFinished.ts`` - the last microbatch's ts, or the ts of the
  ``WeightsPublished`` that ran behind the step if later (``controller.publish =
  "behind"``: the step's finish waits for that publish, ``controller.training``);
* refit = the next ``WeightsPublished.ts - StepFinished.ts``; a checkpoint = its
  ``CheckpointSaved.ts`` - that ``WeightsPublished.ts`` (the loop saves right after),
  plus the release of the payloads it covers (``PayloadsReleased.ts - CheckpointSaved.ts``:
  the train pump waits for the deletes too);
* wall time = last ``StepFinished.ts`` - first ``RolloutAdmitted.ts``; trainer idle =
  wall - (begin + microbatches + finish) - refit wait - checkpoints: the time the
  trainer waited for data or for the controller. The refit wait is a publish's whole
  time when it ran in line (no ``StepBegun`` before its ``WeightsPublished``), else
  only what the next step's finish waited for it.

Everything here is pure: it takes decoded ``(position, event)`` pairs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from events.schema import (
    AnyEvent,
    CheckpointSaved,
    GroupCommitted,
    GroupEvicted,
    MicrobatchTrained,
    PayloadsReleased,
    RolloutAdmitted,
    StepAborted,
    StepBegun,
    StepFinished,
    WeightsPublished,
)
from sim.timings import RecordedTimings


@dataclass
class _Behind:
    """Where a checkpoint written behind a step is counted: not the trainer's time."""

    checkpoint_s: float = 0.0


@dataclass
class Timeline:
    """Run-level figures of one log (recorded or simulated)."""

    wall_s: float = 0.0
    steps: int = 0
    groups_consumed: int = 0
    lags: list[int] = field(default_factory=list)
    evicted: int = 0
    trainer_busy_s: float = 0.0
    refit_s: float = 0.0
    #: the part of ``refit_s`` the trainer waited for (see the module docstring)
    refit_wait_s: float = 0.0
    checkpoint_s: float = 0.0
    #: group ids in commit order, up to the last StepFinished (later commits -- drained
    #: at the end of a run -- trained nothing)
    commit_order: list[str] = field(default_factory=list)
    #: finished step -> its microbatches' group ids
    batches: dict[int, list[list[str]]] = field(default_factory=dict)
    #: (seconds since the first admission, trainer_version) at each StepFinished
    progress: list[tuple[float, int]] = field(default_factory=list)
    #: finished step -> (mean lag, max lag)
    step_lags: dict[int, tuple[float, int]] = field(default_factory=dict)

    @property
    def groups_per_s(self) -> float:
        return self.groups_consumed / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def trainer_idle_s(self) -> float:
        return max(0.0, self.wall_s - self.trainer_busy_s - self.refit_wait_s - self.checkpoint_s)

    @property
    def trainer_idle_frac(self) -> float:
        return self.trainer_idle_s / self.wall_s if self.wall_s > 0 else 0.0

    def lag_quantile(self, q: float) -> int:
        if not self.lags:
            return 0
        ordered = sorted(self.lags)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict[str, Any]:
        lags = self.lags
        hist: dict[int, int] = {}
        for lag in lags:
            hist[lag] = hist.get(lag, 0) + 1
        return {
            "wall_s": self.wall_s,
            "steps": self.steps,
            "groups": self.groups_consumed,
            "groups_per_s": self.groups_per_s,
            "lag_mean": sum(lags) / len(lags) if lags else 0.0,
            "lag_p50": self.lag_quantile(0.5),
            "lag_p90": self.lag_quantile(0.9),
            "lag_max": max(lags, default=0),
            "lag_histogram": {str(k): v for k, v in sorted(hist.items())},
            "evicted": self.evicted,
            "trainer_busy_s": self.trainer_busy_s,
            "refit_s": self.refit_s,
            "refit_wait_s": self.refit_wait_s,
            "checkpoint_s": self.checkpoint_s,
            "trainer_idle_s": self.trainer_idle_s,
            "trainer_idle_frac": self.trainer_idle_frac,
        }


@dataclass
class _Open:
    begun_ts: float
    last_ts: float
    durations: list[float] = field(default_factory=list)
    batches: list[list[str]] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)
    base: int = 0


def read_timeline(
    events: Iterable[tuple[int, AnyEvent]], *, seed: int = 0
) -> tuple[Timeline, RecordedTimings]:
    """The run-level figures of a log and the durations a simulation replays."""
    tl = Timeline()
    rec = RecordedTimings({}, {}, {}, {}, {}, {0: 0.0}, {}, seed=seed)
    admitted: dict[str, float] = {}
    committed_ts: dict[str, float] = {}
    start_version: dict[str, int] = {}
    first_admit: float | None = None
    open_step: _Open | None = None
    last_finished: tuple[int, float] | None = None  # (trainer_version, ts) awaiting refit
    commits: list[tuple[float, str]] = []
    latency: dict[str, float] = {}
    prev_ts = batch_ts = float("nan")
    batch_latency = 0.0
    last_finished_ts = float("-inf")
    published_ts = 0.0
    begun_since_finish = False  # a StepBegun between StepFinished and its publish
    behind_published_ts: float | None = None  # a publish that ran behind the open step
    waited_in_line: dict[int, float] = {}  # version -> its in-line publish's seconds
    checkpoint: tuple[int, float, Any] | None = None  # awaiting its payload release
    begun_since_publish = False  # a StepBegun after the last WeightsPublished
    trainer_version = 0
    for _pos, event in events:
        kind = type(event)
        if kind is not RolloutAdmitted:  # an admission never frees a generator
            prev_ts = event.ts
        if kind is RolloutAdmitted:
            if event.ts != batch_ts:  # a new admission append: the loop's reaction time
                # (the simulation starts its clock at the first admission: none there)
                batch_ts = event.ts
                batch_latency = 0.0 if first_admit is None else event.ts - prev_ts
            if first_admit is None:
                first_admit = event.ts
            admitted[event.group_id] = event.ts
            latency[event.group_id] = batch_latency
        elif kind is GroupCommitted:
            gid = event.group_id
            committed_ts[gid] = event.ts
            start_version[gid] = event.weight_version_start
            if event.attempt == 1 or gid not in rec.generation:
                rec.generation[gid] = (
                    event.ts - admitted.get(gid, event.ts) + latency.get(gid, 0.0)
                )
            rec.rewards[gid] = list(event.rewards)
            rec.lengths[gid] = list(event.lengths)
            commits.append((event.ts, gid))
        elif kind is GroupEvicted:
            tl.evicted += 1
        elif kind is StepBegun:
            open_step = _Open(begun_ts=event.ts, last_ts=event.ts, base=event.base_trainer_version)
            begun_since_finish = begun_since_publish = True
        elif kind is MicrobatchTrained and open_step is not None:
            if open_step.durations:
                ready = max((committed_ts.get(g, 0.0) for g in event.group_ids), default=0.0)
                started = max(open_step.last_ts, ready)
            else:
                started = open_step.begun_ts
            open_step.durations.append(max(0.0, event.ts - started))
            open_step.batches.append(list(event.group_ids))
            open_step.lags.extend(open_step.base - start_version.get(g, open_step.base) for g in event.group_ids)
            open_step.last_ts = event.ts
        elif kind in (StepFinished, StepAborted) and open_step is not None:
            finish_from = open_step.last_ts
            if kind is StepFinished and behind_published_ts is not None:
                # the finish waited for the publish running behind this step
                tl.refit_wait_s += max(0.0, behind_published_ts - finish_from)
                finish_from = max(finish_from, behind_published_ts)
            behind_published_ts = None
            finish = max(0.0, event.ts - finish_from)
            rec.microbatches[event.step] = open_step.durations
            rec.finish[event.step] = finish
            tl.trainer_busy_s += sum(open_step.durations) + finish
            if kind is StepFinished:
                trainer_version = event.trainer_version
                tl.steps += 1
                tl.batches[event.step] = open_step.batches
                tl.groups_consumed += sum(len(b) for b in open_step.batches)
                tl.lags.extend(open_step.lags)
                if open_step.lags:
                    tl.step_lags[event.step] = (
                        sum(open_step.lags) / len(open_step.lags), max(open_step.lags)
                    )
                last_finished = (event.trainer_version, event.ts)
                begun_since_finish = False
                tl.progress.append((event.ts - (first_admit or event.ts), trainer_version))
                tl.wall_s = event.ts - (first_admit or event.ts)
                last_finished_ts = event.ts
            open_step = None
        elif kind is WeightsPublished:
            published_ts, begun_since_publish = event.ts, False
            if last_finished is None:
                continue
            version, finished_ts = last_finished
            if event.weight_version == version:
                rec.publish[version] = event.ts - finished_ts
                tl.refit_s += event.ts - finished_ts
                if begun_since_finish:
                    behind_published_ts = event.ts
                else:
                    tl.refit_wait_s += event.ts - finished_ts
                    waited_in_line[version] = event.ts - finished_ts
            last_finished = None
        elif kind is CheckpointSaved:
            # saved right after the step's weights were published; in line unless a step
            # began meanwhile (``checkpoint.async_save``: written behind that step)
            held = tl if not begun_since_publish else _Behind()
            if event.trainer_version > 0:
                rec.checkpoint[event.trainer_version] = event.ts - published_ts
                held.checkpoint_s += event.ts - published_ts
            checkpoint = (event.trainer_version, event.ts, held)
        elif kind is PayloadsReleased and checkpoint is not None:
            version, saved_ts, held = checkpoint
            rec.release[version] = event.ts - saved_ts
            held.checkpoint_s += event.ts - saved_ts
            checkpoint = None
    # Still generating when the log ends: the recorded run shows they took at least this.
    end_ts = 0.0 if math.isnan(prev_ts) else prev_ts  # NaN: the log had no events
    for gid, ts in admitted.items():
        if gid not in committed_ts or committed_ts[gid] < ts:
            rec.unfinished[gid] = end_ts - ts + latency.get(gid, 0.0)
    tl.commit_order = [gid for ts, gid in commits if ts <= last_finished_ts]
    # Refit and checkpoints after the last StepFinished are outside the wall time.
    if tl.progress:
        if last_finished is None:
            tl.refit_s -= rec.publish.get(trainer_version, 0.0)
            tl.refit_wait_s -= waited_in_line.get(trainer_version, 0.0)
        tl.checkpoint_s -= rec.checkpoint.get(trainer_version, 0.0)
        tl.checkpoint_s -= rec.release.get(trainer_version, 0.0)
    return tl, rec
