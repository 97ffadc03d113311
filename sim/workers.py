"""Simulated workers: the controller's client protocols, answered after simulated time.

They implement ``GeneratorClient``, ``TrainerClient``, ``WeightPublisher`` and
``PayloadStore`` (``workers.api``) with no model and no data: a generator call
resolves after its groups' generation time with well-formed outcomes (payload keys,
rewards, lengths, the weight versions it held at its start and end), the trainer's calls
take their simulated durations and count versions like the real trainer, the publisher
moves the fleet's weight version after the refit time. Everything they do besides
waiting runs in ``VirtualTimeLoop.uncharged`` so that, when the loop charges real time,
only the controller's own time is charged.

The trainer records its busy intervals (``busy_s``) so a simulation can say how long
the trainer waited for the controller and for data.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from workers.api import (
    CheckpointOutcome,
    GenerationOutcome,
    GenerationRequest,
    MicrobatchOutcome,
    MicrobatchRef,
    StepOutcome,
)
from sim.clock import VirtualTimeLoop
from sim.decode import LoadedDecode
from sim.timings import Timings


@dataclass
class Fleet:
    """What every simulated worker shares: the clock, the timings, the published version."""

    loop: VirtualTimeLoop
    timings: Timings
    #: weight version the generators hold (moved by the publisher)
    weight_version: int = 0
    #: generation calls issued, groups generated
    calls: int = 0
    groups: int = 0
    generator_busy_s: float = 0.0
    #: per sample: the key of its payload row (the rows are never stored)
    key_format: str = "{gid}/{attempt}/{i}"
    lengths_by_group: dict[str, list[int]] = field(default_factory=dict)
    #: called when the publisher moves ``weight_version`` (partial-rollout calls flush)
    # an ordered set: refit notices go out in registration order, so a seeded run's log
    # is the same every time (a set's order follows object ids)
    on_refit: dict[Callable[[], None], None] = field(default_factory=dict)
    #: load-dependent decode speed (``sim.decode``); None: a group takes its drawn time
    #: whatever else runs
    decode: LoadedDecode | None = None

    @property
    def work_clock(self) -> VirtualTimeLoop | LoadedDecode:
        """What a generation's drawn seconds elapse on: the loop, or the decode work clock."""
        return self.loop if self.decode is None else self.decode

    def decoding(self, sequences: int) -> None:
        """``sequences`` started (> 0) or stopped (< 0) decoding."""
        if self.decode is not None:
            if sequences > 0:
                self.decode.add(sequences)
            else:
                self.decode.remove(-sequences)


class SimGenerator:
    """A generator whose calls end after their slowest group's generation time; a refit
    lands between two tokens (the torch sampler), so it never waits for a call."""

    def __init__(self, name: str, fleet: Fleet) -> None:
        self.name = name
        self.fleet = fleet

    @property
    def version(self) -> int:
        """The weights it samples with now."""
        return self.fleet.weight_version

    def generate(self, requests: list[GenerationRequest]) -> asyncio.Future:
        fleet = self.fleet
        with fleet.loop.uncharged():
            fut = fleet.loop.create_future()
            duration = max(fleet.timings.generation_s(r.group_id, r.attempt) for r in requests)
            fleet.calls += 1
            fleet.generator_busy_s += duration
            # the call's sequences decode until its slowest group ends
            fleet.decoding(sum(r.n_samples for r in requests))
            fleet.work_clock.call_later(duration, self._done, fut, requests, self.version)
        return fut

    def _done(self, fut: asyncio.Future, requests: list[GenerationRequest], start: int) -> None:
        fleet = self.fleet
        if fleet.decode is not None:
            with fleet.loop.uncharged():
                fleet.decoding(-sum(r.n_samples for r in requests))
        if fut.done():
            return  # cancelled (the run stopped)
        end = self.version
        with fleet.loop.uncharged():
            outcomes = []
            for r in requests:
                lengths = fleet.timings.group_lengths(r.group_id, r.n_samples)
                fleet.lengths_by_group[r.group_id] = lengths
                outcomes.append(GenerationOutcome(
                    payload_keys=[
                        fleet.key_format.format(gid=r.group_id, attempt=r.attempt, i=i)
                        for i in range(r.n_samples)
                    ],
                    rewards=fleet.timings.group_rewards(r.group_id, r.n_samples),
                    lengths=lengths,
                    weight_version_start=start,
                    weight_version_end=end,
                ))
            fleet.groups += len(requests)
            fut.set_result(outcomes)

    async def weight_version(self) -> int:
        return self.fleet.weight_version


class SimGroupBoundaryGenerator(SimGenerator):
    """A generator whose weights change only between calls: our vLLM backend with
    ``rollout.vllm.chunk_tokens = 0`` (``LLM.generate`` cannot pause), and peers without
    in-flight updates. A refit that arrives during a call waits for its end, so the
    call's groups hold one version; the publish -- which an in-line publishing trainer
    awaits -- ends when the longest call in flight does (:meth:`refit`)."""

    def __init__(self, name: str, fleet: Fleet) -> None:
        super().__init__(name, fleet)
        self._version = fleet.weight_version
        self._busy = 0
        self._waiting: list[tuple[int, asyncio.Future]] = []

    @property
    def version(self) -> int:
        return self._version

    def generate(self, requests: list[GenerationRequest]) -> asyncio.Future:
        self._busy += 1
        fut = super().generate(requests)
        fut.add_done_callback(self._call_ended)
        return fut

    def _call_ended(self, _fut: asyncio.Future) -> None:
        self._busy -= 1
        if self._busy == 0 and self._waiting:  # the refits that waited land now
            self._version = max([self._version, *(v for v, _ in self._waiting)])
            for _, waiter in self._waiting:
                if not waiter.done():
                    waiter.set_result(None)
            self._waiting = []

    async def refit(self, version: int) -> None:
        """Load ``version``: at once when idle, else once the call in flight has ended."""
        if self._busy == 0:
            self._version = max(self._version, version)
            return
        waiter = self.fleet.loop.create_future()
        self._waiting.append((version, waiter))
        await waiter


