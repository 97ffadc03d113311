"""The calls a handle may make on a worker, declared as capability tiers.

A handle (``workers.handles``) reaches a worker object by method name -- a Ray actor
is called that way -- but nothing here names a method by a string literal: callers
pass the method of a protocol below (``TrainerCalls.begin_train_step``), so a typo or
a renamed worker method fails at the first call with the protocol's name, and the
workers are checked against these protocols (``tests/unit/test_trainer_architecture``)::

    WorkerCalls        pid, close                       every worker
    WeightSource       prepare_weight_buckets,          the refit's sending side
                       weight_bucket
    WeightSink         receive_weight_bucket            the refit's receiving side
    TrainerCalls       WorkerCalls + WeightSource + the split API, checkpoints
                       (in line, or begun and polled),
                       version_and_digest, reset, export_weights, clear_payloads
    GeneratorCalls     WorkerCalls + WeightSink + generate_groups, weight_version,
                       update_weights
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from workers.api import (
        CheckpointOutcome,
        GenerationOutcome,
        GenerationRequest,
        MicrobatchOutcome,
        MicrobatchRef,
        StepOutcome,
    )
    from workers.weight_sync import WeightsAck

__all__ = [
    "GeneratorCalls",
    "TrainerCalls",
    "WeightSink",
    "WeightSource",
    "WorkerCalls",
    "call_name",
    "declared_calls",
]


@runtime_checkable
class WorkerCalls(Protocol):
    def pid(self) -> int:
        """This worker's process id (chaos tests kill -9 it)."""
        ...

    def close(self) -> None:
        """Free what the worker started (rank actors, engine processes)."""
        ...


class WeightSource(Protocol):
    def prepare_weight_buckets(self, version: int, bucket_bytes: int) -> int:
        """Export the weights for a refit; returns how many buckets they make."""
        ...

    def weight_bucket(self, version: int, index: int) -> bytes: ...


class WeightSink(Protocol):
    def receive_weight_bucket(
        self, version: int, index: int, count: int, bucket: bytes
    ) -> WeightsAck | None:
        """One refit bucket, in order; the last one returns the ack."""
        ...


class TrainerCalls(WorkerCalls, WeightSource, Protocol):
    def begin_train_step(self, step: int) -> None: ...

    def train_microbatch(self, ref: MicrobatchRef) -> MicrobatchOutcome: ...

    def finish_train_step(self) -> StepOutcome: ...

    def abort_train_step(self) -> None: ...

    def version_and_digest(self) -> tuple[int, str]: ...

    def save_checkpoint(self, directory: str) -> CheckpointOutcome: ...

    def begin_checkpoint(self, directory: str) -> None:
        """Snapshot now, write in the background (``trainer.async_checkpoint``)."""
        ...

    def checkpoint_outcome(self, directory: str) -> CheckpointOutcome | None: ...

    def load_checkpoint(
        self, directory: str, expected_sha256: str | None = None
    ) -> tuple[int, str]: ...

    def reset(self) -> None: ...

    def export_weights(self) -> dict[str, torch.Tensor]: ...

    def clear_payloads(self, keys: list[str]) -> None: ...


class GeneratorCalls(WorkerCalls, WeightSink, Protocol):
    def generate_groups(self, reqs: list[GenerationRequest]) -> list[GenerationOutcome]: ...

    def weight_version(self) -> int: ...

    def update_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> WeightsAck: ...


_TIERS = (WorkerCalls, WeightSource, WeightSink, TrainerCalls, GeneratorCalls)


def declared_calls(tier: type) -> dict[str, Callable[..., Any]]:
    """The calls a tier declares, its bases' included: name -> protocol function."""
    out: dict[str, Callable[..., Any]] = {}
    for cls in reversed(tier.__mro__):
        if cls in _TIERS:
            out.update({k: v for k, v in vars(cls).items() if not k.startswith("_")})
    return out


_DECLARED = {fn: name for tier in _TIERS for name, fn in declared_calls(tier).items()}


def call_name(call: Callable[..., Any]) -> str:
    """The wire name of a declared call; anything else is refused."""
    name = _DECLARED.get(call)
    if name is None:
        raise TypeError(
            f"{call!r} is not a worker call declared in workers.calls (pass e.g. "
            "TrainerCalls.begin_train_step, not a name)"
        )
    return name
