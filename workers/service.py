"""The workers as the controller sees them: plain classes taking and returning
references, never tensors from the controller.

``TrainerWorker`` reads a microbatch's rows from the data plane by key, collates them
with the advantages the controller computed and runs the split-API step.
``GeneratorWorker`` maps a prompt index to a prompt of the task and runs
``generate_group``. Both are built from a picklable :class:`WorkerSpec`, so the same
class runs in-process (tests, single-process runs) or as a Ray actor
(``workers.handles``). Both are fenced (``workers.fencing``): a controller's handles
call ``fenced(epoch, method, ...)`` and a stale epoch is refused here, at the worker.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers.api import (
    CheckpointOutcome,
    GenerationOutcome,
    GenerationRequest,
    MicrobatchOutcome,
    MicrobatchRef,
    StepOutcome,
    error_line,
)
from workers.backends import GeneratorBackend, make_trainer
from workers.batch import OPTIONAL_ROW_FIELDS, ROW_FIELDS, collate
from workers.dataplane import DataPlane, DataPlaneRuntime, DataPlaneSection, make_dataplane
from workers.dataplane.api import MissingPayloadError
from workers.errors import GroupError
from workers.fencing import EpochFence, Fenced
from workers.generator.config import MIB, PartialSection, VllmSection
from workers.generator.generator import Generator
from workers.envs.agent import AgentTask
from workers.generator.episodes import EpisodeGroups
from workers.generator.inflight import InflightRunner
from workers.generator.vllm_config import VllmRuntime
from workers.loss import StepLoss
from workers.models.config import ModelSection, SamplingSection
from workers.models.factory import build_model
from workers.envs.task import EpisodeTask
from workers.tasks import make_task, prompt_set
from workers.tasks.config import TaskSection
from workers.trainer.api import Trainer
from workers.trainer.async_checkpoint import AsyncCheckpointer
from workers.trainer.checkpoint import MANIFEST_NAME, CheckpointCorruptError
from workers.trainer.config import BuiltModelFactory, TrainSection
from workers.weight_sync import WeightsAck
from workers.weight_transport import DEFAULT_BUCKET_BYTES, RefitSource


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build itself in any process (picklable).

    It carries the config tables the workers own -- the same Structs the run's
    ``Config`` composes, not copies, which the components take as they are -- and the
    run's own values beside them (run id, seed, where the data plane lives).
    """

    run_id: str
    #: the run's seed: model init, prompt order, trainer and engine seeds
    seed: int
    model: ModelSection
    task: TaskSection
    sampling: SamplingSection
    train: TrainSection
    dataplane: DataPlaneSection
    #: the run's directory and Ray cluster, for the data plane
    dataplane_runtime: DataPlaneRuntime
    generator_backend: GeneratorBackend = "torch"
    vllm: VllmSection = field(default_factory=VllmSection)
    partial: PartialSection = field(default_factory=PartialSection)
    #: weight refit bucket size (``workers.weight_transport``)
    refit_bucket_mib: float = DEFAULT_BUCKET_BYTES / MIB
    task_options: Mapping[str, Any] = field(default_factory=dict)
    torch_threads: int = 1

    @property
    def refit_bucket_bytes(self) -> int:
        return max(1, int(self.refit_bucket_mib * MIB))


