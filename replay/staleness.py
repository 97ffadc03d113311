"""Staleness analysis of a run: how old the data each step trained on was, and why.

Per finished step: the consumed groups' lag (trainer_version at the step's start minus
the weight version the group's generation started from) -- mean, max and weighted by
model tokens (an episode's observation tokens are masked in the loss: they weigh
nothing) --, how long each group waited in the buffer (its commit ts to the ts
of the microbatch that trained it), the groups evicted while the step was being filled,
and the groups whose generation crossed a weight update (end version != start version).

Per token (``docs/segments.md``): a group's lag is its *oldest* token's (the number
above); ``token_lag_mean`` averages the lag of every model token -- its own version's;
an episode's observation tokens have none and are left out --, and
``max_partial_span`` is the most versions one sample's tokens span (partial rollouts
resume a sample across refits). Without recorded flushes or a commit's
``version_runs`` a token counts at its group's start version, so these equal the
group-level figures.

Most of it is read off the folded state (``StepRecord``/``GroupRecord`` keep history).
What the state forgets is collected during the fold by a :class:`Trace` that observes a
few event types only: the microbatch ts of each claim, each eviction, and the number of
live groups over time.

Time the admission gate was closed -- method: after every event that changes the number
of live groups (admitted, committed or claimed but not consumed) or the trainer/weight
versions, the controller's own gate (``controller.core.policies.gate_open``) is evaluated
on those numbers (closed when live >= capacity -- live plus the groups trained since the
last publish with ``staleness.budget_basis = "per_version"`` -- or when a group dispatched at the
published weight version could be trained beyond the window: trainer_version + live //
groups_per_step - weight_version > window); a closed gate counts until the next such
event. Capacity is the run's, from its recorded config read typed
(``replay.settings.recorded_config``). The gate also waits for a free generator; that
is not visible in the log and not counted.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import Counter
from itertools import compress, islice, repeat
from operator import sub
from dataclasses import dataclass, field
from typing import Any

import msgspec

from controller.core import policies
from controller.core.fold import Callback
from controller.core.state import RunState, StepStatus
from controller.core.step_metrics import model_tokens
from events.schema import (
    GroupCommitted,
    GroupEvicted,
    GroupFailed,
    MicrobatchTrained,
    RolloutAdmitted,
    RunRewound,
    StepAborted,
    StepFinished,
    WeightsPublished,
)
from controller.projector import gc_paused
from replay.settings import recorded_config

#: what the gate's capacity bounds, per ``staleness.budget_basis`` (``policies.budget_count``):
#: the report must say it, or a per-version run's closed time reads as a full buffer of
#: live groups
CAPACITY_COUNTS: dict[policies.BudgetBasis, str] = {
    "live": "live groups",
    "per_version": "live groups + groups trained since the last publish",
}


def describe_gate(basis: policies.BudgetBasis) -> str:
    """How the gate's closed time was measured, for a run of budget ``basis``."""
    return (
        f"gate closed while {CAPACITY_COUNTS[basis]} >= capacity or trainer_version + live "
        "// groups_per_step - weight_version > window, evaluated after each event that "
        "changes them (generator availability is not in the log and not counted)"
    )


def capacity_of(state: RunState) -> int:
    """Buffer capacity of the run, from its recorded config (as the run resolved it)."""
    return recorded_config(state).buffer_capacity


class Trace:
    """What the state does not keep, collected as an observer of the projector's fold
    (``controller.core.fold.Observer``): ``Projector.get(run, observers=[trace])``."""

    def __init__(self) -> None:
        self.ts = array("d")
        self.live = array("l")
        self.buffered = array("l")
        self.gate_closed = array("b")
        #: group id -> ts of the microbatch that (last) claimed it
        self.claim_ts: dict[str, float] = {}
        #: (position, ts, group id, lag, reason) of each eviction
        self.evictions: list[tuple[int, float, str, int, str]] = []
        self._claimed = 0
        self._capacity = 0
        self._per_step = 1
        #: the recorded staleness.budget_basis (read at the first sample)
        self.basis: policies.BudgetBasis = "live"
        self.per_version = False  # basis == "per_version", read at every sample

    def watches(self) -> dict[type, Callback]:
        sample = self._sample
        return {
            RolloutAdmitted: sample,
            GroupCommitted: sample,
            GroupFailed: sample,
            GroupEvicted: self._evicted,
            MicrobatchTrained: self._microbatch,
            StepFinished: self._step_ended,
            StepAborted: self._step_ended,
            WeightsPublished: sample,
            RunRewound: sample,
        }

    def _sample(self, event: Any, position: int, state: RunState) -> None:
        # Runs after most events of a fold: kept to a few attribute reads. RunStarted
        # (never sampled) fixed capacity, groups_per_step and the window for the run.
        if not self._capacity:
            self._capacity = capacity_of(state)
            self._per_step = max(state.groups_per_step, 1)
            self.basis = recorded_config(state).staleness.budget_basis
            self.per_version = self.basis == "per_version"
        buffered = len(state.buffer)
        live = len(state.admitted) + buffered + self._claimed
        closed = not policies.gate_open(
            live, state.trainer_version, dispatch_version=state.weight_version,
            window=state.window_versions,
            groups_per_step=self._per_step, capacity=self._capacity,
            budgeted=live + policies.consumed_since_publish(state) if self.per_version else None,
        )
        self.ts.append(event.ts)
        self.live.append(live)
        self.buffered.append(buffered)
        self.gate_closed.append(closed)

    def _evicted(self, event: GroupEvicted, position: int, state: RunState) -> None:
        self.evictions.append((position, event.ts, event.group_id, event.lag, event.reason))
        self._sample(event, position, state)

    def _microbatch(self, event: MicrobatchTrained, position: int, state: RunState) -> None:
        self.claim_ts.update(dict.fromkeys(event.group_ids, event.ts))
        self._claimed += len(event.group_ids)
        self._sample(event, position, state)

    def _step_ended(self, event: Any, position: int, state: RunState) -> None:
        self._claimed = 0
        self._sample(event, position, state)


