"""The contract between the controller and its workers: messages, errors, protocols.

The controller never sees a tensor: it hands generators a prompt reference and gets
back payload keys, and hands the trainer payload keys plus advantages. This module is
the whole vocabulary the two sides share; it lives with the workers so that the
dependency runs one way (``controller`` imports ``workers.api``; ``workers`` imports
nothing from ``controller``). Implementations -- in-process for tests and
single-process runs, Ray actors for real runs -- are in ``workers.handles``; the
controller's ``wiring`` picks one.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable
from typing import Literal, Protocol, runtime_checkable

import msgspec

# SegmentFlush is defined with the event that carries it; generators import it from here.
from events.schema import EnvCall, EnvResult, Segment, SegmentFlush, SegmentKind  # noqa: F401
from workers.fencing import EpochToken


def worker_label(role: str, name: str) -> str:
    """How an error names a worker: ``trainer``, ``generator-1`` (never "trainer trainer")."""
    return name if name.startswith(role) else f"{role} {name}"


class WorkerLostError(RuntimeError):
    """A worker process died (or its actor is gone) during a call; raised by the handles."""

    def __init__(self, worker: str, role: str, reason: str) -> None:
        self.worker = worker
        self.role = role
        self.reason = reason
        #: the handle whose call failed (set by the handles; a restart swaps handles)
        self.handle: object | None = None
        super().__init__(f"{worker_label(role, worker)} lost: {reason}")


#: terminal colour codes (Ray colours the tracebacks it forwards)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def error_line(err: BaseException, limit: int = 400) -> str:
    """A worker's error in one line: its type and message, colour codes and line breaks
    gone (the handles already unwrapped Ray's task error to the worker's own exception)."""
    text = _ANSI.sub("", f"{type(err).__name__}: {err}".strip())
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class EpisodeFlush(msgspec.Struct, frozen=True, kw_only=True):
    """An episode group's pause point (``workers.envs.durable``): what became durable
    (rows in the data plane) since its last one. The controller records it as one
    ``EpisodeTurnsRecorded`` standing for, in this order: ``completed``
    (``EnvStepsCompleted``), one ``SegmentsRecorded`` per entry of ``segments`` (the
    observations that follow those results, or model turns), ``requested``
    (``EnvStepsRequested``: calls about to be made, which wait for this append)."""

    #: the task that made the environment, and its declaration
    env: str
    dedupes_by_key: bool
    completed: list[EnvResult] = []
    #: the calls are an agent's (``events.schema.EnvStepsRequested.agent``)
    agent: bool = False
    segments: list[SegmentFlush] = []
    requested: list[EnvCall] = []

    @property
    def events(self) -> int:
        """Events it stands for in the log (what ``GenerationRequest.flushes`` counts; the
        controller appends them as one ``EpisodeTurnsRecorded`` when there are several)."""
        return bool(self.completed) + len(self.segments) + bool(self.requested)


class RecordedCall(msgspec.Struct, frozen=True, kw_only=True):
    """One env call the log recorded, with its result once it came."""

    call: EnvCall
    result: EnvResult | None = None


class EpisodeResume(msgspec.Struct, frozen=True, kw_only=True):
    """What the log holds of an episode group's env calls (a resumed attempt's first
    call carries it, beside the segment flushes in ``resume``)."""

    #: per sample, times its episode was started over (part of its calls' keys)
    restarts: list[int]
    #: per sample, its recorded calls in turn order
    calls: list[RecordedCall] = []


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True):
    group_id: str
    attempt: int
    prompt_index: int
    n_samples: int
    seed: int
    #: partial rollouts: the group's recorded flushes (every attempt, in log order) for
    #: a worker that must rebuild it from the data plane -- sent with an attempt's
    #: first call; empty on the calls that continue a group the worker holds
    resume: list[SegmentFlush] = []
    #: partial rollouts: flushes of *this* attempt already recorded; a worker that does
    #: not hold exactly these refuses to go on (it would sample recorded tokens again).
    #: For episodes: the attempt's ``SegmentsRecorded`` plus env events
    flushes: int = 0
    #: episodes: what the log holds of the group's env calls (first call of an attempt)
    episode: EpisodeResume | None = None


#: done: the final rows are stored (commit it); flushed: new segments are stored and the
#: group is paused until they are recorded; pending: not reached in this call; failed:
#: the group's own error (``workers.errors.GroupError``) ended it, named in ``reason``
GenerationStatus = Literal["done", "flushed", "pending", "failed"]

#: the statuses that end a group's part in a call sequence (commit it, or fail it)
FINISHED: frozenset[GenerationStatus] = frozenset({"done", "failed"})


class GenerationOutcome(msgspec.Struct, frozen=True, kw_only=True):
    payload_keys: list[str]
    rewards: list[float]
    lengths: list[int]
    weight_version_start: int
    weight_version_end: int
    status: GenerationStatus = "done"
    flush: SegmentFlush | None = None
    #: episodes: a pause point's records (``flush`` stays None)
    episode: EpisodeFlush | None = None
    #: per sample, token versions run-length encoded ``[v0, n0, v1, n1, ...]``
    version_runs: list[list[int]] = []
    #: status "failed": the group's error in one line (``error_line``)
    reason: str = ""

    @classmethod
    def failed(cls, reason: str) -> GenerationOutcome:
        """A group whose own error ended it; the call's other groups go on."""
        return cls(payload_keys=[], rewards=[], lengths=[], weight_version_start=0,
                   weight_version_end=0, status="failed", reason=reason)


