"""Versioned weight sync: trainer -> generators.

The trainer publishes ``(version, weights)``; every generator loads it and
acknowledges with a :class:`WeightsAck`. The weights travel in bounded buckets
(``workers.weight_transport``); :class:`BucketReceiver` spools one version's buckets to
a file as they arrive (``workers.weight_spool``) and hands them over as a
:class:`WeightStream`, which is loaded tensor by tensor: the generator's extra memory
for a refit is about one bucket plus one tensor, not one model.

:class:`VersionedWeights` is the generator's side (plain, no Ray):

* versions never go backwards -- an older version is refused with
  :class:`StaleWeightsError`; re-sending the held version is an idempotent ack;
* while a group is being generated an update is not applied mid-token-step: it waits
  for the next step boundary (``at_step_boundary``), so the group's start and end
  versions differ, and that is recorded, not hidden. An update that arrives from
  another thread blocks until it has been loaded, then acks; one that arrives from
  the generating thread itself (a hook called at a step boundary) is applied at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ContextManager, Protocol, runtime_checkable

import torch
from torch import nn

from workers.weight_buckets import unpack_buckets
from workers.weight_spool import BucketSpool, SpooledBuckets


class StaleWeightsError(ValueError):
    """A weight version older than the one the generator holds."""


@dataclass(frozen=True)
class WeightsAck:
    """A generator's acknowledgement that it holds ``version``."""

    generator: str
    version: int


StateDict = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class WeightStream:
    """One version's weights as the buckets that carried them (``workers.weight_buckets``).

    ``buckets`` are in memory or spooled to a file (read back one at a time). A load
    target with ``load_weight_stream(stream)`` takes the stream itself (the vLLM
    generator hands the spool to its engine); a plain ``nn.Module`` is loaded tensor by
    tensor (:func:`load_tensors`).
    """

    buckets: Sequence[bytes] | SpooledBuckets

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return unpack_buckets(self.buckets)

    @property
    def nbytes(self) -> int:
        if isinstance(self.buckets, SpooledBuckets):
            return self.buckets.nbytes
        return sum(len(b) for b in self.buckets)


Weights = StateDict | WeightStream


@runtime_checkable
class StreamLoadable(Protocol):
    """A load target that takes a :class:`WeightStream` whole (the vLLM generator hands
    the spool to its engine); any other module is loaded tensor by tensor."""

    def load_weight_stream(self, stream: WeightStream) -> None: ...


