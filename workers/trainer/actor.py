"""Thin Ray shell over :class:`TorchTrainer`, and the driver that fans calls out to N ranks.

::

    controller --(TrainerGroup: split-API calls)--> rank 0 actor --+
                                                    rank 1 actor --+-- one torch.distributed
                                                    ...            |   group (gloo on CPU,
                                                    rank N-1 actor-+   NCCL on GPU)

``TrainerRankActor`` is a plain class (one trainer rank); Ray wraps it only when
``TrainerGroup`` starts it, so tests drive it in-process too. ``TrainerGroup`` keeps its
own copy of the step phase and rejects wrong-order calls *before* fanning out: a call
that would fail on only some ranks could leave the others blocked in a collective.

Microbatches: ``train_microbatch(batch)`` splits one global microbatch's rows across the
data-parallel ranks (a rank with no rows runs a dummy; the ``tensor_parallel`` ranks of
one dp index get the same rows); ``train_microbatches(per_rank)`` takes explicit
per-rank lists of possibly different lengths and pads the short ones with zero-weight
dummies, so every rank makes the same number of calls.

``TrainerGroup`` is a ``Trainer`` like one rank: ``train_microbatch`` returns the
global :class:`MicrobatchResult` (the dp ranks' counts summed), so a caller never needs
to know how many ranks there are.

Backends: each rank builds ``trainer_backend`` ("torch", "megatron" or "fsdp2") through
``workers.backends.make_trainer``. Where the rank's placement makes reading the full
weights a collective (fsdp2: parameters are sharded; ``setup`` says so),
``export_weights`` and ``compute_logprobs`` go to every rank, and rank 0's answer is
returned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from workers.batch import TrainBatch
from workers.loss import StepLoss
from workers.trainer import distributed as dd
from workers.trainer.api import (
    CheckpointInfo,
    LogprobSource,
    MicrobatchResult,
    StepPhase,
    StepResult,
    TrainStepStateError,
    train_one_shot,
)
from workers.trainer.config import ModelFactory, TrainerBackend, TrainerRuntime, TrainSection
from workers.trainer.options import BackendOptions

if TYPE_CHECKING:
    from workers.trainer.rank import RankTrainer


class TrainerRankActor:
    """One data-parallel rank inside a Ray actor: joins the group, then delegates."""

    def __init__(self) -> None:
        self._trainer: RankTrainer | None = None

    def address(self) -> tuple[str, int]:
        """(node ip, a free port) for the rank-0 rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), dd.find_free_port()

    def setup(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        model_factory: ModelFactory,
        train: TrainSection,
        runtime: TrainerRuntime,
        backend: dd.Backend | None = None,
        trainer_backend: TrainerBackend = "torch",
        options: BackendOptions | None = None,
    ) -> bool:
        """Join the group and build the rank; True when reading its full weights
        (export, logprobs) is a collective every rank must join."""
        from workers.backends import make_trainer

        dd.init_process_group(rank, world_size, master_addr, master_port, backend)
        self._trainer = make_trainer(trainer_backend, model_factory, train, runtime, options)
        return self._trainer.parallel.placement.collective_forward

    @property
    def trainer(self) -> RankTrainer:
        if self._trainer is None:
            raise RuntimeError("TrainerRankActor.setup has not been called")
        return self._trainer

    def trainer_version(self) -> int:
        return self.trainer.trainer_version

    def begin_train_step(self, step: int, loss_config: StepLoss) -> None:
        self.trainer.begin_train_step(step, loss_config)

    def train_microbatch(self, batch: TrainBatch | None) -> MicrobatchResult:
        return self.trainer.train_microbatch(batch)

    def finish_train_step(self) -> StepResult:
        return self.trainer.finish_train_step()

    def abort_train_step(self) -> None:
        self.trainer.abort_train_step()

    def compute_logprobs(
        self, batch: TrainBatch | None, which: LogprobSource, temperature: float
    ) -> torch.Tensor:
        return self.trainer.compute_logprobs(batch, which, temperature=temperature)

    def save_checkpoint(self, directory: str) -> CheckpointInfo:
        return self.trainer.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> CheckpointInfo:
        return self.trainer.load_checkpoint(directory)

    def weights_digest(self) -> str:
        return self.trainer.weights_digest()

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.trainer.export_weights()

    def shutdown(self) -> None:
        """Leave the process group (before the actor is killed)."""
        dd.destroy_process_group()


