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
    SegmentFlush,
    SegmentKind,
    TrainerVersion,
    WeightVersion,
)

# The id helpers live in ``events.event_ids``; re-exported here, where every writer has
# always imported them from.
from events.event_ids import (  # noqa: F401
    run_started_id,
    controller_started_id,
    group_event_id,
    segments_event_id,
    segments_dropped_id,
    env_steps_event_id,
    episode_turns_event_id,
    episodes_restarted_id,
    step_event_id,
    microbatch_event_id,
    weights_published_id,
    checkpoint_saved_id,
    checkpoint_rejected_id,
    payloads_released_id,
    run_rewound_id,
    worker_lost_id,
    run_finished_id,
    run_stopped_id,
)

#: The schema version written by this code for every event type.
CURRENT_SCHEMA_VERSION: Final = 1


class Event(msgspec.Struct, frozen=True, tag=True, tag_field="type", kw_only=True, gc=False):
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
    #: per sample, the versions of its completion's tokens, run-length encoded
    #: ``[v0, n0, v1, n1, ...]``; written for a group whose tokens after its last
    #: recorded flush span refits (``docs/segments.md``). Empty: those tokens all have
    #: ``weight_version_end`` (with no flush recorded, each counts at the start)
    version_runs: list[list[int]] = []


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


class SegmentsDropped(Event, frozen=True):
    """Fact: recorded segment rows of a failed attempt's group are gone from the data
    plane (a resume could not read them). Every sample with a lost row loses all its
    recorded segments and restarts from the prompt on the next attempt; the other
    samples keep theirs (``docs/segments.md``, recovery rule 6)."""

    group_id: GroupId
    #: the attempt whose resume found the rows missing (it has failed)
    attempt: int
    #: the lost rows: data-plane keys of segments the group recorded
    keys: list[str]
    #: one line naming the missing key(s), as the data plane reported them
    reason: str


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
    #: the calls are an agent's (``workers.envs.agent``): its code runs again from the
    #: start on a resume, so when it cannot deduplicate, each of its episodes with a
    #: recorded call starts over (``EpisodesRestarted``), not only one left without a result
    agent: bool = False


class EnvStepsCompleted(Event, frozen=True):
    """Fact: these environment/tool calls returned; their per-turn rewards. The
    observations that follow them are the ``kind="observation"`` segments appended
    right after this event."""

    group_id: GroupId
    attempt: int
    #: shares the sequence of ``EnvStepsRequested.index``
    index: int
    results: list[EnvResult]


class EpisodeTurnsRecorded(Event, frozen=True):
    """Fact: one pause of a group's episodes, in one append -- the events it stands for
    are, in this order, ``EnvStepsCompleted`` (``results``), one ``SegmentsRecorded``
    per entry of ``flushes`` (observations, then model turns), ``EnvStepsRequested``
    (``calls``: their intent is durable before any of them runs). Every reader sees
    those events, never this one (``controller.core.turns.expand``); one append instead
    of up to four is what a pause costs the controller (``docs/agents.md``, "Cost")."""

    group_id: GroupId
    attempt: int
    #: the ``SegmentsRecorded.index`` of the first flush (the others follow it)
    segment_index: int
    #: the env event index of the results (or of the calls, when there are no results);
    #: the calls take the next one after the results
    env_index: int
    results: list[EnvResult]
    flushes: list[SegmentFlush]
    #: the task that made the environment, and its declaration (``EnvStepsRequested``)
    env: str
    dedupes_by_key: bool
    calls: list[EnvCall]
    #: as ``EnvStepsRequested.agent``
    agent: bool = False


class EpisodesRestarted(Event, frozen=True):
    """Decision: these samples' episodes start again from the prompt, with new keys.

    Each had a call whose outcome is unknown (intent, no result) to an environment that
    cannot deduplicate: making it again could repeat its side effect, so it is never
    made again. For an agent that cannot deduplicate (``EnvStepsRequested.agent``), each
    had any recorded call: its code runs every call again on a resume. The samples' recorded tokens and calls are dropped; their next calls
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
    SegmentsDropped,
    EnvStepsRequested,
    EnvStepsCompleted,
    EpisodeTurnsRecorded,
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