# -- report ----------------------------------------------------------------------------


@dataclass
class StepStaleness:
    step: int
    trainer_version: int
    ended_ts: float
    groups: int
    lag_mean: float
    lag_max: int
    lag_token_weighted: float
    wait_mean_s: float
    wait_max_s: float
    evicted: int
    crossed_update: int
    reward_mean: float
    lost: bool
    #: mean over tokens of (trainer_version - the token's own version)
    token_lag_mean: float = 0.0
    #: most versions one consumed sample spans (newest - oldest token)
    max_partial_span: int = 0
    #: turns of the consumed episodes (0: single-turn rollouts)
    turns: int = 0


@dataclass
class StalenessReport:
    run_id: str
    window: int
    groups_per_step: int
    capacity: int
    steps: list[StepStaleness]
    summary: dict[str, Any]
    #: (lag, mean reward) per consumed group, for the reward-vs-lag plot
    reward_vs_lag: list[tuple[int, float]] = field(default_factory=list)
    #: (seconds since the first sample, live groups, buffered groups), down-sampled
    occupancy: list[tuple[float, int, int]] = field(default_factory=list)
    lag_histogram: dict[int, int] = field(default_factory=dict)
    #: how the closed time was measured: ``describe_gate`` of the run's budget basis
    gate_method: str = field(default_factory=lambda: describe_gate("live"))

    @gc_paused
    def to_dict(self) -> dict[str, Any]:
        # msgspec converts the dataclasses in C (tuples become lists, as in JSON):
        # ``dataclasses.asdict`` deep-copies every leaf through Python code.
        out: dict[str, Any] = msgspec.to_builtins(self)
        out["lag_histogram"] = {str(k): v for k, v in sorted(self.lag_histogram.items())}
        return out