class MicrobatchRef(msgspec.Struct, frozen=True, kw_only=True):
    """A microbatch by reference: the trainer reads these rows from the data plane."""

    payload_keys: list[str]
    #: one advantage per payload key (GRPO, normalised within each group)
    advantages: list[float]
    #: the weight version each key's generation started at (its group's
    #: weight_version_start; the mismatch metrics use it); empty = unknown
    versions: list[int] = msgspec.field(default_factory=list)
    #: per key, per-turn advantages ``[start_1, a_1, start_2, a_2, ...]``: completion
    #: tokens from ``start_j`` to ``start_{j+1}`` get ``a_j`` (``[]``: the key's
    #: ``advantages`` entry on every token); empty = per-sample advantages only
    turn_advantages: list[list[float]] = msgspec.field(default_factory=list)


class MicrobatchOutcome(msgspec.Struct, frozen=True, kw_only=True):
    num_sequences: int
    num_tokens: int


class StepOutcome(msgspec.Struct, frozen=True, kw_only=True):
    trainer_version: int
    metrics: dict[str, float]
    grad_norm: float
    weights_digest: str


#: the file a checkpoint's directory is vouched for by, and the first one a load reads
#: (``workers.trainer.checkpoint``): where it is gone, so is the checkpoint
CHECKPOINT_MANIFEST = "manifest.json"


class CheckpointOutcome(msgspec.Struct, frozen=True, kw_only=True):
    trainer_version: int
    uri: str
    sha256: str


class TrainerClient(Protocol):
    async def begin_train_step(self, step: int) -> None: ...
    async def train_microbatch(self, ref: MicrobatchRef) -> MicrobatchOutcome: ...
    async def finish_train_step(self) -> StepOutcome: ...
    async def abort_train_step(self) -> None: ...
    async def version_and_digest(self) -> tuple[int, str]: ...
    async def save_checkpoint(self, directory: str) -> CheckpointOutcome: ...
    async def begin_checkpoint(self, directory: str) -> None:
        """Snapshot the weights and optimizer now; they are written in the background."""
        ...

    async def checkpoint_outcome(self, directory: str) -> CheckpointOutcome | None:
        """The begun checkpoint once durable (fsynced, renamed), else None."""
        ...

    async def load_checkpoint(
        self, directory: str, expected_sha256: str | None = None
    ) -> tuple[int, str]:
        """Load a checkpoint; with ``expected_sha256`` (the log's manifest hash) refuse
        any other one. Returns (trainer_version, weights digest)."""
        ...

    async def reset(self) -> None:
        """Back to the initial weights (seeded init, version 0), as if just started."""
        ...


class WeightPublisher(Protocol):
    """Moves the trainer's current weights to every generator (one put, many gets)."""

    async def publish(self, version: int, only: list[str] | None = None) -> list[str]:
        """Send ``version`` to every generator (or those named in ``only``); returns
        the names of the generators that acknowledged it."""
        ...


class GeneratorClient(Protocol):
    name: str

    def generate(self, requests: list[GenerationRequest]) -> Awaitable[list[GenerationOutcome]]:
        """Issue one call generating these groups *now*; await the outcomes (in request
        order) later. Any error fails every group of the call.

        The call reaches the worker when ``generate`` returns, not when the result is
        awaited: the loop issues it right after the admission's append, so that append
        (which fails for a fenced controller) is the fencing check, with no event-loop
        turn in between.
        """
        ...

    async def weight_version(self) -> int: ...


class WorkerRestarter(Protocol):
    """Replaces a dead worker by a fresh one behind the same client object."""

    async def restart_trainer(self) -> None: ...
    async def restart_generator(self, name: str) -> None: ...


class PayloadStore(Protocol):
    """The controller's narrow view of the data plane: list and delete rows by key."""

    async def delete(self, keys: list[str]) -> None: ...
    async def keys(self) -> list[str]: ...


@runtime_checkable
class Replaceable(Protocol):
    """A client whose worker can be replaced behind it: a restart swaps ``handle``, and
    ``WorkerLostError.handle`` names the incarnation that failed."""

    handle: object


class StartedWorkers(Protocol):
    """The started workers as recovery reconciles them (``controller.wiring.Workers``)."""

    trainer: TrainerClient
    publisher: WeightPublisher
    payloads: PayloadStore
    #: the controller's data plane client
    dataplane: object
    #: the controller's epoch, stamped by every handle on every call (``workers.fencing``)
    token: EpochToken