class VersionedWeights:
    """A model's weights tagged with a version, updated only between token steps."""

    def __init__(self, model: nn.Module, name: str, version: int = 0) -> None:
        self.model = model
        self.name = name
        self._version = version
        self._lock = threading.Lock()
        #: notified when an update starts waiting for a step boundary
        self._queued = threading.Condition(self._lock)
        self._generating_thread: int | None = None
        self._pending: tuple[int, Weights, threading.Event] | None = None
        #: what an update lets go of while it waits for a step boundary (the worker's
        #: fence, ``workers.fencing.EpochFence.released``: the generating thread may
        #: need it to write a flush before it reaches that boundary)
        self.waiting: Callable[[], ContextManager[None]] = contextlib.nullcontext

    @property
    def version(self) -> int:
        return self._version

    def update(self, version: int, state_dict: Weights) -> WeightsAck:
        """Load ``state_dict`` as ``version`` (now, or at the next step boundary)."""
        with self._lock:
            self._check(version)
            if version == self._version:
                return WeightsAck(self.name, version)
            busy = self._generating_thread is not None
            if not busy or self._generating_thread == threading.get_ident():
                self._load(version, state_dict)
                return WeightsAck(self.name, version)
            if self._pending is not None:  # superseded: its waiter wakes with the newer one
                self._pending[2].set()
            loaded = threading.Event()
            self._pending = (version, state_dict, loaded)
            self._queued.notify_all()
        with self.waiting():
            loaded.wait()
        return WeightsAck(self.name, self._version)

    def begin_group(self) -> int:
        """Mark generation in progress on this thread; returns the version at start."""
        with self._lock:
            if self._generating_thread is not None:
                raise RuntimeError(f"generator {self.name} is already generating a group")
            self._generating_thread = threading.get_ident()
            self._apply_pending()
            return self._version

    def at_step_boundary(self) -> None:
        """Apply a pending update (called between token steps)."""
        with self._lock:
            self._apply_pending()

    def end_group(self) -> int:
        """Mark generation finished; returns the version the group ended with.

        A pending update is applied after the end version is read: the group's last
        token was sampled with the old weights.
        """
        with self._lock:
            end = self._version
            self._generating_thread = None
            self._apply_pending()
            return end

    def wait_for_pending(self, timeout_s: float) -> int | None:
        """Block until an update from another thread waits for a step boundary; its
        version, or None if none came within ``timeout_s`` (a generating thread can
        hold a step until the update is there, so it lands mid-group for sure)."""
        with self._queued:
            self._queued.wait_for(lambda: self._pending is not None, timeout=timeout_s)
            return None if self._pending is None else self._pending[0]

    def check(self, version: int) -> None:
        """Raise :class:`StaleWeightsError` if ``version`` is older than held or pending."""
        with self._lock:
            self._check(version)

    def _check(self, version: int) -> None:
        held = self._version if self._pending is None else max(self._version, self._pending[0])
        if version < held:
            raise StaleWeightsError(
                f"generator {self.name} holds (or is loading) weight version {held}; "
                f"refusing older version {version}"
            )

    def _apply_pending(self) -> None:
        if self._pending is None:
            return
        version, state_dict, loaded = self._pending
        self._pending = None
        if version > self._version:
            self._load(version, state_dict)
        loaded.set()

    def _load(self, version: int, weights: Weights) -> None:
        with torch.no_grad():
            if isinstance(weights, WeightStream) and isinstance(self.model, StreamLoadable):
                self.model.load_weight_stream(weights)
            elif isinstance(weights, WeightStream):
                load_tensors(self.model, weights.tensors())
            else:
                self.model.load_state_dict(dict(weights), strict=True)
        self._version = version


@dataclass
class BucketReceiver:
    """Spools one version's buckets, then hands them to :class:`VersionedWeights`.

    ``receive(version, index, count, bucket)`` is called once per bucket in order; the
    call carrying the last bucket blocks until the version is loaded (at the next
    boundary if a group is generating) and returns the ack; earlier calls return None.
    A bucket of a newer version drops a half-received older one (its publisher died).
    Each bucket is written to the spool file at once and not kept (``spool_dir``:
    ``workers.weight_spool``; None is the temporary directory).
    """

    weights: VersionedWeights
    spool_dir: str | None = None
    _version: int | None = None
    _spool: BucketSpool | None = None
    _received: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def receive(self, version: int, index: int, count: int, bucket: bytes) -> WeightsAck | None:
        with self._lock:
            if index == 0:
                self.weights.check(version)
                self._drop()
                self._version, self._spool = version, BucketSpool(self.spool_dir)
            if version != self._version or index != self._received or self._spool is None:
                raise ValueError(
                    f"generator {self.weights.name}: weight bucket {index}/{count} of version "
                    f"{version} out of order (holding {self._received} of {self._version})"
                )
            self._spool.append(bucket)
            self._received += 1
            if index + 1 < count:
                return None
            spool = self._spool
            self._version, self._spool, self._received = None, None, 0
        with spool:  # update() returns once the version is loaded or superseded
            return self.weights.update(version, WeightStream(spool.sealed()))

    def _drop(self) -> None:
        if self._spool is not None:
            self._spool.close()
        self._version, self._spool, self._received = None, None, 0


def load_tensors(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """``load_state_dict(strict=True)`` from a stream, one tensor in memory at a time."""
    target = model.state_dict()
    seen: set[str] = set()
    for name, tensor in tensors:
        dest = target.get(name)
        if dest is None or name in seen:
            why = "repeated" if dest is not None else "unexpected"
            raise ValueError(f"weight stream: {why} tensor {name!r}")
        if dest.shape != tensor.shape:
            raise ValueError(
                f"weight stream: {name!r} has shape {tuple(tensor.shape)}, "
                f"model has {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        seen.add(name)
    if missing := sorted(target.keys() - seen):
        more = " ..." if len(missing) > 5 else ""
        raise ValueError(f"weight stream: missing tensors {missing[:5]}{more}")


def cpu_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``model``'s weights, ready to publish."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