class TrainerWorker(Fenced):
    """The trainer behind the controller's ``TrainerClient`` protocol (its calls are
    ``workers.calls.TrainerCalls``).

    Also deletes data-plane rows for the controller (:meth:`clear_payloads`), so those
    deletes pass the same fence as the trainer calls.
    """

    def __init__(self, spec: WorkerSpec, dataplane: DataPlane | None = None) -> None:
        torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self.fence = EpochFence(spec.run_id, "trainer")
        if dataplane is None:
            dataplane = make_dataplane(spec.dataplane, spec.dataplane_runtime)
        self.dataplane = dataplane
        #: the loss compares logprobs under the generators' sampling temperature
        self.loss = StepLoss(spec.train.loss, spec.sampling)
        self.trainer: Trainer = self._build()
        # any backend's export_weights feeds the refit (torch, megatron, FSDP2)
        self._refit = RefitSource(lambda: self.trainer.export_weights())
        self._checkpointer = AsyncCheckpointer()

    def _build(self) -> Trainer:
        """One rank in this process, or a ``TrainerGroup`` of rank actors (any backend)."""
        spec, train = self.spec, self.spec.train
        factory = BuiltModelFactory(spec.model, spec.seed)
        runtime = train.runtime(spec.seed)
        world = train.data_parallel * train.tensor_parallel
        if world == 1:
            return make_trainer(train.backend, factory, train, runtime)
        from workers.trainer.actor import TrainerGroup

        return TrainerGroup(world, factory, train, runtime, trainer_backend=train.backend)

    def reset(self) -> None:
        """Back to the initial weights (seeded init, version 0), as if just started."""
        self.trainer.close()  # a TrainerGroup's rank actors stop before new ones start
        self.trainer = self._build()

    def close(self) -> None:
        """Stop what the trainer started (a data-parallel group's rank actors)."""
        self.trainer.close()

    def begin_train_step(self, step: int) -> None:
        self.trainer.begin_train_step(step, self.loss)

    def train_microbatch(self, ref: MicrobatchRef) -> MicrobatchOutcome:
        batch = collate(self._rows(ref.payload_keys), ref.advantages, ref.versions,
                        ref.turn_advantages)
        result = self.trainer.train_microbatch(batch)
        return MicrobatchOutcome(num_sequences=result.num_sequences, num_tokens=result.num_tokens)

    def _rows(self, keys: list[str]) -> Any:
        """The rows' fields; those an older writer did not write are left out."""
        try:
            return self.dataplane.get_batch(self.spec.run_id, keys, list(ROW_FIELDS))
        except MissingPayloadError as err:
            if err.keys or not set(err.fields) <= OPTIONAL_ROW_FIELDS:
                raise
        required = [f for f in ROW_FIELDS if f not in OPTIONAL_ROW_FIELDS]
        return self.dataplane.get_batch(self.spec.run_id, keys, required)

    def finish_train_step(self) -> StepOutcome:
        r = self.trainer.finish_train_step()
        digest = r.weights_digest or self.trainer.weights_digest()
        metrics = {k: float(v) for k, v in r.metrics.items()}
        metrics["train/lr"] = float(r.lr)
        return StepOutcome(
            trainer_version=r.trainer_version,
            metrics=metrics,
            grad_norm=float(r.grad_norm),
            weights_digest=digest,
        )

    def abort_train_step(self) -> None:
        self.trainer.abort_train_step()

    def version_and_digest(self) -> tuple[int, str]:
        return self.trainer.trainer_version, self.trainer.weights_digest()

    def save_checkpoint(self, directory: str) -> CheckpointOutcome:
        info = self.trainer.save_checkpoint(directory)
        return CheckpointOutcome(trainer_version=info.trainer_version, uri=info.path, sha256=info.sha256)

    def begin_checkpoint(self, directory: str) -> None:
        """Snapshot the trainer and write it in the background (``async_checkpoint``)."""
        self._checkpointer.begin(self.trainer, directory)

    def checkpoint_outcome(self, directory: str) -> CheckpointOutcome | None:
        """The begun checkpoint once it is durable; None while it is being written."""
        info = self._checkpointer.outcome(directory)
        if info is None:
            return None
        return CheckpointOutcome(trainer_version=info.trainer_version, uri=info.path, sha256=info.sha256)

    def load_checkpoint(self, directory: str, expected_sha256: str | None = None) -> tuple[int, str]:
        """Load a checkpoint; with ``expected_sha256`` (the log's), refuse any other one.

        The manifest hash is checked before anything is loaded; the trainer then checks
        every file against the manifest and the weights against the manifest's digest.
        """
        if expected_sha256 is not None:
            manifest = Path(directory) / MANIFEST_NAME
            try:
                got = hashlib.sha256(manifest.read_bytes()).hexdigest()
            except OSError as err:
                raise CheckpointCorruptError(f"checkpoint {directory}: {err}") from None
            if got != expected_sha256:
                raise CheckpointCorruptError(
                    f"checkpoint {directory}: manifest sha256 {got[:12]}..., the log recorded "
                    f"{expected_sha256[:12]}..."
                )
        info = self.trainer.load_checkpoint(directory)
        return info.trainer_version, self.trainer.weights_digest()

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.trainer.export_weights()

    def prepare_weight_buckets(self, version: int, bucket_bytes: int) -> int:
        """Export the weights for a refit and plan their buckets (``workers.weight_transport``)."""
        return self._refit.prepare_weight_buckets(version, bucket_bytes)

    def weight_bucket(self, version: int, index: int) -> bytes:
        return self._refit.weight_bucket(version, index)

    def clear_payloads(self, keys: list[str]) -> None:
        """Delete rows of this run from the data plane, on the controller's behalf."""
        self.dataplane.clear(self.spec.run_id, keys)

    def pid(self) -> int:
        """This worker's process id (chaos tests kill -9 it)."""
        return os.getpid()