class SimTrainer:
    """Counts versions like the real trainer; each call takes its simulated time."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.version = 0
        self.step = -1
        self.index = 0
        self.sequences = 0
        self.tokens = 0
        #: virtual seconds spent in begin/microbatch/finish calls
        self.busy_s = 0.0
        #: virtual seconds spent saving checkpoints (the trainer held), and written
        #: behind training by async saves
        self.checkpoint_s = 0.0
        self.checkpoint_background_s = 0.0
        self._writing: dict[str, tuple[float, CheckpointOutcome]] = {}

    async def _work(self, seconds: float) -> None:
        self.busy_s += seconds
        if seconds > 0:
            await asyncio.sleep(seconds)

    async def begin_train_step(self, step: int) -> None:
        self.step, self.index, self.sequences, self.tokens = step, 0, 0, 0

    async def train_microbatch(self, ref: MicrobatchRef) -> MicrobatchOutcome:
        n = len(ref.payload_keys)
        await self._work(self.fleet.timings.microbatch_s(self.step, self.index, n))
        self.index += 1
        self.sequences += n
        return MicrobatchOutcome(num_sequences=n, num_tokens=n * 8)

    async def finish_train_step(self) -> StepOutcome:
        await self._work(self.fleet.timings.finish_s(self.step))
        self.version += 1
        return StepOutcome(
            trainer_version=self.version,
            metrics={"loss": 0.0},
            grad_norm=1.0,
            weights_digest=self.digest(),
        )

    async def abort_train_step(self) -> None:
        self.index = 0

    def digest(self) -> str:
        return hashlib.sha256(f"sim-weights-{self.version}".encode()).hexdigest()[:16]

    async def version_and_digest(self) -> tuple[int, str]:
        return self.version, self.digest()

    async def save_checkpoint(self, directory: str) -> CheckpointOutcome:
        seconds = self.fleet.timings.checkpoint_s(self.version)
        self.checkpoint_s += seconds
        if seconds > 0:
            await asyncio.sleep(seconds)
        return CheckpointOutcome(trainer_version=self.version, uri=directory, sha256=self.digest())

    #: share of a checkpoint's time the snapshot of an async save holds the trainer for
    #: (copying its state in memory; the write, fsync and rename run behind it)
    SNAPSHOT_FRACTION = 0.1

    async def begin_checkpoint(self, directory: str) -> None:
        seconds = self.fleet.timings.checkpoint_s(self.version)
        snapshot = seconds * self.SNAPSHOT_FRACTION
        self.checkpoint_s += snapshot
        self.checkpoint_background_s += seconds - snapshot
        if snapshot > 0:
            await asyncio.sleep(snapshot)
        loop = self.fleet.loop
        self._writing[directory] = (loop.time() + seconds - snapshot, CheckpointOutcome(
            trainer_version=self.version, uri=directory, sha256=self.digest()))

    async def checkpoint_outcome(self, directory: str) -> CheckpointOutcome | None:
        done_at, outcome = self._writing[directory]
        if self.fleet.loop.time() < done_at:
            return None
        del self._writing[directory]
        return outcome

    async def load_checkpoint(self, directory: str) -> tuple[int, str]:
        raise NotImplementedError("the simulated trainer never reloads")


class SimPublisher:
    """Refit: the generators hold ``version`` after the simulated publish time (and, for
    generators that change weights only between calls, once each of those has ended)."""

    def __init__(
        self, fleet: Fleet, names: list[str],
        between_calls: Sequence[SimGroupBoundaryGenerator] = (),
    ) -> None:
        self.fleet = fleet
        self.names = names
        self.between_calls = list(between_calls)
        self.busy_s = 0.0

    async def publish(self, version: int, only: list[str] | None = None) -> list[str]:
        seconds = self.fleet.timings.publish_s(version)
        self.busy_s += seconds
        if seconds > 0:
            await asyncio.sleep(seconds)
        fleet = self.fleet
        if version > fleet.weight_version:
            fleet.weight_version = version
            for notify in list(fleet.on_refit):
                notify()
        if self.between_calls:
            started = fleet.loop.time()
            await asyncio.gather(*(g.refit(version) for g in self.between_calls
                                   if only is None or g.name in only))
            self.busy_s += fleet.loop.time() - started
        return list(self.names if only is None else only)


#: the simulated generators' segment rows (model turns, and an episode's observations):
#: deleting them is not a checkpoint's release
SCRATCH_PREFIXES = ("seg:", "obs:")


class SimPayloads:
    """No rows are ever stored; deleting them takes the release time of the checkpoint
    the trainer just saved (the loop releases right after a checkpoint)."""

    def __init__(self, fleet: Fleet, trainer: SimTrainer) -> None:
        self.fleet = fleet
        self.trainer = trainer

    async def delete(self, keys: list[str]) -> None:
        with self.fleet.loop.uncharged():  # the simulated data plane's look at its keys
            scratch = bool(keys) and all(k.startswith(SCRATCH_PREFIXES) for k in keys)
        if scratch:
            return  # segment rows of committed groups: scratch, not a release
        seconds = self.fleet.timings.release_s(self.trainer.version)
        self.trainer.checkpoint_s += seconds
        if seconds > 0:
            await asyncio.sleep(seconds)

    async def keys(self) -> list[str]:
        return []
