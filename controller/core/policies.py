"""Staleness policies: pure functions of the folded state (no I/O, no clock).

Three decisions, each re-runnable over a recorded log (``replay`` what-if):

* **admission** -- may another prompt group be dispatched now?  Generation may lead
  the trainer by at most ``window`` versions. With G = groups_per_step and L = live
  groups (admitted, buffered or claimed -- not yet consumed), a group dispatched now
  will be trained no later than L // G steps from now, so its lag is bounded by
  ``trainer_version + L // G - dispatch_version``; the gate opens only while that is
  <= window. With dispatch_version == trainer_version this is L < G * (window + 1),
  the buffer capacity; window = 0 is the synchronous on-policy baseline.
  What the capacity counts is the budget basis: ``live`` (L above), or ``per_version``
  -- verl's fully-async run-ahead budget: L plus the groups consumed by steps finished
  since the generators last received weights, so a finished step frees its room only
  once its weights are published (:func:`budget_count`).
* **eviction** -- committed groups whose lag at the next step would exceed the window
  are dropped (each an event). With the gate above this only happens after aborts,
  failures or a generator that lags behind the published version.
* **selection** -- which buffered groups fill the open step:

  - ``in_order``: strict admission order; waits for the oldest admitted group even if
    younger ones are ready (batch composition independent of timing);
  - ``oldest_first``: ready groups with the oldest start weight version first;
  - ``ready_first``: ready groups in commit order (whatever finished first).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Literal

import msgspec

from controller.core.episodes import turn_advantages
from controller.core.segments import WindowBasis
from controller.core.decisions import Stamp, window_evictions
from controller.core.state import GroupRecord, GroupStatus, RunState
from events.schema import GroupEvicted
from events.config_checks import non_negative

SelectionPolicy = Literal["in_order", "oldest_first", "ready_first"]
SELECTION_POLICIES: tuple[SelectionPolicy, ...] = ("in_order", "oldest_first", "ready_first")
BudgetBasis = Literal["live", "per_version"]


def full_capacity(groups_per_step: int, window: int) -> int:
    """Live groups that hold every step the window allows: the gate's default capacity
    and the smallest that cannot deadlock (a step must fill while ``window`` lead)."""
    return groups_per_step * (window + 1)


def min_capacity(groups_per_step: int, window: int, basis: BudgetBasis) -> int:
    """The smallest buffer the gate accepts: the full one for ``live``; one step's groups
    for ``per_version``, whose budget restarts at every publish (verl's threshold 0)."""
    return groups_per_step if basis == "per_version" else full_capacity(groups_per_step, window)


def buffer_capacity(buffer_groups: int, groups_per_step: int, window: int) -> int:
    """The capacity the admission gate enforces: ``buffer_groups``, 0 = the full one."""
    return buffer_groups or full_capacity(groups_per_step, window)


class StalenessSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[staleness]``: the settings of these policies."""

    window_versions: int = 1
    """Dispatch may lead the trainer by at most this many versions; 0 = on-policy."""
    window_basis: WindowBasis = "oldest_token"
    """Which token's version the window bounds at training time: ``oldest_token`` (a
    group's first token), or ``newest_token`` (its last: a group resumed across refits
    with rollout.partial is kept while its tail is fresh; docs/segments.md)."""
    selection: SelectionPolicy = "in_order"
    buffer_groups: int = 0
    """Committed + in-flight groups allowed at once; 0 = groups_per_step * (window + 1)."""
    budget_basis: BudgetBasis = "live"
    """What ``buffer_groups`` counts: ``live`` -- groups admitted and not yet consumed (a
    claimed group counts until its step finishes); ``per_version`` -- verl's fully-async
    budget (``(1 + staleness_threshold)`` x groups per parameter sync): besides those, the
    groups of steps finished since the generators last received weights, so the budget
    restarts at each publish; it allows a buffer down to groups_per_step
    (docs/scale.md, "Porting verl's staleness_threshold")."""

    def __post_init__(self) -> None:
        non_negative("staleness", self, "window_versions", "buffer_groups")

    def capacity(self, groups_per_step: int) -> int:
        """The buffer capacity the admission gate enforces."""
        return buffer_capacity(self.buffer_groups, groups_per_step, self.window_versions)


@dataclass(frozen=True)
class Admission:
    allowed: bool
    #: why the gate is closed (for the stall watchdog and staleness reports)
    reason: str = ""


def _claimed(state: RunState) -> list[str]:
    step = state.open_step
    return [] if step is None else [g for mb in step.microbatches for g in mb]


def live_groups(state: RunState) -> int:
    """Groups admitted but not yet consumed, evicted or failed."""
    return len(state.admitted) + len(state.buffer) + len(_claimed(state))


def _live_unclaimed_in_admission_order(state: RunState) -> list[GroupRecord]:
    groups = state.groups
    live = [groups[g] for g in state.admitted] + [groups[g] for g in state.buffer]
    live.sort(key=lambda g: g.admitted_position)
    return live


def consumed_since_publish(state: RunState) -> int:
    """Groups trained by the steps finished after the version the generators hold: the
    steps that produced weight_version + 1 .. trainer_version (0 when nothing is pending)."""
    return sum(len(step.group_ids) for step in state.steps_after(state.weight_version))


def budget_count(state: RunState, basis: BudgetBasis) -> int:
    """What the gate's capacity bounds (module docstring).

    ``per_version`` is verl's counter (``FullyAsyncRollouter.staleness_samples``): reset at
    each parameter sync to the samples the trainer has not fetched (in flight, interrupted
    or queued), then +1 per sample started; fetching frees nothing. Here the sync is
    ``WeightsPublished``: live groups (the open step's claims among them) count, and so do
    the groups of steps finished since, until their weights are published. With in-line
    publishing (verl's trainer waits for its sync too) the two counts are equal, except
    that a failed or evicted group leaves ours at once (it trains nothing).
    """
    live = live_groups(state)
    return live if basis == "live" else live + consumed_since_publish(state)


def admission(
    state: RunState, *, dispatch_version: int, window: int, groups_per_step: int, capacity: int,
    basis: BudgetBasis = "live",
) -> Admission:
    # The lag clause holds for either window basis: a group that ends before the next
    # refit lands has its newest token at the dispatch version, so the clause is its
    # newest-token lag too. Without it (capacity only, as this gate once was for
    # ``newest_token``) groups admitted while a publish was pending were evicted by the
    # dozen when the trainer was the bottleneck (docs/segments.md).
    live = live_groups(state)
    return _gate(
        live, state.trainer_version, dispatch_version=dispatch_version, window=window,
        groups_per_step=groups_per_step, capacity=capacity,
        budgeted=budget_count(state, basis), basis=basis,
    )


def admission_room(
    state: RunState, *, limit: int, dispatch_version: int, window: int, groups_per_step: int,
    capacity: int, basis: BudgetBasis = "live",
) -> int:
    """How many groups (up to ``limit``) may be admitted now, one after the other.

    An admission only adds a live group, so this is exactly how many times
    :func:`admission` would say yes if each admitted group were folded in before the
    next question -- a batch of admissions is the same decision as that many singles.
    """
    live = live_groups(state)
    budgeted = budget_count(state, basis)
    room = 0
    while room < limit and gate_open(
        live + room, state.trainer_version, dispatch_version=dispatch_version, window=window,
        groups_per_step=groups_per_step, capacity=capacity, budgeted=budgeted + room,
    ):
        room += 1
    return room


def gate_open(
    live: int, trainer_version: int, *, dispatch_version: int, window: int,
    groups_per_step: int, capacity: int, budgeted: int | None = None,
) -> bool:
    """The admission gate on bare numbers: room in the buffer (``budgeted``, the
    :func:`budget_count`, defaults to ``live``), and a group dispatched at
    ``dispatch_version`` now would be trained within the window (module docstring)."""
    count = live if budgeted is None else budgeted
    return count < capacity and trainer_version + live // groups_per_step - dispatch_version <= window


def _gate(
    live: int, trainer_version: int, *, dispatch_version: int, window: int,
    groups_per_step: int, capacity: int, budgeted: int, basis: BudgetBasis,
) -> Admission:
    if gate_open(live, trainer_version, dispatch_version=dispatch_version, window=window,
                 groups_per_step=groups_per_step, capacity=capacity, budgeted=budgeted):
        return Admission(True)
    if budgeted >= capacity and basis == "per_version":
        return Admission(False, f"version budget spent ({budgeted}/{capacity}: {live} live "
                                f"groups, {budgeted - live} trained since the last publish)")
    if budgeted >= capacity:
        return Admission(False, f"buffer full ({live}/{capacity} live groups)")
    steps_ahead = live // groups_per_step
    lag_bound = trainer_version + steps_ahead - dispatch_version
    return Admission(
        False,
        f"window closed (a group dispatched at v{dispatch_version} could be trained "
        f"at v{trainer_version + steps_ahead}, lag {lag_bound} > {window})",
    )


def to_evict(state: RunState, *, trainer_version: int, window: int) -> list[tuple[str, int]]:
    """(group_id, lag) of buffered groups too stale to train at ``trainer_version``."""
    out = []
    newest = state.window_basis == "newest_token"  # the lag the window bounds
    for group in state.iter_buffer():  # buffered groups are committed: lag is an int
        lag: int = state.lag_of(group, trainer_version, newest=newest)  # type: ignore[assignment]
        if lag > window:
            out.append((group.group_id, lag))
    return out


def select(
    state: RunState, policy: SelectionPolicy, limit: int, exclude: Collection[str] = ()
) -> list[str]:
    """Up to ``limit`` buffered group ids, in the order they should be trained.

    ``exclude``: groups about to be evicted, treated as already gone from the buffer.
    """
    if limit <= 0:
        return []
    buffer: Iterable[str] = state.buffer
    if exclude:
        buffer = [g for g in state.buffer if g not in exclude]
    if policy == "ready_first":
        return list(_take(buffer, limit))
    if policy == "oldest_first":
        ready = sorted(
            buffer,
            key=lambda gid: (state.groups[gid].weight_version_start, state.groups[gid].committed_position),
        )
        return ready[:limit]
    if policy == "in_order":
        return _in_order(state, limit, exclude)
    raise ValueError(f"unknown selection policy {policy!r}; choose one of {SELECTION_POLICIES}")


def _take(ids, limit: int):
    for i, gid in enumerate(ids):
        if i >= limit:
            return
        yield gid


def _in_order(state: RunState, limit: int, exclude: Collection[str] = ()) -> list[str]:
    # Walk live groups by admission order; stop at the first one not yet committed.
    out: list[str] = []
    for group in _live_unclaimed_in_admission_order(state):
        if exclude and group.group_id in exclude:
            continue
        if group.status is not GroupStatus.COMMITTED:
            break
        out.append(group.group_id)
        if len(out) == limit:
            break
    return out


def claimed_count(state: RunState) -> int:
    """Groups the open step has claimed so far (0 when no step is open)."""
    step = state.open_step
    return 0 if step is None else sum(len(mb) for mb in step.microbatches)


@dataclass(frozen=True)
class MicrobatchPlan:
    """The train side's next move for the open (or next) step: evict, select, claim."""

    #: groups the microbatch needs (0: the step is full)
    want: int
    #: buffered groups too stale to train, to evict first (in buffer order), as the
    #: events that record it
    evictions: tuple[GroupEvicted, ...]
    #: the microbatch to claim, once it is full; fewer than ``want``: wait for commits
    group_ids: tuple[str, ...]

    @property
    def ready(self) -> bool:
        return len(self.group_ids) == self.want


def plan_microbatch(
    state: RunState,
    *,
    window: int,
    selection: SelectionPolicy,
    groups_per_step: int,
    groups_per_microbatch: int,
    at: Stamp,
) -> MicrobatchPlan:
    """Evict what is too stale at the current trainer_version, then select the next
    microbatch from what is left. The one decision both the controller loop and the
    replay what-if make: they append (or apply) ``evictions`` as they are, and record
    the claim as MicrobatchTrained once the trainer ran it."""
    want = min(groups_per_microbatch, groups_per_step - claimed_count(state))
    stale = to_evict(state, trainer_version=state.trainer_version, window=window)
    ids = select(state, selection, want, exclude={gid for gid, _ in stale})
    return MicrobatchPlan(
        want=max(want, 0),
        evictions=window_evictions(stale, window=window, at=at),
        group_ids=tuple(ids),
    )


def microbatch_advantages(
    state: RunState, group_ids: Iterable[str]
) -> tuple[list[str], list[float], int]:
    """(payload keys, one advantage per key, zero-variance groups) of a microbatch.

    The one place advantages are built: the loop trains on them and recovery's exact
    re-training recomputes them from the recorded rewards, so both must agree bit for bit.
    """
    keys: list[str] = []
    advantages: list[float] = []
    zero_variance = 0
    for gid in group_ids:
        group = state.groups[gid]
        adv, zero_var = group_advantages(group.rewards)
        zero_variance += zero_var
        keys.extend(group.payload_keys)
        advantages.extend(adv)
    return keys, advantages, zero_variance


def microbatch_turn_advantages(state: RunState, group_ids: Iterable[str]) -> list[list[float]]:
    """Per key of ``microbatch_advantages``, its per-turn advantages when its group's
    episodes recorded per-turn rewards (``episodes.turn_advantages``: reward-to-go
    against the group's mean return; ``[]`` for a sample without them); ``[]`` for a
    microbatch without any -- the trainer then uses the per-sample ones alone."""
    out: list[list[float]] = []
    for gid in group_ids:
        group = state.groups[gid]
        if group.episode is None:
            out.extend([] for _ in group.payload_keys)
        else:
            out.extend(turn_advantages(group.episode)[0])
    return out if any(out) else []


def microbatch_versions(state: RunState, group_ids: Iterable[str]) -> list[int]:
    """The weight version each payload key of a microbatch was generated at (its group's
    ``weight_version_start``), in the order of ``microbatch_advantages``' keys."""
    out: list[int] = []
    for gid in group_ids:
        group = state.groups[gid]
        start = group.weight_version_start
        version = group.dispatch_weight_version if start is None else start
        out.extend([version] * len(group.payload_keys))
    return out


def group_advantages(rewards: Collection[float], eps: float = 1e-6) -> tuple[list[float], bool]:
    """GRPO advantages: rewards normalised within the group.

    Returns (advantages, zero_variance). A group whose samples all scored the same
    carries no learning signal: its advantages are exactly 0 (not noise divided by eps)
    and the caller counts it.
    """
    n = len(rewards)
    if n == 0:
        raise ValueError("a group needs at least one reward")
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / n
    std = var**0.5
    if std < eps:
        return [0.0] * n, True
    return [(r - mean) / (std + eps) for r in rewards], False