class GeneratorWorker(Fenced):
    """A generator behind the controller's ``GeneratorClient`` protocol.

    It serves two calls at once (a weight update may arrive mid-generation), so its
    writes -- the rows of a group, a weight update -- re-check the fence as they land.
    """

    def __init__(self, spec: WorkerSpec, name: str, dataplane: DataPlane | None = None) -> None:
        torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self.name = name
        self.fence = EpochFence(spec.run_id, name)
        task = make_task(spec.task.name, **{**spec.task.options, **spec.task_options})
        self.prompts = prompt_set(task, spec.task.num_prompts, spec.seed, spec.task.dataset or None)
        self.sampling = spec.sampling
        if dataplane is None:
            dataplane = make_dataplane(spec.dataplane, spec.dataplane_runtime)
        fenced_plane: Any = _FencedWrites(dataplane, self.fence)
        self.generator: Any
        if spec.generator_backend == "vllm" and isinstance(task, EpisodeTask):
            raise ValueError(
                f"task {spec.task.name!r} runs multi-turn episodes, which the vLLM generator "
                "does not run yet; use rollout.backend = \"torch\""
            )
        if spec.generator_backend == "vllm":
            from workers.backends import make_generator
            from workers.models.hf import load_hf_tokenizer

            assert spec.model.path, "the vLLM generator needs an HF model directory"
            self.generator = make_generator(
                "vllm", model_path=spec.model.path, tokenizer=load_hf_tokenizer(spec.model.path),
                task=task, dataplane=fenced_plane, run_id=spec.run_id, name=name,
                options=spec.vllm,
                runtime=VllmRuntime(seed=spec.seed, prefix_caching=not spec.partial.enabled),
                num_threads=spec.torch_threads, kv_on_refit=spec.partial.kv_on_refit,
            )
        else:
            model, tokenizer = build_model(spec.model, spec.seed)
            self.generator = Generator(
                model, tokenizer, task, fenced_plane, spec.run_id, name=name,
                kv_on_refit=spec.partial.kv_on_refit,
            )
        # an update waiting for a step boundary must not hold the fence the generating
        # thread writes its flushes under (``workers.fencing.EpochFence.released``)
        self.generator.weights.waiting = self.fence.released
        #: partial rollouts: the groups paused at a flush point (``generator.inflight``);
        #: for an episode task, at every record point (``generator.episodes``)
        self.inflight: InflightRunner | EpisodeGroups | None = None
        if spec.partial.enabled:
            self.inflight = (
                EpisodeGroups(self.generator) if isinstance(task, (EpisodeTask, AgentTask))
                else InflightRunner(
                    self.generator, spec.partial.segment_tokens, spec.partial.flush_on_refit
                )
            )

    def generate(self, req: GenerationRequest) -> GenerationOutcome:
        """One group's outcome; its own error (``workers.errors``) fails it alone."""
        example = self.prompts[req.prompt_index % len(self.prompts)]
        try:
            result = self.generator.generate_group(
                req.group_id, example, req.n_samples, self.sampling, req.seed, req.attempt
            )
        except GroupError as err:
            return GenerationOutcome.failed(error_line(err))
        return GenerationOutcome(
            payload_keys=list(result.keys),
            rewards=list(result.rewards),
            lengths=list(result.completion_lens),
            weight_version_start=result.weight_version_start,
            weight_version_end=result.weight_version_end,
            version_runs=result.version_runs,
        )

    def generate_groups(self, reqs: list[GenerationRequest]) -> list[GenerationOutcome]:
        """One call, several groups (``rollout.groups_per_call``), generated in order;
        with partial rollouts, until the first flush point (``generator.inflight``).
        A group's own error (``workers.errors``) fails that group alone: its outcome is
        ``"failed"``, the others' are as usual (``docs/running.md``)."""
        if self.inflight is not None:
            examples = [self.prompts[r.prompt_index % len(self.prompts)] for r in reqs]
            return self.inflight.advance(reqs, examples, self.sampling)
        return [self.generate(req) for req in reqs]

    def update_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> WeightsAck:
        with self.fence.guard():
            return self.generator.update_weights(version, state_dict)

    def receive_weight_bucket(
        self, version: int, index: int, count: int, bucket: bytes
    ) -> WeightsAck | None:
        """One refit bucket (``workers.weight_transport``); the last one returns the ack."""
        with self.fence.guard():
            return self.generator.receive_weight_bucket(version, index, count, bucket)

    def close(self) -> None:
        """Stop generating and free the engine (a vLLM engine's processes included)."""
        self.generator.close()

    def weight_version(self) -> int:
        return self.generator.weight_version

    def pid(self) -> int:
        return os.getpid()


class _FencedWrites:
    """The generator's data plane: a ``put`` lands only if the fence still admits the call."""

    def __init__(self, plane: DataPlane, fence: EpochFence) -> None:
        self._plane = plane
        self._fence = fence

    def put(self, *args: Any, **kwargs: Any) -> None:
        with self._fence.guard():
            self._plane.put(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plane, name)
