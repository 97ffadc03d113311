"""Deterministic event ids (re-exported by ``events.schema``, where writers import them).

Pure string building: no I/O, no clock, no randomness.
"""

from __future__ import annotations


# Deterministic event ids: one helper per fact so every writer spells them the same way.


def run_started_id(run_id: str) -> str:
    return f"run:{run_id}:started"


def controller_started_id(epoch: int) -> str:
    return f"controller:{epoch}:started"


def group_event_id(group_id: str, what: str, attempt: int | None = None) -> str:
    suffix = "" if attempt is None else f":a{attempt}"
    return f"group:{group_id}:{what}{suffix}"


def segments_event_id(group_id: str, attempt: int, index: int) -> str:
    return f"group:{group_id}:segments:a{attempt}:k{index}"


def segments_dropped_id(group_id: str, attempt: int) -> str:
    return f"group:{group_id}:segments-dropped:a{attempt}"


def env_steps_event_id(group_id: str, what: str, attempt: int, index: int) -> str:
    """``what`` is "requested" or "completed"; ``index`` runs over both, per attempt."""
    return f"group:{group_id}:env:{what}:a{attempt}:k{index}"


def episode_turns_event_id(group_id: str, attempt: int, segment_index: int, env_index: int) -> str:
    # one pause: the first of its segment and env indices name it, as they name the
    # events it stands for
    return f"group:{group_id}:turns:a{attempt}:k{segment_index}:e{env_index}"


def episodes_restarted_id(group_id: str, attempt: int) -> str:
    # at most one per failed attempt: it is decided once, before the next admission
    return f"group:{group_id}:restarted:a{attempt}"


def step_event_id(step: int, what: str) -> str:
    # Step numbers are never reused: a step begun after an abort gets the next number,
    # so ``step:K:begun`` names one fact for the whole life of the run.
    return f"step:{step}:{what}"


def microbatch_event_id(step: int, index: int) -> str:
    return f"step:{step}:microbatch:{index}"


# Facts that may be recorded again for the same subject (a version published twice, a
# release after a restart) name the writer's epoch and the log position it appends at:
# unique in the log, and the same on a retry of the same append.


def weights_published_id(version: int, epoch: int, position: int) -> str:
    return f"weights:{version}:published:e{epoch}:p{position}"


def checkpoint_saved_id(version: int, epoch: int) -> str:
    # the checkpoint's directory names the epoch too: one save per version and epoch
    return f"checkpoint:{version}:saved:e{epoch}"


def checkpoint_rejected_id(version: int, epoch: int, position: int) -> str:
    return f"checkpoint:{version}:rejected:e{epoch}:p{position}"


def payloads_released_id(version: int, epoch: int, position: int) -> str:
    return f"payloads:released:v{version}:e{epoch}:p{position}"


def run_rewound_id(epoch: int, position: int) -> str:
    return f"run:rewound:e{epoch}:p{position}"


def worker_lost_id(worker: str, epoch: int, position: int) -> str:
    return f"worker:{worker}:lost:e{epoch}:p{position}"


def run_finished_id(epoch: int, position: int) -> str:
    return f"run:finished:e{epoch}:p{position}"


def run_stopped_id(epoch: int, position: int) -> str:
    return f"run:stopped:e{epoch}:p{position}"
