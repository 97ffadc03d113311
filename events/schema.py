"""The event vocabulary of a run: every fact the controller records, as immutable values.

Events are past-tense facts. Each one is a frozen msgspec Struct tagged with its class
name (the ``type`` field on the wire), and carries:

* ``event_id`` -- deterministic, built from what the event is about
  (``step:12:finished``, ``group:g0042:committed:a1``), so a retried append of the same
  fact is recognised by the store and written once;
* ``epoch`` -- the fencing token of the controller that wrote it;
* ``ts`` -- wall-clock seconds, taken by the *shell* when the event was made; the core
  never reads a clock, it only reads this field;
* ``schema_version`` -- bumped when a type's shape changes; ``events.codec`` upcasts
  older versions so old logs decode forever (golden fixtures in tests guard this).

This module is pure data: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from typing import Any, Final, Union

import msgspec

# The values events carry live in ``events.values``; re-exported here, where every
# writer and reader has always imported them from.
from events.values import (  # noqa: F401
    Epoch,
    EnvCall,
    EnvResult,
    GroupId,
    Position,
    Segment,
    SegmentKind,
    TrainerVersion,
    WeightVersion,
)

#: The schema version written by this code for every event type.
CURRENT_SCHEMA_VERSION: Final = 1


class Event(msgspec.Struct, frozen=True, tag=True, tag_field="type", kw_only=True):
    """Fields every event carries. Never instantiated directly."""

    event_id: str
    epoch: Epoch
    ts: float
    schema_version: int = CURRENT_SCHEMA_VERSION


class RunStarted(Event, frozen=True):
    """A new run: the full resolved config, written once as the first event."""

    run_id: str
    config: dict[str, Any]
    seed: int
    code_version: str
    #: dispatch may lead the trainer by at most this many versions (0 = on-policy)
    window_versions: int
    groups_per_step: int
    samples_per_group: int


class ControllerStarted(Event, frozen=True):
    """A controller claimed ``epoch`` (the fencing token) and took over the run."""

    host: str
    pid: int


class RolloutAdmitted(Event, frozen=True):
    """Intent: a prompt group is about to be dispatched to a generator."""

    group_id: GroupId
    attempt: int
    prompt_index: int
    prompt_ref: str
    #: weight version the generator is expected to hold at dispatch
    weight_version: WeightVersion
    n_samples: int
    sample_seed: int
    #: the generator the group is dispatched to ("" in logs written before it was
    #: recorded); what the trace's per-generator tracks are built from
    generator: str = ""


class GroupCommitted(Event, frozen=True):
    """Fact: every sample of the group is stored in the data plane."""

    group_id: GroupId
    attempt: int
    weight_version_start: WeightVersion
    weight_version_end: WeightVersion
    payload_keys: list[str]
    rewards: list[float]
    #: completion lengths in tokens, one per sample
    lengths: list[int]


class SegmentsRecorded(Event, frozen=True):
    """Fact: a flush of an in-flight group is durable (its segment rows are in the data
    plane); one event per flush, O(samples), never O(tokens) (``docs/segments.md``)."""

    group_id: GroupId
    attempt: int
    #: 0, 1, 2, ... per (group, attempt)
    index: int
    kind: SegmentKind
    #: the version that sampled every token of this flush; None for observation tokens
    weight_version: WeightVersion | None
    #: one per sample with new tokens, each starting where the sample's recorded
    #: tokens end (across attempts)
    segments: list[Segment]


class EnvStepsRequested(Event, frozen=True):
    """Intent: these environment/tool calls of a group's episodes are about to be made.

    Written after the model turns they answer are recorded (``SegmentsRecorded``) and
    before any of the calls runs; every call carries its idempotency key. A call whose
    result never came is made again with the same key only if the environment declared
    it deduplicates (``dedupes_by_key``); otherwise its episode is restarted instead."""

    group_id: GroupId
    attempt: int
    #: 0, 1, 2, ... per (group, attempt) over this and ``EnvStepsCompleted``, gapless
    index: int
    #: the task that made the environment (``task.name``)
    env: str
    #: the environment's declaration: a call re-issued with the same key runs once
    dedupes_by_key: bool
    calls: list[EnvCall]


class EnvStepsCompleted(Event, frozen=True):
    """Fact: these environment/tool calls returned; their per-turn rewards. The
    observations that follow them are the ``kind="observation"`` segments appended
    right after this event."""

    group_id: GroupId
    attempt: int
    #: shares the sequence of ``EnvStepsRequested.index``
    index: int
    results: list[EnvResult]


class EpisodesRestarted(Event, frozen=True):
    """Decision: these samples' episodes start again from the prompt, with new keys.

    Each had a call whose outcome is unknown (intent, no result) to an environment that
    cannot deduplicate: making it again could repeat its side effect, so it is never
    made again. The samples' recorded tokens and calls are dropped; their next calls
    carry ``restart + 1`` in their key."""

    group_id: GroupId
    #: the failed attempt the decision follows
    attempt: int
    samples: list[int]
    reason: str


class GroupFailed(Event, frozen=True):
    """Generation of one attempt failed or was lost; the group may be re-admitted."""

    group_id: GroupId
    attempt: int
    reason: str


class GroupEvicted(Event, frozen=True):
    """The eviction policy dropped a committed group (e.g. lag past the window)."""

    group_id: GroupId
    reason: str
    lag: int


class StepBegun(Event, frozen=True):
    """Intent: ``begin_train_step`` is about to be called."""

    step: int
    base_trainer_version: TrainerVersion


class MicrobatchTrained(Event, frozen=True):
    """Fact: ``train_microbatch`` returned for these groups (claims them for the step)."""

    step: int
    index: int
    group_ids: list[GroupId]
    num_sequences: int
    num_tokens: int


class StepFinished(Event, frozen=True):
    """Fact: ``finish_train_step`` returned; the trainer is now at ``trainer_version``."""

    step: int
    trainer_version: TrainerVersion
    metrics: dict[str, float]
    grad_norm: float
    weights_digest: str


class StepAborted(Event, frozen=True):
    """The open step was abandoned; its groups return to the buffer."""

    step: int
    reason: str


class WeightsPublished(Event, frozen=True):
    """Generators acknowledged holding ``weight_version``."""

    weight_version: WeightVersion
    generators: list[str]


class CheckpointSaved(Event, frozen=True):
    """A checkpoint of ``trainer_version`` is durable (fsynced and renamed) at ``uri``."""

    trainer_version: TrainerVersion
    uri: str
    sha256: str


class CheckpointRejected(Event, frozen=True):
    """A checkpoint failed verification on load and was not used."""

    trainer_version: TrainerVersion
    uri: str
    reason: str


class PayloadsReleased(Event, frozen=True):
    """Data-plane rows of these consumed groups were deleted (a checkpoint covers them)."""

    group_ids: list[GroupId]


class WorkerLost(Event, frozen=True):
    """A worker (trainer or generator actor) died or stopped answering and was restarted."""

    worker: str
    role: str
    reason: str


class RunRewound(Event, frozen=True):
    """Explicit, user-requested rewind to a checkpoint after payloads were lost.

    The finished steps after ``to_trainer_version`` no longer describe the weights; they
    are named here so ``audit`` can show exactly what was lost.
    """

    to_trainer_version: TrainerVersion
    lost_steps: list[int]
    lost_group_ids: list[GroupId]
    reason: str


class RunFinished(Event, frozen=True):
    """The run ended cleanly."""

    reason: str


class RunStopped(Event, frozen=True):
    """The controller stopped the run on its own: a failure budget ran out
    (``controller.core.failures``). The run is not finished: a resume continues it once
    the cause is fixed, with a fresh budget."""

    #: what ran out, in one line (groups failed in a row, since which position)
    reason: str
    #: the root cause: the worker's exception type and message, as it recorded it
    cause: str


AnyEvent = Union[
    RunStarted,
    ControllerStarted,
    RolloutAdmitted,
    GroupCommitted,
    SegmentsRecorded,
    EnvStepsRequested,
    EnvStepsCompleted,
    EpisodesRestarted,
    GroupFailed,
    GroupEvicted,
    StepBegun,
    MicrobatchTrained,
    StepFinished,
    StepAborted,
    WeightsPublished,
    CheckpointSaved,
    CheckpointRejected,
    PayloadsReleased,
    WorkerLost,
    RunRewound,
    RunFinished,
    RunStopped,
]

EVENT_TYPES: Final[dict[str, type[Event]]] = {
    cls.__name__: cls for cls in AnyEvent.__args__  # type: ignore[attr-defined]
}


class StoredEvent(msgspec.Struct, frozen=True):
    """An event together with its position (1-based, gapless) in the run's log."""

    position: Position
    event: AnyEvent


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


def env_steps_event_id(group_id: str, what: str, attempt: int, index: int) -> str:
    """``what`` is "requested" or "completed"; ``index`` runs over both, per attempt."""
    return f"group:{group_id}:env:{what}:a{attempt}:k{index}"


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
