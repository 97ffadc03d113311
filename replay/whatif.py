"""Policy what-if: re-run the pure admission/selection/eviction policies over a recorded log.

    rl-controller staleness --run R --what-if window=0 --what-if policy=oldest_first

The recorded stream of group events (admitted, committed, failed) is replayed in log
order into a fresh state; the trainer follows the recorded schedule of steps
(StepBegun, MicrobatchTrained, StepFinished/StepAborted), but which groups each
microbatch takes, and which groups are evicted, is decided again by
``controller.core.policies`` with the what-if settings, exactly as ``controller.loop`` does:

* a step's first microbatch is selected right before its StepBegun; each later one
  at the earliest point after the previous microbatch where the policy can fill it
  (the loop re-checks after every append);
* every selection takes ``min(groups_per_microbatch, groups_per_step - claimed)``
  groups with ``policies.select``, after evicting with ``policies.to_evict`` at the
  current trainer_version.

Assumptions (printed with every result, see docs/replay.md):

1. Commits happen at their recorded times and in their recorded order; admission and
   generation are not re-simulated (the same groups exist, with the same samples).
2. A group's ``weight_version_start`` is the recorded one, shifted back by how many
   versions the what-if trainer is behind the recorded trainer when the group was
   admitted (generators can only hold weights the what-if trainer has produced). While
   the what-if keeps pace -- always, with the recorded settings -- that is exactly the
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

from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, get_args

from controller.core import policies
from controller.core.state import GroupRecord, GroupStatus, RunState, StepStatus
from events.schema import (
    AnyEvent,
    GroupCommitted,
    GroupFailed,
    MicrobatchTrained,
    RolloutAdmitted,
    RunRewound,
    StepAborted,
    StepBegun,
    StepFinished,
)

ASSUMPTIONS = (
    "commits happen at their recorded times and in recorded order; admission and "
    "generation are not re-simulated",
    "a group's weight_version_start is the recorded one shifted back by the versions "
    "the what-if trainer is behind the recorded one at the group's admission (equal to "
    "the recorded start while it keeps pace); lag = what-if trainer_version at the "
    "step's start - that version",
    "trainer steps take their recorded durations; the what-if trainer can only fall "
    "behind the recorded schedule (waiting for commits shifts every later step)",
    "aborted steps abort at the same step after the same number of microbatches",
    "the what-if stops at the first RunRewound",
)

_KEYS = {
    "window": "window",
    "window_versions": "window",
    "policy": "policy",
    "selection": "policy",
    "microbatch": "groups_per_microbatch",
    "groups_per_microbatch": "groups_per_microbatch",
}


class WhatIfError(ValueError):
    """A bad ``--what-if key=value``; the message names the key."""


@dataclass(frozen=True)
class WhatIfSettings:
    window: int
    policy: policies.SelectionPolicy
    groups_per_step: int
    groups_per_microbatch: int


def recorded_settings(state: RunState) -> WhatIfSettings:
    """The settings the run recorded in RunStarted (microbatch size inferred if absent)."""
    cfg = state.config if isinstance(state.config, dict) else {}
    policy = (cfg.get("staleness") or {}).get("selection", "in_order")
    per_mb = (cfg.get("train") or {}).get("groups_per_microbatch")
    if not per_mb:
        sizes = [len(mb) for s in state.steps.values() for mb in s.microbatches]
        per_mb = max(sizes, default=state.groups_per_step)
    return WhatIfSettings(
        window=state.window_versions,
        policy=policy if policy in policies.SELECTION_POLICIES else "in_order",
        groups_per_step=max(state.groups_per_step, 1),
        groups_per_microbatch=int(per_mb),
    )


def parse_what_if(items: list[str], base: WhatIfSettings) -> WhatIfSettings:
    """Apply ``key=value`` items (window, policy, microbatch) to ``base``."""
    changes: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in _KEYS:
            raise WhatIfError(
                f"--what-if {item!r}: expected key=value with key one of window, policy, microbatch"
            )
        name = _KEYS[key]
        if name == "policy":
            if value not in get_args(policies.SelectionPolicy):
                raise WhatIfError(
                    f"--what-if {key}={value!r}: choose one of {', '.join(policies.SELECTION_POLICIES)}"
                )
            changes[name] = value
            continue
        try:
            number = int(value)
        except ValueError:
            raise WhatIfError(f"--what-if {key}={value!r}: expected an integer") from None
        if number < (0 if name == "window" else 1):
            raise WhatIfError(f"--what-if {key}={number}: out of range")
        changes[name] = number
    return replace(base, **changes)


@dataclass
class SimStep:
    step: int
    status: str
    base_trainer_version: int
    microbatches: list[list[str]]
    lags: list[int]
    ended_ts: float

    @property
    def group_ids(self) -> list[str]:
        return [g for mb in self.microbatches for g in mb]


@dataclass
class SimResult:
    settings: WhatIfSettings
    steps: list[SimStep]
    evicted: list[tuple[str, int]]
    lateness_s: float
    stopped: str
    recorded_steps_seen: int
    lengths: dict[str, int] = field(default_factory=dict)

    def finished(self) -> list[SimStep]:
        return [s for s in self.steps if s.status == "finished"]


_GROUP_EVENTS = (RolloutAdmitted, GroupCommitted, GroupFailed)
_TRAINER_EVENTS = (StepBegun, MicrobatchTrained, StepFinished, StepAborted)


class _Simulation:
    """Replays group events into ``self.state``; drives the policies on the trainer schedule."""

    def __init__(self, settings: WhatIfSettings) -> None:
        self.s = settings
        self.state = RunState(
            started=True,
            window_versions=settings.window,
            groups_per_step=settings.groups_per_step,
        )
        self.queue: deque[AnyEvent] = deque()
        self.lateness = 0.0
        self.blocked_due: float | None = None
        self.want = 0  # groups the pending selection needs (0 = none pending)
        self.current: SimStep | None = None
        self.steps: list[SimStep] = []
        self.evicted: list[tuple[str, int]] = []
        self.lengths: dict[str, int] = {}
        self.stopped = "end of log"
        self.seen_steps = 0
        #: the recorded trainer_version as the stream goes, and each group's version
        #: deficit (recorded - what-if) at its admission
        self.recorded_tv = 0
        self.shift: dict[str, int] = {}

    # -- the stream ----------------------------------------------------------------

    def run(self, events: Iterable[tuple[int, AnyEvent]]) -> SimResult:
        for position, event in events:
            kind = type(event)
            if kind in _GROUP_EVENTS:
                self._drain(event.ts)
                self._apply_group(event, position)
                self._on_change(event.ts)
            elif kind in _TRAINER_EVENTS:
                self.seen_steps += kind is StepBegun
                self.recorded_tv += kind is StepFinished
                self.queue.append(event)
                if (
                    kind is StepAborted
                    and self.blocked_due is not None
                    and self.current is not None
                    and self.current.step == event.step
                ):
                    self._abort_while_blocked()
                self._drain(event.ts)
            elif kind is RunRewound:
                self.stopped = f"RunRewound at position {position}"
                break
        self._drain(float("inf"))
        if self.queue:
            self.stopped = (
                f"starved: {len(self.queue)} recorded trainer events could not be matched "
                f"(the policy could not fill step {self._blocked_step()})"
            )
        return SimResult(
            self.s, self.steps, self.evicted, self.lateness, self.stopped, self.seen_steps, self.lengths
        )

    def _blocked_step(self) -> int | str:
        head = self.queue[0] if self.queue else None
        return getattr(head, "step", "?")

    def _apply_group(self, event: AnyEvent, position: int) -> None:
        groups, state = self.state.groups, self.state
        if type(event) is RolloutAdmitted:
            groups[event.group_id] = GroupRecord(
                group_id=event.group_id,
                status=GroupStatus.ADMITTED,
                attempt=event.attempt,
                prompt_index=event.prompt_index,
                prompt_ref=event.prompt_ref,
                n_samples=event.n_samples,
                sample_seed=event.sample_seed,
                dispatch_weight_version=event.weight_version,
                admitted_ts=event.ts,
                admitted_position=position,
            )
            state.admitted[event.group_id] = None
            self.shift[event.group_id] = self.recorded_tv - state.trainer_version
            return
        group = groups.get(event.group_id)
        if group is None or group.status is not GroupStatus.ADMITTED:
            return  # the reducer already vetted the log; nothing sane to do here
        state.admitted.pop(event.group_id, None)
        if type(event) is GroupFailed:
            group.status = GroupStatus.FAILED
            return
        group.status = GroupStatus.COMMITTED
        group.committed_ts = event.ts
        group.committed_position = position
        shift = self.shift.get(event.group_id, 0)
        group.weight_version_start = max(0, event.weight_version_start - shift)
        group.weight_version_end = max(0, event.weight_version_end - shift)
        self.lengths[event.group_id] = sum(event.lengths)
        state.buffer[event.group_id] = None

    # -- the trainer ------------------------------------------------------------------

    def _on_change(self, now: float) -> None:
        if self.want and self._try_select():
            if self.blocked_due is not None:
                self.lateness += max(0.0, now - self.blocked_due)
                self.blocked_due = None
            self._drain(now)

    def _drain(self, now: float) -> None:
        if self.blocked_due is not None:
            return  # waiting for data: only a group event (``_on_change``) unblocks
        while self.queue:
            head = self.queue[0]
            due = head.ts + self.lateness
            if due > now:
                return
            if not self._fire(head):
                self.blocked_due = due
                return
            self.queue.popleft()

    def _abort_while_blocked(self) -> None:
        """The recorded step aborted while the what-if still waits to fill it: abort it."""
        while type(self.queue[0]) is not StepAborted:
            self.queue.popleft()
        self.blocked_due = None

    def _fire(self, event: AnyEvent) -> bool:
        """Carry out a recorded trainer event; False while its selection cannot be made."""
        kind = type(event)
        if kind is StepBegun:
            if self.current is None or self.current.step != event.step:
                self._begin(event)
            return self._selection_done()
        if kind is MicrobatchTrained:
            if not self._selection_done():
                return False
            self._next_selection()
            return True
        if kind is StepFinished:
            if not self._selection_done():
                return False
            self._end("finished", event.ts + self.lateness)
            return True
        self._end("aborted", event.ts + self.lateness)  # StepAborted
        return True

    def _begin(self, event: StepBegun) -> None:
        self.current = SimStep(
            step=event.step,
            status="open",
            base_trainer_version=self.state.trainer_version,
            microbatches=[],
            lags=[],
            ended_ts=0.0,
        )
        self._next_selection()

    def _claimed(self) -> int:
        return 0 if self.current is None else len(self.current.lags)

    def _next_selection(self) -> None:
        remaining = self.s.groups_per_step - self._claimed()
        self.want = min(self.s.groups_per_microbatch, remaining) if remaining > 0 else 0
        if self.want:
            self._try_select()

    def _selection_done(self) -> bool:
        return self.want == 0 or self._try_select()

    def _try_select(self) -> bool:
        """Evict, then select ``want`` groups; claim them when the policy can."""
        state, tv = self.state, self.state.trainer_version
        for gid, lag in policies.to_evict(state, trainer_version=tv, window=self.s.window):
            del state.buffer[gid]
            state.groups[gid].status = GroupStatus.EVICTED
            self.evicted.append((gid, lag))
        ids = policies.select(state, self.s.policy, self.want)
        if len(ids) < self.want:
            return False
        step = self.current
        assert step is not None
        for gid in ids:
            del state.buffer[gid]
            group = state.groups[gid]
            group.status = GroupStatus.CLAIMED
            step.lags.append(step.base_trainer_version - group.weight_version_start)  # type: ignore[operator]
        step.microbatches.append(ids)
        self.want = 0
        return True

    def _end(self, status: str, ts: float) -> None:
        step, state = self.current, self.state
        self.want = 0
        if step is None:
            return
        step.status, step.ended_ts = status, ts
        ids = step.group_ids
        if status == "finished":
            for gid in ids:
                state.groups[gid].status = GroupStatus.CONSUMED
            state.trainer_version += 1
        elif ids:
            for gid in ids:
                state.groups[gid].status = GroupStatus.COMMITTED
            merged = sorted([*state.buffer, *ids], key=lambda g: state.groups[g].committed_position)
            state.buffer = dict.fromkeys(merged)
        self.steps.append(step)
        self.current = None


def simulate(events: Iterable[tuple[int, AnyEvent]], settings: WhatIfSettings) -> SimResult:
    """Re-run the policies with ``settings`` over recorded ``(position, event)`` pairs."""
    return _Simulation(settings).run(events)


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
    lengths = result.lengths
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
        sim_tok += [lengths.get(g, 0) for g in step.group_ids]
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
                rec_tok.append(sum(group.lengths))
    evicted_recorded = sum(
        1 for g in state.groups.values() if g.status is GroupStatus.EVICTED
    )
    rec_groups = sum(len(v) for mbs in recorded.values() for v in mbs)
    return {
        "settings": asdict(result.settings),
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
