"""The controller's state: a pure fold of the event log (see ``controller.core.reducer``).

Everything here is plain data (mutable msgspec Structs) plus small read-only helpers
that the controller loop, the policies and replay/audit read. The reducer is the only
writer. A whole ``RunState`` encodes to msgpack (``encode_state``) so snapshots keyed
by log position make recovery O(tail).

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import enum
from typing import Any, Final, Iterator

import msgspec

from controller.core.errors import SnapshotDecodeError
from controller.core.failures import FailureRecord
from controller.core.episodes import EpisodeSummary, InflightEpisodes
from controller.core.packing import F64, I64, KEY_SEPARATOR, packer
from controller.core.segments import InflightSegments

#: Bumped whenever the shape of ``RunState`` changes; an older snapshot is refused
#: (the caller folds the log from the start instead -- snapshots are only a cache).
#: 2: a group's payload keys, rewards and lengths are packed (``GroupRecord``).
#: 3: the failure streaks (``failures``, ``controller.core.failures``).
#: 4: segments (``RunState.inflight``, per-token version sums, the window's basis).
#: 5: episodes (``RunState.episodes``, ``GroupRecord.episode``). 6: ``obs_tokens``.
STATE_FORMAT_VERSION: Final = 6

class GroupStatus(enum.Enum):
    """Lifecycle of one prompt group (the reducer enforces every arrow)::

        ADMITTED --> COMMITTED --> CLAIMED --> CONSUMED --> RELEASED
           |            |  ^          |            |
           v            v  +-aborted--+            v
         FAILED      EVICTED                     LOST

    * ADMITTED -> FAILED: generation failed or was lost; the group may be re-admitted
      as ``attempt + 1`` (FAILED -> ADMITTED), or dropped.
    * COMMITTED -> CLAIMED: a microbatch of the open step trained on it.
    * CLAIMED -> COMMITTED: the open step was aborted (back into the buffer, in its
      original commit order).
    * CLAIMED -> CONSUMED: the step finished.
    * CONSUMED -> RELEASED: its payload rows were deleted after a checkpoint covered the
      step that consumed it.
    * CONSUMED/RELEASED -> LOST: a RunRewound discarded the step that consumed it (that
      step no longer describes the weights).
    * COMMITTED -> EVICTED: the eviction policy dropped it. EVICTED, FAILED and LOST
      payloads may be released any time (``payload_released``; status unchanged).
    """

    ADMITTED = "admitted"
    COMMITTED = "committed"
    CLAIMED = "claimed"
    CONSUMED = "consumed"
    RELEASED = "released"
    FAILED = "failed"
    EVICTED = "evicted"
    LOST = "lost"


class StepStatus(enum.Enum):
    """Lifecycle of a training step::

        IDLE --> OPEN --> (MicrobatchTrained)* --> FINISHED   (trainer_version += 1)
                   \\-----------------------------> ABORTED    (trainer_version unchanged)

    ``RunState.step_status`` is IDLE or OPEN; a ``StepRecord`` is FINISHED or ABORTED.
    """

    IDLE = "idle"
    OPEN = "open"
    FINISHED = "finished"
    ABORTED = "aborted"


class GroupRecord(msgspec.Struct, kw_only=True, gc=False):
    """Everything the log says about one prompt group (its latest attempt)."""

    group_id: str
    status: GroupStatus
    attempt: int
    prompt_index: int
    prompt_ref: str
    n_samples: int
    sample_seed: int
    #: weight version the generator was expected to hold at dispatch
    dispatch_weight_version: int
    admitted_ts: float
    admitted_position: int
    committed_ts: float | None = None
    #: also the group's place in the buffer order (commit order)
    committed_position: int | None = None
    #: the oldest / newest token version of the committed group
    weight_version_start: int | None = None
    weight_version_end: int | None = None
    #: sum over its model tokens of their versions (``controller.core.segments``), the
    #: most versions one sample spans (newest - oldest token), and how many of its
    #: ``lengths`` are an episode's observation tokens (they have no version)
    version_token_sum: int = 0
    partial_span: int = 0
    obs_tokens: int = 0
    #: an episode group's turns: first token and reward of each (``core.episodes``)
    episode: EpisodeSummary | None = None
    # Packed, one object each instead of one per sample (read them through the
    # ``payload_keys`` / ``rewards`` / ``lengths`` properties). A long log's state holds
    # every group; per-sample strings, floats and ints were most of its memory (half of
    # a fold's RSS) and of the fold's allocations. Not tracked by the collector either.
    #: ``pack_keys``: the keys joined by KEY_SEPARATOR, or a tuple if a key holds it
    packed_keys: str | tuple[str, ...] = ()
    #: ``pack_f64``: little-endian float64 per sample
    rewards_f64: bytes = b""
    #: ``pack_i64``: little-endian int64 per sample, completion lengths in tokens
    lengths_i64: bytes = b""
    #: step whose microbatch claimed it (cleared again if that step aborted)
    claimed_step: int | None = None
    consumed_step: int | None = None
    #: base trainer_version of the claiming step - weight_version_start; set at claim,
    #: kept at consumption (the lag the group was trained at), cleared on abort
    lag: int | None = None
    failed_reason: str | None = None
    evicted_reason: str | None = None
    evicted_lag: int | None = None
    payload_released: bool = False

    @property
    def payload_keys(self) -> tuple[str, ...]:
        """Data-plane keys of the committed samples (empty before the commit)."""
        packed = self.packed_keys
        return tuple(packed.split(KEY_SEPARATOR)) if type(packed) is str else packed

    @property
    def rewards(self) -> tuple[float, ...]:
        data = self.rewards_f64
        return packer(F64, "d", len(data) >> 3).unpack(data)

    @property
    def lengths(self) -> tuple[int, ...]:
        data = self.lengths_i64
        return packer(I64, "q", len(data) >> 3).unpack(data)


class OpenStep(msgspec.Struct, kw_only=True):
    """The one step between StepBegun and StepFinished/StepAborted."""

    step: int
    base_trainer_version: int
    begun_ts: float
    begun_position: int
    #: group ids of each microbatch, in index order
    microbatches: list[tuple[str, ...]] = []
    num_sequences: int = 0
    num_tokens: int = 0


class StepRecord(msgspec.Struct, kw_only=True, gc=False):
    """History of a finished or aborted step (audit, replay and exact retraining)."""

    step: int
    base_trainer_version: int
    #: base + 1 when FINISHED; None when ABORTED
    trainer_version: int | None
    status: StepStatus
    #: every group of the step, flattened in microbatch order
    group_ids: tuple[str, ...]
    #: retraining must repeat exactly this order
    microbatches: list[tuple[str, ...]]
    num_sequences: int
    num_tokens: int
    metrics: dict[str, float] = {}
    grad_norm: float | None = None
    weights_digest: str | None = None
    begun_ts: float
    begun_position: int
    ended_ts: float
    ended_position: int
    abort_reason: str | None = None
    #: a RunRewound discarded this finished step
    lost: bool = False


class EpochRecord(msgspec.Struct, kw_only=True, gc=False):
    """One controller start (ControllerStarted)."""

    epoch: int
    host: str
    pid: int
    ts: float
    position: int


class CheckpointRecord(msgspec.Struct, kw_only=True, gc=False):
    trainer_version: int
    uri: str
    sha256: str
    ts: float
    position: int
    #: a CheckpointRejected named this checkpoint: it failed verification on load
    rejected: bool = False
    #: a RunRewound went back past it: it describes weights that no longer exist
    lost: bool = False


class CheckpointRejection(msgspec.Struct, kw_only=True, gc=False):
    trainer_version: int
    uri: str
    reason: str
    ts: float
    position: int


class WorkerLossRecord(msgspec.Struct, kw_only=True, gc=False):
    worker: str
    role: str
    reason: str
    ts: float
    position: int


class RewindRecord(msgspec.Struct, kw_only=True, gc=False):
    from_trainer_version: int
    to_trainer_version: int
    lost_steps: list[int]
    lost_group_ids: list[str]
    reason: str
    ts: float
    position: int


class RunState(msgspec.Struct, kw_only=True):
    """The folded state of one run. Written only by ``controller.core.reducer``."""

    state_format: int = STATE_FORMAT_VERSION
    #: True once RunStarted has been applied
    started: bool = False
    run_id: str = ""
    config: dict[str, Any] = {}
    seed: int = 0
    code_version: str = ""
    window_versions: int = 0
    #: which token's version the window bounds (``controller.core.segments``)
    window_basis: str = "oldest_token"
    groups_per_step: int = 0
    samples_per_group: int = 0
    #: newest claimed epoch (RunStarted's, then each ControllerStarted's)
    epoch: int = 0
    epochs: list[EpochRecord] = []
    #: version of the trainer's weights per the log (moves +1 per StepFinished)
    trainer_version: int = 0
    #: last version generators acknowledged (WeightsPublished)
    weight_version: int = 0
    #: number the next StepBegun must carry (never reused)
    next_step: int = 0
    open_step: OpenStep | None = None
    groups: dict[str, GroupRecord] = {}
    #: COMMITTED, unclaimed group ids in commit order (dict as an ordered set: O(1)
    #: add/remove); values are unused
    buffer: dict[str, None] = {}
    #: ADMITTED group ids (in flight at a generator) in admission order
    admitted: dict[str, None] = {}
    #: uncommitted groups that recorded segments (partial rollouts)
    inflight: dict[str, InflightSegments] = {}
    #: uncommitted groups that recorded environment calls (episodes)
    episodes: dict[str, InflightEpisodes] = {}
    steps: dict[int, StepRecord] = {}
    #: trainer_version -> the (not lost) finished step that produced it
    version_steps: dict[int, int] = {}
    checkpoints: list[CheckpointRecord] = []
    rejected_checkpoints: list[CheckpointRejection] = []
    workers_lost: list[WorkerLossRecord] = []
    rewinds: list[RewindRecord] = []
    released_groups: int = 0
    finished: bool = False
    finished_reason: str | None = None
    #: groups failing in a row, per worker and in all (the failure budget's input)
    failures: FailureRecord = msgspec.field(default_factory=FailureRecord)
    #: position of the last applied event (0 = nothing applied)
    position: int = 0

    # -- read-only helpers -------------------------------------------------------

    @property
    def step_status(self) -> StepStatus:
        return StepStatus.IDLE if self.open_step is None else StepStatus.OPEN

    def committed_groups_in_order(self) -> list[GroupRecord]:
        """COMMITTED, unclaimed groups in commit order (what selection policies pick from)."""
        return [self.groups[g] for g in self.buffer]

    def iter_buffer(self) -> Iterator[GroupRecord]:
        return map(self.groups.__getitem__, self.buffer)

    def in_flight(self) -> list[GroupRecord]:
        """ADMITTED groups (dispatched, not yet committed or failed), in admission order."""
        return [self.groups[g] for g in self.admitted]

    def failed_groups(self) -> list[GroupRecord]:
        """FAILED groups awaiting re-admission (or dropped); O(groups)."""
        return [g for g in self.groups.values() if g.status is GroupStatus.FAILED]

    def latest_checkpoint(self) -> CheckpointRecord | None:
        """Newest checkpoint that was neither rejected nor discarded by a rewind."""
        for ckpt in reversed(self.checkpoints):
            if not ckpt.rejected and not ckpt.lost:
                return ckpt
        return None

    def covered_trainer_version(self) -> int:
        """Steps whose trainer_version is <= this are covered by a checkpoint (-1: none)."""
        ckpt = self.latest_checkpoint()
        return -1 if ckpt is None else ckpt.trainer_version

    def finished_steps(self) -> list[StepRecord]:
        """Finished, not lost steps in step order."""
        return [
            s for s in self.steps.values() if s.status is StepStatus.FINISHED and not s.lost
        ]

    def step_for_version(self, trainer_version: int) -> StepRecord | None:
        """The (not lost) finished step that produced ``trainer_version``."""
        step = self.version_steps.get(trainer_version)
        return None if step is None else self.steps[step]

    def steps_after(self, version: int) -> list[StepRecord]:
        """The finished, not lost steps that produced versions version+1 .. trainer_version,
        in order: what re-training from a checkpoint of ``version`` runs again, and what a
        rewind to it discards."""
        steps, by_version = self.steps, self.version_steps
        return [steps[by_version[v]] for v in range(version + 1, self.trainer_version + 1)]

    def lag_of(
        self, group: GroupRecord, at_version: int | None = None, *, newest: bool = False
    ) -> int | None:
        """Lag the group would have if trained at ``at_version`` (default: now), i.e. that
        version - its start version (its oldest token's; with ``newest``, its newest
        token's: ``staleness.window_basis``); None for a group not committed yet."""
        start = group.weight_version_end if newest else group.weight_version_start
        if start is None:
            return None
        version = self.trainer_version if at_version is None else at_version
        return version - start

    def copy(self) -> RunState:
        """A deep copy (the reducer updates states in place)."""
        return decode_state(encode_state(self))


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RunState)


def initial_state() -> RunState:
    """The state before any event: nothing started, epoch 0, position 0."""
    return RunState()


def encode_state(state: RunState) -> bytes:
    """Snapshot bytes (msgpack) of ``state``; ``state.position`` says where it stands."""
    return _encoder.encode(state)


def decode_state(data: bytes) -> RunState:
    try:
        state = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise SnapshotDecodeError(str(err)) from None
    if state.state_format != STATE_FORMAT_VERSION:
        raise SnapshotDecodeError(
            f"state format {state.state_format}, this code reads {STATE_FORMAT_VERSION}"
        )
    return state
