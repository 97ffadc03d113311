"""The state of a run at one point of its log, as plain data (``replay --at``).

Ages are measured in the log's own time: ``at_ts`` (the ts of the event at that point)
minus the group's commit (buffer) or admission (in flight) ts. Lag is what the group
would have if trained now: trainer_version - weight_version_start.

The latest usable checkpoint is read from the log and the disk, as recovery reads it
(``controller.retraining.checkpoints_on_disk``): a checkpoint whose files are gone is
named apart, never offered as the one to resume or rewind to.
"""

from __future__ import annotations

from typing import Any

from controller.core.state import CheckpointRecord, RunState
from controller.retraining import checkpoints_on_disk


def state_at(state: RunState, at_ts: float, *, log_end: int | None = None) -> dict[str, Any]:
    """JSON-ready summary of ``state`` (folded through ``state.position``)."""
    tv = state.trainer_version
    buffer = []
    for g in state.iter_buffer():
        buffer.append(
            {
                "group_id": g.group_id,
                "attempt": g.attempt,
                "committed_position": g.committed_position,
                "age_s": at_ts - (g.committed_ts or at_ts),
                "weight_version_start": g.weight_version_start,
                "weight_version_end": g.weight_version_end,
                "lag": state.lag_of(g),
                "reward_mean": sum(g.rewards) / len(g.rewards) if g.rewards else None,
            }
        )
    in_flight = [
        {
            "group_id": g.group_id,
            "attempt": g.attempt,
            "admitted_position": g.admitted_position,
            "age_s": at_ts - g.admitted_ts,
            "dispatch_weight_version": g.dispatch_weight_version,
        }
        for g in state.in_flight()
    ]
    open_step = None
    if state.open_step is not None:
        o = state.open_step
        open_step = {
            "step": o.step,
            "base_trainer_version": o.base_trainer_version,
            "begun_position": o.begun_position,
            "age_s": at_ts - o.begun_ts,
            "microbatches": [
                [
                    {"group_id": gid, "lag": state.groups[gid].lag,
                     "weight_version_start": state.groups[gid].weight_version_start}
                    for gid in mb
                ]
                for mb in o.microbatches
            ],
        }
    present, gone = checkpoints_on_disk(state)
    return {
        "run_id": state.run_id,
        "position": state.position,
        "log_end": log_end,
        "ts": at_ts,
        "epoch": state.epoch,
        "trainer_version": tv,
        "weight_version": state.weight_version,
        "window_versions": state.window_versions,
        "groups_per_step": state.groups_per_step,
        "next_step": state.next_step,
        "step_status": state.step_status.value,
        "open_step": open_step,
        "buffer": buffer,
        "in_flight": in_flight,
        "latest_checkpoint": _checkpoint(present[-1]) if present else None,
        #: usable by the log, but their files (manifest) are gone
        "missing_checkpoints": [_checkpoint(ck) for ck in gone],
        "finished": state.finished,
        #: RunStopped's reason (the failure budget ran out), until a controller resumes it
        "stopped": state.failures.stopped,
        "counts": {
            "groups": len(state.groups),
            "buffered": len(buffer),
            "in_flight": len(in_flight),
            "steps": len(state.steps),
            "released_groups": state.released_groups,
        },
    }


def _checkpoint(ck: CheckpointRecord) -> dict[str, Any]:
    return {"trainer_version": ck.trainer_version, "uri": ck.uri}