@gc_paused
def analyze(state: RunState, trace: Trace, *, max_points: int = 5000) -> StalenessReport:
    """The staleness report of a folded state plus the trace collected while folding."""
    groups = state.groups
    finished = [s for s in state.steps.values() if s.status is StepStatus.FINISHED]
    finished.sort(key=lambda s: s.step)
    ends = [s.ended_position for s in finished]
    evicted_per_step = [0] * len(finished)
    for position, *_ in trace.evictions:
        i = bisect_right(ends, position)
        if i < len(finished):
            evicted_per_step[i] += 1
    rows: list[StepStaleness] = []
    reward_vs_lag: list[tuple[int, float]] = []
    waits: list[float] = []
    all_lags: list[int] = []
    lag_tokens = tokens_total = crossed_total = token_lag_sum = span_max = model_total = 0
    claim_ts = trace.claim_ts
    # One pass per consumed group; every sum keeps the order (and so the exact float
    # result) of the straightforward per-step formulas.
    for record, evicted in zip(finished, evicted_per_step):
        ended_ts = record.ended_ts
        lags, tokens, step_waits, rewards = [], [], [], []
        crossed = step_lag_tokens = step_token_lag = step_span = step_turns = step_model_tokens = 0
        for gid in record.group_ids:
            g = groups[gid]
            lag = g.lag or 0
            # model tokens only: an episode's observation tokens have no version and the
            # loss masks them, so they weigh neither the group's lag nor the token lag
            n_model = model_tokens(g)
            lags.append(lag)
            tokens.append(n_model)
            step_lag_tokens += lag * n_model
            # sum over model tokens of (T - v_t), T = the claiming step's base version
            step_model_tokens += n_model
            step_token_lag += (lag + (g.weight_version_start or 0)) * n_model - g.version_token_sum
            step_span = max(step_span, g.partial_span)
            if g.episode is not None:
                step_turns += sum(len(r) for r in g.episode.rewards)
            step_waits.append(claim_ts.get(gid, ended_ts) - (g.committed_ts or 0.0))
            crossed += g.weight_version_end != g.weight_version_start
            group_rewards = g.rewards
            if group_rewards:
                rewards += group_rewards
                reward_vs_lag.append((lag, sum(group_rewards) / len(group_rewards)))
        total = sum(tokens)
        rows.append(
            StepStaleness(
                step=record.step,
                trainer_version=record.trainer_version or 0,
                ended_ts=ended_ts,
                groups=len(lags),
                lag_mean=sum(lags) / len(lags) if lags else 0.0,
                lag_max=max(lags, default=0),
                lag_token_weighted=step_lag_tokens / total if total else 0.0,
                wait_mean_s=sum(step_waits) / len(step_waits) if step_waits else 0.0,
                wait_max_s=max(step_waits, default=0.0),
                evicted=evicted,
                crossed_update=crossed,
                reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
                lost=record.lost,
                token_lag_mean=step_token_lag / step_model_tokens if step_model_tokens else 0.0,
                max_partial_span=step_span,
                turns=step_turns,
            )
        )
        token_lag_sum += step_token_lag
        model_total += step_model_tokens
        span_max = max(span_max, step_span)
        waits += step_waits
        all_lags += lags
        lag_tokens += step_lag_tokens
        tokens_total += total
        crossed_total += crossed
    hist = dict(Counter(all_lags))  # lags in order of first appearance, as counted
    summary = _summary(state, trace, rows, all_lags, waits, lag_tokens, tokens_total, crossed_total)
    summary["token_lag_mean"] = token_lag_sum / model_total if model_total else 0.0
    summary["max_partial_span"] = span_max
    summary["turns"] = sum(r.turns for r in rows)
    summary["window_basis"] = state.window_basis
    return StalenessReport(
        run_id=state.run_id,
        window=state.window_versions,
        groups_per_step=state.groups_per_step,
        capacity=capacity_of(state),
        steps=rows,
        summary=summary,
        reward_vs_lag=reward_vs_lag,
        occupancy=_downsample(trace, max_points),
        lag_histogram=hist,
        gate_method=describe_gate(trace.basis),
    )


def _summary(
    state: RunState,
    trace: Trace,
    rows: list[StepStaleness],
    lags: list[int],
    waits: list[float],
    lag_tokens: int,
    tokens_total: int,
    crossed: int,
) -> dict[str, Any]:
    closed_s, span_s = _gate_closed_time(trace)
    waits_sorted = sorted(waits)
    aborted = sum(1 for s in state.steps.values() if s.status is StepStatus.ABORTED)
    return {
        # as audit counts them: a step a rewind discarded (RunRewound) is listed, marked
        # lost, but its weights are not the run's any more
        "steps_finished": sum(1 for r in rows if not r.lost),
        "steps_lost": sum(1 for r in rows if r.lost),
        "steps_aborted": aborted,
        "groups_consumed": len(lags),
        "lag_mean": sum(lags) / len(lags) if lags else 0.0,
        "lag_max": max(lags, default=0),
        "lag_token_weighted": lag_tokens / tokens_total if tokens_total else 0.0,
        "wait_mean_s": sum(waits) / len(waits) if waits else 0.0,
        "wait_p50_s": _quantile(waits_sorted, 0.5),
        "wait_p95_s": _quantile(waits_sorted, 0.95),
        "wait_max_s": waits_sorted[-1] if waits_sorted else 0.0,
        "evicted": len(trace.evictions),
        "crossed_update": crossed,
        "crossed_update_fraction": crossed / len(lags) if lags else 0.0,
        "in_flight_now": len(state.admitted),
        "buffered_now": len(state.buffer),
        "gate_closed_s": closed_s,
        "gate_closed_fraction": closed_s / span_s if span_s > 0 else 0.0,
        "observed_span_s": span_s,
    }


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _gate_closed_time(trace: Trace) -> tuple[float, float]:
    ts, closed = trace.ts, trace.gate_closed
    if len(ts) < 2:
        return 0.0, 0.0
    # sum of max(0, ts[i + 1] - ts[i]) over the samples i with the gate closed, in C
    gaps = map(sub, islice(ts, 1, None), ts)
    total = sum(map(max, repeat(0.0), compress(gaps, closed)), 0.0)
    return total, max(0.0, ts[-1] - ts[0])


def _downsample(trace: Trace, max_points: int) -> list[tuple[float, int, int]]:
    n = len(trace.ts)
    if n == 0:
        return []
    stride = max(1, -(-n // max_points))
    t0 = trace.ts[0]
    return [
        (trace.ts[i] - t0, trace.live[i], trace.buffered[i]) for i in range(0, n, stride)
    ]