class DivergedRanksError(RuntimeError):
    """Data-parallel ranks disagree after a step (version, digest or metrics)."""


class TrainerGroup:
    """Driver over ``world_size`` rank actors, mirroring the ``Trainer`` protocol.

    Beyond one rank: ``train_microbatches`` takes explicit per-rank microbatch lists
    and returns every rank's results, and ``finish_train_step`` checks that all ranks
    report the same result. ``train.tensor_parallel`` ranks of a data-parallel index
    share its rows.
    """

    def __init__(
        self,
        world_size: int,
        model_factory: ModelFactory,
        train: TrainSection | None = None,
        runtime: TrainerRuntime | None = None,
        *,
        num_cpus_per_rank: float = 1,
        num_gpus_per_rank: float = 0,
        backend: dd.Backend | None = None,
        trainer_backend: TrainerBackend = "torch",
        options: BackendOptions | None = None,
    ) -> None:
        import ray

        train, runtime = train or TrainSection(), runtime or TrainerRuntime()
        tensor_parallel = train.tensor_parallel
        if world_size % tensor_parallel:
            raise ValueError(f"tensor_parallel {tensor_parallel} does not divide {world_size} ranks")

        if not ray.is_initialized():
            # Nobody started Ray (``replay --retrain`` of a multi-rank run): a local one
            # whose workers' warnings stay in Ray's logs, out of the user's terminal.
            ray.init(num_cpus=max(4, world_size), include_dashboard=False, log_to_driver=False)
        self._ray = ray
        cls = ray.remote(num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank)(
            TrainerRankActor
        )
        self.world_size = world_size
        self.tensor_parallel = tensor_parallel
        self._ranks = [cls.remote() for _ in range(world_size)]
        addr, port = ray.get(self._ranks[0].address.remote())
        if backend is None and num_gpus_per_rank == 0:
            backend = "gloo"
        collective = self._all(
            [
                a.setup.remote(
                    r, world_size, addr, port, model_factory, train, runtime, backend,
                    trainer_backend, options,
                )
                for r, a in enumerate(self._ranks)
            ]
        )
        self._collective_reads = collective[0]
        self._phase = StepPhase.IDLE
        self._version = 0

    def _all(self, refs: list[Any]) -> list[Any]:
        return self._ray.get(refs)

    def _fan(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        """``method`` (a ``TrainerRankActor`` method) on every rank, results in rank order."""
        return self._all([getattr(a, method.__name__).remote(*args) for a in self._ranks])

    def _require(self, method: str, phase: StepPhase) -> None:
        if self._phase is not phase:
            raise TrainStepStateError(
                f"{method} called while the group's step is {self._phase.value} "
                f"(needs {phase.value})"
            )

    @property
    def trainer_version(self) -> int:
        return self._version

    def begin_train_step(self, step: int, loss_config: StepLoss) -> None:
        self._require(f"begin_train_step({step})", StepPhase.IDLE)
        self._fan(TrainerRankActor.begin_train_step, step, loss_config)
        self._phase = StepPhase.OPEN

    def _guarded(self, refs: list[Any]) -> list[Any]:
        try:
            return self._all(refs)
        except BaseException:
            self._phase = StepPhase.FAILED
            raise

    def train_microbatch(self, batch: TrainBatch | None) -> MicrobatchResult:
        """One global microbatch, rows split across ranks; its global counts."""
        self._require("train_microbatch", StepPhase.OPEN)
        shards = self._shards(batch)
        per_rank: list[MicrobatchResult] = self._guarded(
            [a.train_microbatch.remote(s) for a, s in zip(self._ranks, shards)]
        )
        counted = per_rank[:: self.tensor_parallel]  # the tp ranks of a dp index share rows
        return MicrobatchResult(
            index=per_rank[0].index,
            num_sequences=sum(r.num_sequences for r in counted),
            num_tokens=sum(r.num_tokens for r in counted),
            dummy=all(r.dummy for r in per_rank),
        )

    def _shards(self, batch: TrainBatch | None) -> list[TrainBatch | None]:
        """Each rank's rows: split over dp indices, repeated for the tp ranks of one."""
        tp = self.tensor_parallel
        if batch is None:
            return [None] * self.world_size
        per_dp = dd.shard_rows(batch, self.world_size // tp)
        return [per_dp[r // tp] for r in range(self.world_size)]

    def train_microbatches(
        self, per_rank: Sequence[Sequence[TrainBatch]]
    ) -> list[list[MicrobatchResult]]:
        """Explicit per-rank microbatch lists; shorter lists are padded with dummies."""
        self._require("train_microbatches", StepPhase.OPEN)
        if len(per_rank) != self.world_size:
            raise ValueError(f"{len(per_rank)} microbatch lists for {self.world_size} ranks")
        k = max((len(mbs) for mbs in per_rank), default=0)
        results: list[list[MicrobatchResult]] = [[] for _ in range(self.world_size)]
        for i in range(k):
            refs = [
                a.train_microbatch.remote(mbs[i] if i < len(mbs) else None)
                for a, mbs in zip(self._ranks, per_rank)
            ]
            for r, res in enumerate(self._guarded(refs)):
                results[r].append(res)
        return results

    def finish_train_step(self) -> StepResult:
        self._require("finish_train_step", StepPhase.OPEN)
        results: list[StepResult] = self._guarded(
            [a.finish_train_step.remote() for a in self._ranks]
        )
        first = results[0]
        for r, res in enumerate(results[1:], start=1):
            if res != first:
                raise DivergedRanksError(f"rank {r} finished with {res}, rank 0 with {first}")
        self._version = first.trainer_version
        self._phase = StepPhase.IDLE
        return first

    def abort_train_step(self) -> None:
        self._fan(TrainerRankActor.abort_train_step)
        self._phase = StepPhase.IDLE

    def train(
        self, batch: TrainBatch | None, loss_config: StepLoss, *, step: int | None = None
    ) -> StepResult:
        return train_one_shot(self, batch, loss_config, step)

    def compute_logprobs(
        self, batch: TrainBatch, which: LogprobSource = "policy", *, temperature: float = 1.0
    ) -> torch.Tensor:
        shards = self._shards(batch)
        if not self._collective_reads:
            refs = [
                a.compute_logprobs.remote(s, which, temperature)
                for a, s in zip(self._ranks, shards)
                if s is not None
            ]
            return torch.cat(self._all(refs), dim=0)
        outs = self._all(
            [a.compute_logprobs.remote(s, which, temperature) for a, s in zip(self._ranks, shards)]
        )
        tp = self.tensor_parallel
        return torch.cat(
            [o for r, (o, s) in enumerate(zip(outs, shards)) if s is not None and r % tp == 0],
            dim=0,
        )

    def save_checkpoint(self, directory: str | Path) -> CheckpointInfo:
        self._require("save_checkpoint", StepPhase.IDLE)
        return self._fan(TrainerRankActor.save_checkpoint, str(directory))[0]

    def load_checkpoint(self, directory: str | Path) -> CheckpointInfo:
        self._require("load_checkpoint", StepPhase.IDLE)
        info = self._fan(TrainerRankActor.load_checkpoint, str(directory))[0]
        self._version = info.trainer_version
        return info

    def weights_digest(self) -> str:
        digests = self._fan(TrainerRankActor.weights_digest)
        if len(set(digests)) != 1:
            raise DivergedRanksError(f"ranks hold different weights: {digests}")
        return digests[0]

    def export_weights(self) -> dict[str, torch.Tensor]:
        if self._collective_reads:
            return self._fan(TrainerRankActor.export_weights)[0]
        return self._all([self._ranks[0].export_weights.remote()])[0]

    def close(self) -> None:
        """Leave the process group and kill every rank, even when some are already dead."""
        try:
            self._fan(TrainerRankActor.shutdown)
        except Exception:
            pass  # a dead rank cannot leave: killing it below is all there is to do
        finally:
            for a in self._ranks:
                self._ray.kill(a)
