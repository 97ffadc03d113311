"""Async handles over workers: in-process (a worker thread) or a Ray actor.

The controller loop awaits these; neither kind blocks the event loop. Weight
publishing goes trainer -> generators: with Ray the trainer's exported weights are
one object in the object store and every generator gets it by reference (one put,
many gets); in-process they are handed over directly.

A worker that dies mid-call surfaces as :class:`workers.api.WorkerLostError`
(Ray's actor-died errors are translated here), so the controller can record
``WorkerLost``, have the worker replaced behind the same client object (the clients
hold a handle that ``controller.wiring`` swaps) and reconcile the new one.

Every call carries the controller's epoch (``token``, shared by all handles of one
controller): the handle calls the worker's ``fenced(epoch, method, ...)`` entry point
and the worker refuses a stale epoch (``workers.fencing``).

Calls are named by the method of a declared protocol (``workers.calls``:
``TrainerCalls.begin_train_step``), never by a string: an undeclared call is refused
before it is sent.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from workers.api import (
    CheckpointOutcome,
    GenerationOutcome,
    GenerationRequest,
    MicrobatchOutcome,
    MicrobatchRef,
    StepOutcome,
    WorkerLostError,
)
from workers.calls import GeneratorCalls, TrainerCalls, WorkerCalls, call_name
from workers.dataplane import DataPlane
from workers.fencing import EpochToken
from workers.weight_transport import BucketTransport, WeightTransport


#: a declared worker call: a method of a ``workers.calls`` protocol
Call = Callable[..., Any]


def _pin_torch_threads(n: int) -> None:
    import torch  # only where a worker runs in this process

    # ATen sets a thread's OpenMP count once, lazily, to the process-wide count of that
    # moment -- which another thread may have changed by then (TransferQueue's client
    # sets it around every put, from its own loop thread): ask first, so that lazy set
    # happens now, then pin
    torch.get_num_threads()
    torch.set_num_threads(n)


def _stamped(token: EpochToken | None, call: Call, args: tuple[Any, ...]) -> tuple[str, tuple]:
    """(method name, args) as sent: through ``fenced`` with the epoch once the token has one."""
    method = call_name(call)
    if token is None or token.value <= 0:
        return method, args
    return "fenced", (token.value, method, *args)


class LocalHandle:
    """Calls a plain object's methods on its own worker threads.

    ``torch_threads`` pins torch's intra-op thread count on each of those threads, as a
    Ray actor's process pins it for the thread its calls run on. OpenMP keeps the count
    per calling thread: the worker's own ``torch.set_num_threads`` in its constructor
    (on the thread that built it) does not reach a pool thread, which took whatever the
    process-wide count was at its first parallel op (2, once TransferQueue's client had
    set it), and a float32 step computed with 2 threads instead of 1 rounds differently:
    a ``--local-workers`` run wrote weight digests ``replay --retrain`` (one thread)
    could never reproduce.
    """

    def __init__(
        self, obj: Any, *, threads: int = 1, name: str = "worker", role: str = "worker",
        torch_threads: int | None = None,
    ) -> None:
        self.obj = obj
        self.name = name
        self.role = role
        pin = None if torch_threads is None else functools.partial(_pin_torch_threads, torch_threads)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=pin)
        self._lost: str | None = None
        #: the controller's epoch, stamped on every call (set by ``controller.wiring``)
        self.token: EpochToken | None = None

    def submit(self, call: Call, *args: Any) -> asyncio.Future:
        """Issue the call now (a worker thread picks it up); await the result later."""
        loop = asyncio.get_running_loop()
        if self._lost is not None:
            err = WorkerLostError(self.name, self.role, self._lost)
            err.handle = self  # which incarnation died (a restart swaps the handle)
            failed = loop.create_future()
            failed.set_exception(err)
            return failed
        method, args = _stamped(self.token, call, args)
        return loop.run_in_executor(self._pool, functools.partial(getattr(self.obj, method), *args))

    async def call(self, call: Call, *args: Any) -> Any:
        return await self.submit(call, *args)

    async def relay(self, call: Call, *args: Any) -> Any:
        """The call's result, to pass on to another handle's call: in-process, the value."""
        return await self.submit(call, *args)

    def kill(self, reason: str = "killed") -> None:
        """Make the worker unreachable, as a dead process would be (tests, chaos)."""
        self._lost = reason

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if isinstance(self.obj, WorkerCalls) and self._lost is None:
            self.obj.close()  # e.g. a vLLM engine: free it now, not at interpreter exit


class RayHandle:
    """Calls a Ray actor's methods; a dead actor raises ``WorkerLostError``."""

    def __init__(self, actor: Any, *, name: str = "worker", role: str = "worker") -> None:
        self.actor = actor
        self.name = name
        self.role = role
        self.token: EpochToken | None = None

    def submit(self, call: Call, *args: Any) -> asyncio.Future:
        """Issue the call now (the task is submitted to the actor); await the result later."""
        try:
            ref = self.ref(call, *args)
        except Exception as err:  # submitting to a dead actor may raise right here
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(self._translate(err))
            return failed
        return asyncio.ensure_future(self._result(ref))

    async def call(self, call: Call, *args: Any) -> Any:
        return await self.submit(call, *args)

    async def relay(self, call: Call, *args: Any) -> Any:
        """The call's result, to pass on to another handle's call: an object reference.
        The value stays in Ray's object store (stored once), and each receiving actor
        fetches it; the caller never holds it."""
        try:
            return self.ref(call, *args)
        except Exception as err:
            raise self._translate(err) from err

    async def _result(self, ref: Any) -> Any:
        try:
            return await ref
        except Exception as err:
            raise self._translate(err) from err

    def _translate(self, err: Exception) -> Exception:
        from ray.exceptions import RayActorError, RayTaskError

        if isinstance(err, RayTaskError) and isinstance(err.cause, Exception):
            # The worker's own exception, as it raised it: Ray's wrapper prints a
            # coloured remote traceback where the cause's type and message belong.
            err = err.cause
        if not isinstance(err, RayActorError):  # ActorDiedError, ActorUnavailableError, ...
            return err
        lost = WorkerLostError(self.name, self.role, f"{type(err).__name__}: {err}"[:300])
        lost.handle = self  # which incarnation died (a restart swaps the handle)
        return lost

    def ref(self, call: Call, *args: Any) -> Any:
        """Submit the call; its Ray object reference."""
        method, args = _stamped(self.token, call, args)
        return getattr(self.actor, method).remote(*args)

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the worker to free what it started (engine processes), then kill it."""
        import ray

        if self.role == "generator":
            try:
                ray.get(self.actor.close.remote(), timeout=timeout_s)  # unfenced: a kill follows
            except Exception:
                pass  # dead or hung: the kill below is all that is left
        ray.kill(self.actor, no_restart=True)


Handle = LocalHandle | RayHandle


class TrainerClientImpl:
    """``workers.api.TrainerClient`` over a ``TrainerWorker`` handle."""

    def __init__(self, handle: Handle) -> None:
        self.handle = handle

    async def begin_train_step(self, step: int) -> None:
        await self.handle.call(TrainerCalls.begin_train_step, step)

    async def train_microbatch(self, ref: MicrobatchRef) -> MicrobatchOutcome:
        return await self.handle.call(TrainerCalls.train_microbatch, ref)

    async def finish_train_step(self) -> StepOutcome:
        return await self.handle.call(TrainerCalls.finish_train_step)

    async def abort_train_step(self) -> None:
        await self.handle.call(TrainerCalls.abort_train_step)

    async def version_and_digest(self) -> tuple[int, str]:
        return tuple(await self.handle.call(TrainerCalls.version_and_digest))  # type: ignore[return-value]

    async def save_checkpoint(self, directory: str) -> CheckpointOutcome:
        return await self.handle.call(TrainerCalls.save_checkpoint, directory)

    async def begin_checkpoint(self, directory: str) -> None:
        await self.handle.call(TrainerCalls.begin_checkpoint, directory)

    async def checkpoint_outcome(self, directory: str) -> CheckpointOutcome | None:
        return await self.handle.call(TrainerCalls.checkpoint_outcome, directory)

    async def load_checkpoint(self, directory: str, expected_sha256: str | None = None) -> tuple[int, str]:
        got = await self.handle.call(TrainerCalls.load_checkpoint, directory, expected_sha256)
        return tuple(got)  # type: ignore[return-value]

    async def reset(self) -> None:
        await self.handle.call(TrainerCalls.reset)


class GeneratorClientImpl:
    """``workers.api.GeneratorClient`` over a ``GeneratorWorker`` handle."""

    def __init__(self, name: str, handle: Handle) -> None:
        self.name = name
        self.handle = handle

    def generate(self, requests: list[GenerationRequest]) -> Awaitable[list[GenerationOutcome]]:
        """Issue the call now; the outcomes are awaited later (see ``GeneratorClient``)."""
        return self.handle.submit(GeneratorCalls.generate_groups, requests)

    async def weight_version(self) -> int:
        return await self.handle.call(GeneratorCalls.weight_version)


class Publisher:
    """``workers.api.WeightPublisher``: trainer weights -> every generator.

    The weights travel through ``transport`` (``workers.weight_transport``): bucket by
    bucket, the last bucket acknowledged with the version by each generator.
    """

    def __init__(
        self,
        trainer: TrainerClientImpl,
        generators: list[GeneratorClientImpl],
        transport: WeightTransport | None = None,
    ) -> None:
        self.trainer = trainer  # the client, not its handle: a restart swaps the handle
        self.generators = generators
        self.transport = transport if transport is not None else BucketTransport()
        # one send at a time: the trainer holds one prepared export, so a replaced
        # generator's publish interleaved with a step's would take the other's buckets
        self._sending = asyncio.Lock()

    async def publish(self, version: int, only: list[str] | None = None) -> list[str]:
        """Send the trainer's weights to every generator (or those named in ``only``)."""
        targets = [g.handle for g in self.generators if only is None or g.name in only]
        async with self._sending:
            acks = await self.transport.send(version, self.trainer.handle, targets)
        return [ack.generator for ack in acks]


class PayloadStoreImpl:
    """``workers.api.PayloadStore`` over the controller's data plane client.

    With ``trainer``, deletes go through the trainer worker (``clear_payloads``), so they
    carry the controller's epoch and pass the worker's fence; reads stay local.
    """

    def __init__(
        self, dataplane: DataPlane, partition: str, trainer: TrainerClientImpl | None = None
    ) -> None:
        self.dataplane = dataplane
        self.partition = partition
        self.trainer = trainer  # the client, not its handle: a restart swaps the handle

    async def delete(self, keys: list[str]) -> None:
        if self.trainer is not None:
            await self.trainer.handle.call(TrainerCalls.clear_payloads, list(keys))
            return
        await asyncio.to_thread(self.dataplane.clear, self.partition, keys)

    async def keys(self) -> list[str]:
        return await asyncio.to_thread(self.dataplane.list, self.partition)
