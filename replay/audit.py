"""Audit of a run: the trainer_version history and every invariant of docs/DESIGN.md, checked.

The check is the reducer itself: folding the log raises ``InvariantViolation`` at the
first event that breaks a rule (one open step at a time; trainer_version moves only
by +1 at StepFinished; a group is consumed by at most one finished step; a claimed
group was committed and not evicted; lag at consumption within the window; no events
from a stale epoch; payloads released only under a checkpoint) and the codec raises
``EventDecodeError`` at the first malformed entry. Both come back as a problem naming
the position (see ``controller.projector``). On top of that, :func:`first_cross_check_problem` re-derives the
history rules from the final state, independently of the reducer's bookkeeping, so a
reducer bug cannot hide a broken log.

The history lists, per trainer_version: the step that produced it, when, the groups
it trained on with their weight versions and lag, key metrics, checkpoints of it, and
whether a rewind discarded it. Then aborts, controller epochs, rewinds, rejected
checkpoints and workers lost.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from typing import Any, TextIO

import msgspec

from controller.core.state import GroupStatus, RunState, StepStatus
from controller.projector import LogProblem, Projection, gc_paused

INVARIANTS = (
    "events decode (known type, valid fields, supported schema_version)",
    "gapless positions; RunStarted first",
    "events carry the current epoch (stale or unclaimed epochs rejected)",
    "one open step at a time; step numbers never reused",
    "trainer_version moves only by +1 at StepFinished",
    "a claimed group was committed and not evicted or claimed before",
    "a group is consumed by at most one finished step",
    "lag at consumption within [0, window]",
    "payloads released only when a checkpoint covers them",
)

KEY_METRICS = ("loss", "reward/mean", "reward_mean", "lag/mean", "kl")
_KEY_METRICS = frozenset(KEY_METRICS)


@dataclass
class VersionRow:
    trainer_version: int
    step: int
    ended_ts: float
    ended_position: int
    groups: list[dict[str, Any]]
    lag_mean: float
    lag_max: int
    metrics: dict[str, float]
    grad_norm: float | None
    weights_digest: str | None
    checkpoints: list[str]
    lost: bool


@dataclass
class AuditReport:
    run_id: str
    log_end: int
    checked_through: int
    problem: dict[str, Any] | None
    invariants: list[str]
    history: list[VersionRow]
    aborts: list[dict[str, Any]]
    epochs: list[dict[str, Any]]
    rewinds: list[dict[str, Any]]
    rejected_checkpoints: list[dict[str, Any]]
    workers_lost: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.problem is None

    @gc_paused
    def to_dict(self) -> dict[str, Any]:
        # msgspec converts the dataclasses in C: ``dataclasses.asdict`` deep-copies every
        # leaf through Python code and took longer than the fold on a 1M-event log.
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


@gc_paused
def build_report(result: Projection) -> AuditReport:
    state = result.state
    problem = result.problem or first_cross_check_problem(state)
    history = version_history(state)
    return AuditReport(
        run_id=state.run_id,
        log_end=result.log_end,
        checked_through=state.position,
        problem=None if problem is None else problem.to_dict(),
        invariants=list(INVARIANTS),
        history=history,
        aborts=[
            {
                "step": s.step,
                "base_trainer_version": s.base_trainer_version,
                "reason": s.abort_reason,
                "ts": s.ended_ts,
                "position": s.ended_position,
                "groups_returned": list(s.group_ids),
            }
            for s in sorted(state.steps.values(), key=lambda s: s.step)
            if s.status is StepStatus.ABORTED
        ],
        epochs=[_plain(e) for e in state.epochs],
        rewinds=[_plain(r) for r in state.rewinds],
        rejected_checkpoints=[_plain(r) for r in state.rejected_checkpoints],
        workers_lost=[_plain(w) for w in state.workers_lost],
        summary={
            "trainer_version": state.trainer_version,
            "weight_version": state.weight_version,
            "epoch": state.epoch,
            "finished": state.finished,
            "finished_reason": state.finished_reason,
            "steps_finished": sum(1 for r in history if not r.lost),
            "steps_lost": sum(1 for r in history if r.lost),
            "steps_aborted": sum(
                1 for s in state.steps.values() if s.status is StepStatus.ABORTED
            ),
            "checkpoints": len(state.checkpoints),
            "restarts": max(0, len(state.epochs) - 1),
            "episodes": episode_counts(state),
        },
    )


def episode_counts(state: RunState) -> dict[str, int] | None:
    """How many committed episodes and turns the log holds (None: no multi-turn group),
    and the uncommitted groups with recorded calls: in flight, or failed (their calls
    are kept for a retry; a group out of attempts keeps them for good, no event says it
    was given up)."""
    played = [g.episode for g in state.groups.values() if g.episode is not None]
    if not played and not state.episodes:
        return None
    turns = [len(rewards) for e in played for rewards in e.rewards]
    failed = sum(1 for gid in state.episodes if state.groups[gid].status is GroupStatus.FAILED)
    return {"groups": len(played), "episodes": len(turns), "turns": sum(turns),
            "turns_max": max(turns, default=0), "groups_in_flight": len(state.episodes) - failed,
            "groups_failed": failed}


def _plain(record: Any) -> dict[str, Any]:
    return msgspec.to_builtins(record)  # type: ignore[no-any-return]


def version_history(state: RunState) -> list[VersionRow]:
    groups = state.groups
    ckpts: dict[int, list[str]] = {}
    for c in state.checkpoints:
        flag = " (rejected)" if c.rejected else " (lost)" if c.lost else ""
        ckpts.setdefault(c.trainer_version, []).append(c.uri + flag)
    rows = []
    finished = [s for s in state.steps.values() if s.status is StepStatus.FINISHED]
    for s in sorted(finished, key=lambda s: s.step):
        members = []
        lags = []
        for gid in s.group_ids:
            g = groups[gid]
            lag = g.lag or 0
            lags.append(lag)
            members.append(
                {
                    "group_id": gid,
                    "weight_version_start": g.weight_version_start,
                    "weight_version_end": g.weight_version_end,
                    "lag": lag,
                }
            )
        version = s.trainer_version or 0
        metrics = s.metrics
        rows.append(
            VersionRow(
                trainer_version=version,
                step=s.step,
                ended_ts=s.ended_ts,
                ended_position=s.ended_position,
                groups=members,
                lag_mean=sum(lags) / len(lags) if lags else 0.0,
                lag_max=max(lags, default=0),
                # usually every metric is a key one: one C-level copy then
                metrics=dict(metrics)
                if metrics.keys() <= _KEY_METRICS
                else {k: v for k, v in metrics.items() if k in _KEY_METRICS},
                grad_norm=s.grad_norm,
                weights_digest=s.weights_digest,
                checkpoints=ckpts.get(version, []) if not s.lost else [],
                lost=s.lost,
            )
        )
    return rows


def first_cross_check_problem(state: RunState) -> LogProblem | None:
    """Re-derive the history rules from the final state; the first broken one, if any."""
    seen: dict[str, int] = {}
    expected_version = None
    window = state.window_versions
    finished = [s for s in state.steps.values() if s.status is StepStatus.FINISHED]
    for s in sorted(finished, key=lambda s: s.ended_position):
        where = s.ended_position
        if s.trainer_version != s.base_trainer_version + 1:
            return LogProblem(where, "invariant", f"step {s.step} moved trainer_version by "
                              f"{(s.trainer_version or 0) - s.base_trainer_version}")
        if expected_version is not None and s.base_trainer_version > expected_version:
            return LogProblem(where, "invariant", f"step {s.step} starts at version "
                              f"{s.base_trainer_version}, after {expected_version}")
        expected_version = s.trainer_version
        for gid in s.group_ids:
            if gid in seen and not s.lost:
                return LogProblem(where, "invariant", f"group {gid} consumed by steps "
                                  f"{seen[gid]} and {s.step}")
            seen[gid] = s.step
            g = state.groups[gid]
            lag = s.base_trainer_version - (g.weight_version_start or 0)
            if state.window_basis == "newest_token":
                lag = min(lag, s.base_trainer_version - (g.weight_version_end or 0))
            if not 0 <= lag <= window:
                return LogProblem(where, "invariant", f"group {gid} trained at lag {lag} "
                                  f"outside [0, {window}] in step {s.step}")
    return None


CSV_FIELDS = (
    "trainer_version", "step", "ended_ts", "ended_position", "groups", "lag_mean",
    "lag_max", "metrics", "grad_norm", "weights_digest", "checkpoints", "lost",
)


def write_csv(report: AuditReport, out: TextIO) -> None:
    """One row per trainer_version; groups as ``id@start-end:lag`` separated by spaces."""
    writer = csv.writer(out)
    writer.writerow(CSV_FIELDS)
    for row in report.history:
        groups = " ".join(
            f"{g['group_id']}@{g['weight_version_start']}-{g['weight_version_end']}:{g['lag']}"
            for g in row.groups
        )
        metrics = " ".join(f"{k}={v:.6g}" for k, v in sorted(row.metrics.items()))
        writer.writerow(
            (
                row.trainer_version, row.step, f"{row.ended_ts:.3f}", row.ended_position, groups,
                f"{row.lag_mean:.3f}", row.lag_max, metrics,
                "" if row.grad_norm is None else f"{row.grad_norm:.6g}",
                row.weights_digest or "", " ".join(row.checkpoints), row.lost,
            )
        )
