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

:class:`TimelineObserver` collects all of it as an observer of the projector's one fold
(``controller.projector``); :func:`timeline_of` is that fold for one run of a store.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, get_args

from controller.core.fold import Callback
from controller.core.state import RunState
from controller.projector import Projector
from events.schema import (
    AnyEvent,
    CheckpointSaved,
    GroupCommitted,
    GroupEvicted,
    MicrobatchTrained,
    PayloadsReleased,
    RolloutAdmitted,
    RunStarted,
    StepAborted,
    StepBegun,
    StepFinished,
    WeightsPublished,
)
from events.store import EventStore
from sim.timings import RecordedTimings


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
    #: ts of the first RolloutAdmitted (None: the log has none)
    first_admission_ts: float | None = None

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


class TimelineObserver:
    """Collects a :class:`Timeline` and the :class:`RecordedTimings` of a log as it is
    folded: register it with ``Projector.get(..., observers=[...])``, then ask
    :meth:`result`. It watches every event type (the loop's reaction time is measured
    from the last event of any kind before an admission)."""

    def __init__(self) -> None:
        self.tl = Timeline()
        self.rec = RecordedTimings({}, {}, {}, {}, {}, {0: 0.0}, {})
        self.admitted: dict[str, float] = {}
        self.committed_ts: dict[str, float] = {}
        self.start_version: dict[str, int] = {}
        self.open_step: _Open | None = None
        #: (trainer_version, ts) of the last StepFinished, awaiting its refit
        self.last_finished: tuple[int, float] | None = None
        self.commits: list[tuple[float, str]] = []
        self.latency: dict[str, float] = {}
        self.prev_ts = self.batch_ts = float("nan")
        self.batch_latency = 0.0
        self.last_finished_ts = float("-inf")
        self.published_ts = 0.0
        self.begun_since_finish = False  # a StepBegun between StepFinished and its publish
        self.behind_published_ts: float | None = None  # a publish that ran behind the open step
        self.waited_in_line: dict[int, float] = {}  # version -> its in-line publish's seconds
        #: (version, saved ts, written behind a step) awaiting its payload release
        self.checkpoint: tuple[int, float, bool] | None = None
        self.begun_since_publish = False  # a StepBegun after the last WeightsPublished
        self.async_saves = False  # checkpoint.async_save in the run's config
        #: version -> checkpoint seconds counted as the trainer's (in-line saves)
        self.counted: dict[int, float] = {}
        self.trainer_version = 0

    def watches(self) -> dict[type, Callback]:
        handlers: dict[type, Callable[[Any], None]] = {
            RunStarted: self._run_started,
            RolloutAdmitted: self._admitted,
            GroupCommitted: self._committed,
            GroupEvicted: self._evicted,
            StepBegun: self._begun,
            MicrobatchTrained: self._microbatch,
            StepFinished: self._step_ended,
            StepAborted: self._step_ended,
            WeightsPublished: self._published,
            CheckpointSaved: self._checkpoint_saved,
            PayloadsReleased: self._released,
        }

        def watch(handler: Callable[[Any], None] | None) -> Callback:
            def observe(event: Any, position: int, state: RunState) -> None:
                if type(event) is not RolloutAdmitted:  # an admission never frees a generator
                    self.prev_ts = event.ts
                if handler is not None:
                    handler(event)

            return observe

        return {cls: watch(handlers.get(cls)) for cls in get_args(AnyEvent)}

    def _run_started(self, event: RunStarted) -> None:
        self.rec.seed = event.seed  # groups the recorded run never had draw with it
        checkpoint = event.config.get("checkpoint")
        # a run with async saves wrote every checkpoint behind training
        self.async_saves = isinstance(checkpoint, dict) and bool(checkpoint.get("async_save"))

    def _admitted(self, event: RolloutAdmitted) -> None:
        if event.ts != self.batch_ts:  # a new admission append: the loop's reaction time
            # (the simulation starts its clock at the first admission: none there)
            self.batch_ts = event.ts
            first = self.tl.first_admission_ts is None
            self.batch_latency = 0.0 if first else event.ts - self.prev_ts
        if self.tl.first_admission_ts is None:
            self.tl.first_admission_ts = event.ts
        self.admitted[event.group_id] = event.ts
        self.latency[event.group_id] = self.batch_latency

    def _committed(self, event: GroupCommitted) -> None:
        gid, rec = event.group_id, self.rec
        self.committed_ts[gid] = event.ts
        self.start_version[gid] = event.weight_version_start
        if event.attempt == 1 or gid not in rec.generation:
            rec.generation[gid] = (
                event.ts - self.admitted.get(gid, event.ts) + self.latency.get(gid, 0.0)
            )
        rec.rewards[gid] = list(event.rewards)
        rec.lengths[gid] = list(event.lengths)
        self.commits.append((event.ts, gid))

    def _evicted(self, event: GroupEvicted) -> None:
        self.tl.evicted += 1

    def _begun(self, event: StepBegun) -> None:
        self.open_step = _Open(begun_ts=event.ts, last_ts=event.ts, base=event.base_trainer_version)
        self.begun_since_finish = self.begun_since_publish = True

    def _microbatch(self, event: MicrobatchTrained) -> None:
        step = self.open_step
        if step is None:
            return
        if step.durations:
            ready = max((self.committed_ts.get(g, 0.0) for g in event.group_ids), default=0.0)
            started = max(step.last_ts, ready)
        else:
            started = step.begun_ts
        step.durations.append(max(0.0, event.ts - started))
        step.batches.append(list(event.group_ids))
        step.lags.extend(step.base - self.start_version.get(g, step.base) for g in event.group_ids)
        step.last_ts = event.ts

    def _step_ended(self, event: StepFinished | StepAborted) -> None:
        step, tl, rec = self.open_step, self.tl, self.rec
        if step is None:
            return
        finish_from = step.last_ts
        finished = type(event) is StepFinished
        if finished and self.behind_published_ts is not None:
            # the finish waited for the publish running behind this step
            tl.refit_wait_s += max(0.0, self.behind_published_ts - finish_from)
            finish_from = max(finish_from, self.behind_published_ts)
        self.behind_published_ts = None
        finish = max(0.0, event.ts - finish_from)
        rec.microbatches[event.step] = step.durations
        rec.finish[event.step] = finish
        tl.trainer_busy_s += sum(step.durations) + finish
        if finished:
            self._finished(event, step)  # type: ignore[arg-type]
        self.open_step = None

    def _finished(self, event: StepFinished, step: _Open) -> None:
        tl = self.tl
        first = tl.first_admission_ts
        self.trainer_version = event.trainer_version
        tl.steps += 1
        tl.batches[event.step] = step.batches
        tl.groups_consumed += sum(len(b) for b in step.batches)
        tl.lags.extend(step.lags)
        if step.lags:
            tl.step_lags[event.step] = (sum(step.lags) / len(step.lags), max(step.lags))
        self.last_finished = (event.trainer_version, event.ts)
        self.begun_since_finish = False
        tl.progress.append((event.ts - (first or event.ts), self.trainer_version))
        tl.wall_s = event.ts - (first or event.ts)
        self.last_finished_ts = event.ts

    def _published(self, event: WeightsPublished) -> None:
        self.published_ts, self.begun_since_publish = event.ts, False
        if self.last_finished is None:
            return
        version, finished_ts = self.last_finished
        if event.weight_version == version:
            self.rec.publish[version] = event.ts - finished_ts
            self.tl.refit_s += event.ts - finished_ts
            if self.begun_since_finish:
                self.behind_published_ts = event.ts
            else:
                self.tl.refit_wait_s += event.ts - finished_ts
                self.waited_in_line[version] = event.ts - finished_ts
        self.last_finished = None

    def _checkpoint_saved(self, event: CheckpointSaved) -> None:
        # saved right after the step's weights were published: in line, unless a step
        # began meanwhile (``checkpoint.async_save``: written behind that step, the
        # trainer did not wait for it and neither for the release that follows)
        behind = self.async_saves or self.begun_since_publish
        if event.trainer_version > 0:
            self.rec.checkpoint[event.trainer_version] = event.ts - self.published_ts
            self._count(event.trainer_version, event.ts - self.published_ts, behind)
        self.checkpoint = (event.trainer_version, event.ts, behind)

    def _released(self, event: PayloadsReleased) -> None:
        if self.checkpoint is None:
            return
        version, saved_ts, behind = self.checkpoint
        self.rec.release[version] = event.ts - saved_ts
        self._count(version, event.ts - saved_ts, behind)
        self.checkpoint = None

    def _count(self, version: int, seconds: float, behind: bool) -> None:
        """Checkpoint time the trainer waited for (none when written behind a step)."""
        if not behind:
            self.tl.checkpoint_s += seconds
            self.counted[version] = self.counted.get(version, 0.0) + seconds

    def result(self) -> tuple[Timeline, RecordedTimings]:
        """The run-level figures of the log so far and the durations a simulation replays."""
        tl, rec = self.tl, self.rec
        # Still generating when the log ends: the recorded run shows they took at least this.
        end_ts = 0.0 if math.isnan(self.prev_ts) else self.prev_ts  # NaN: the log had no events
        for gid, ts in self.admitted.items():
            if gid not in self.committed_ts or self.committed_ts[gid] < ts:
                rec.unfinished[gid] = end_ts - ts + self.latency.get(gid, 0.0)
        tl.commit_order = [gid for ts, gid in self.commits if ts <= self.last_finished_ts]
        # Refit and checkpoints after the last StepFinished are outside the wall time.
        if tl.progress:
            version = self.trainer_version
            if self.last_finished is None:
                tl.refit_s -= rec.publish.get(version, 0.0)
                tl.refit_wait_s -= self.waited_in_line.get(version, 0.0)
            tl.checkpoint_s -= self.counted.get(version, 0.0)
        return tl, rec


def timeline_of(store: EventStore, run_id: str) -> tuple[Timeline, RecordedTimings]:
    """The timeline of one run of ``store`` (raises what stops its fold)."""
    observer = TimelineObserver()
    Projector(store).get(run_id, observers=[observer]).require()
    return observer.result()
