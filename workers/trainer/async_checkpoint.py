"""Checkpoints written off the trainer's critical path (as torchtitan's async checkpointing).

A synchronous ``save_checkpoint`` holds the trainer for the whole write: serialise
model, optimizer and scheduler, fsync every file, rename. Here the trainer only takes a
**snapshot** -- its state copied into memory it does not touch again -- and a
background thread writes that snapshot through the same ``checkpoint.save_collective``
(staging directory, fsync, manifest, atomic rename). The controller starts one with
:meth:`AsyncCheckpointer.begin`, goes on training, and polls :meth:`outcome`; only once
that returns (the checkpoint is durable) does it append ``CheckpointSaved`` and release
the payloads the checkpoint covers. A crash before that leaves a staging directory that
is never named in the log.

Only a single-process trainer is snapshotted this way (the torch backend at world size
1): a multi-rank save is a collective, which a background thread must not run beside the
training's own collectives. Every other trainer falls back to its synchronous save inside
:meth:`begin` (the outcome is then ready at once), so the controller's protocol is the
same for all.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from workers.trainer import checkpoint as ckpt
from workers.trainer.api import CheckpointInfo


def snapshot_writer(trainer: Any, directory: str) -> Callable[[], CheckpointInfo] | None:
    """A closure writing ``trainer``'s state as of now, or None if it cannot be staged."""
    from workers.trainer.torch_backend import TorchTrainer

    if type(trainer) is not TorchTrainer or trainer.world_size != 1:
        return None
    trainer._require_idle("save_checkpoint")
    with torch.no_grad():  # copies the trainer will not touch again: a consistent state
        rank0 = {
            "model.pt": {k: v.detach().to("cpu", copy=True) for k, v in trainer._model.state_dict().items()},
            "optimizer.pt": copy.deepcopy(trainer._optimizer.state_dict()),
            "scheduler.pt": copy.deepcopy(trainer._scheduler.state_dict()),
        }
    rng = copy.deepcopy(trainer._rng_state())
    meta = {
        "trainer_version": trainer._version,
        "step": trainer._last_step,
        "world_size": 1,
        "weights_digest": trainer.weights_digest(),
        "reference_digest": trainer._reference_digest,
    }
    final = Path(directory)

    def write() -> CheckpointInfo:
        sha, files = ckpt.save_collective(
            final, rank=0, rank_files={"rng_rank0.pt": rng}, rank0_files=lambda: rank0,
            meta=lambda: meta,
        )
        return CheckpointInfo(str(final), meta["trainer_version"], meta["step"], sha, files)

    return write


class AsyncCheckpointer:
    """One background checkpoint write at a time, per trainer worker."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self._lock = threading.Lock()
        self._jobs: dict[str, Future[CheckpointInfo]] = {}

    def begin(self, trainer: Any, directory: str) -> None:
        """Snapshot now and write in the background (or save synchronously, see above)."""
        with self._lock:
            for path, job in list(self._jobs.items()):
                if job.done():
                    continue
                raise RuntimeError(f"checkpoint {path} is still being written; one at a time")
        write = snapshot_writer(trainer, directory)
        job: Future[CheckpointInfo] = Future()
        if write is None:
            job.set_result(trainer.save_checkpoint(directory))
        else:
            job = self._pool.submit(write)
        with self._lock:
            self._jobs[directory] = job

    def outcome(self, directory: str) -> CheckpointInfo | None:
        """The durable checkpoint, None while it is written; raises if the write failed."""
        with self._lock:
            job = self._jobs.get(directory)
        if job is None:
            raise KeyError(f"no checkpoint of {directory} was begun")
        if not job.done():
            return None
        with self._lock:
            self._jobs.pop(directory, None)
        return job.result()

    def wait(self, directory: str) -> CheckpointInfo:
        """Block until the write of ``directory`` is durable (or raise its error)."""
        with self._lock:
            job = self._jobs.get(directory)
        if job is None:
            raise KeyError(f"no checkpoint of {directory} was begun")
        job.result()  # blocks; the write itself is bounded by the disk, not a timer
        info = self.outcome(directory)
        assert info is not None
        return info

    def close(self) -> None:
        self._pool.shutdown(wait=True)
