"""What the controller loop needs from its workers, as protocols.

The loop never sees a tensor: it hands generators a prompt reference and gets back
payload keys, and hands the trainer payload keys plus advantages. Implementations
(in-process for tests and single-process runs, Ray actors for real runs) live in
``workers.clients``; the wiring in ``controller.run`` picks one.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

import msgspec


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True):
    group_id: str
    attempt: int
    prompt_index: int
    n_samples: int
    seed: int


class GenerationOutcome(msgspec.Struct, frozen=True, kw_only=True):
    payload_keys: list[str]
    rewards: list[float]
    lengths: list[int]
    weight_version_start: int
    weight_version_end: int


class MicrobatchRef(msgspec.Struct, frozen=True, kw_only=True):
    """A microbatch by reference: the trainer reads these rows from the data plane."""

    payload_keys: list[str]
    #: one advantage per payload key (GRPO, normalised within each group)
    advantages: list[float]


class MicrobatchOutcome(msgspec.Struct, frozen=True, kw_only=True):
    num_sequences: int
    num_tokens: int


class StepOutcome(msgspec.Struct, frozen=True, kw_only=True):
    trainer_version: int
    metrics: dict[str, float]
    grad_norm: float
    weights_digest: str


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
    async def load_checkpoint(self, directory: str) -> tuple[int, str]: ...


class WeightPublisher(Protocol):
    """Moves the trainer's current weights to every generator (one put, many gets)."""

    async def publish(self, version: int) -> list[str]:
        """Returns the names of the generators that acknowledged ``version``."""
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


class PayloadStore(Protocol):
    """The controller's narrow view of the data plane: list and delete rows by key."""

    async def delete(self, keys: list[str]) -> None: ...
    async def keys(self) -> list[str]: ...
