"""Sharded checkpoints of the FSDP2 trainer with ``torch.distributed.checkpoint`` (DCP).

Layout of ``<dir>/`` (one directory per trainer_version, like the torch backend's)::

    manifest.json        {"format_version", "meta", "files": {name: sha256}}
    .metadata            DCP's index: global shapes and where every shard lives
    __<r>_0.distcp       rank r's shards of the model and optimizer state (DCP)
    scheduler.pt         LR scheduler state_dict               (rank 0)
    rng_rank<r>.pt       torch RNG states of rank r            (every rank)

Atomicity and hashes are ``workers.trainer.checkpoint``'s: everything is written into
a hidden staging sibling (DCP fsyncs its files), rank 0 hashes every file into the
manifest and renames the directory into place. The manifest's sha256 is what
``CheckpointSaved`` records.

A checkpoint loads at another world size or mesh: DCP reads each rank's current
shards (its "plan") out of whatever shards were saved, so a dp-2 checkpoint loads at
dp 1 and continues. The RNG states then do not match rank for rank, and each rank is
reseeded deterministically from (seed, rank, trainer_version), as the torch backend does.
The weights digest is over the full tensors, so it is the same whatever the world size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from workers.trainer import checkpoint as ckpt
from workers.trainer import distributed as dd
from workers.trainer.parallel import CheckpointParts, Restored

FORMAT = "fsdp2-dcp"


def _sharded_state(parts: CheckpointParts) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(parts.model, parts.optimizer)
    return {"model": model_sd, "optim": optim_sd}


class DcpCheckpoint:
    """The FSDP2 backend's ``CheckpointFormat``: every rank writes its own shards."""

    def __init__(self, mesh_shape: list[int]) -> None:
        self.mesh_shape = mesh_shape

    def save(
        self,
        final: Path,
        parts: CheckpointParts,
        rng: dict[str, Any],
        meta: Callable[[], dict[str, Any]],
    ) -> tuple[str, dict[str, str]]:
        """Collective over every rank; returns the same (sha256, files) on each."""
        if final.exists():
            raise ckpt.CheckpointError(f"checkpoint directory {final} already exists")
        if parts.rank == 0:
            ckpt.prepare_staging(final)
        dd.barrier()
        staging = ckpt.staging_dir(final)
        dcp.save(_sharded_state(parts), checkpoint_id=str(staging))
        ckpt.write_torch(staging, f"rng_rank{parts.rank}.pt", rng)
        if parts.rank == 0:
            ckpt.write_torch(staging, "scheduler.pt", parts.scheduler.state_dict())
        described = {**meta(), "format": FORMAT, "mesh": self.mesh_shape}  # meta(): a collective
        dd.barrier()
        outcome: tuple[str, Any] = ("ok", None)
        if parts.rank == 0:
            try:
                outcome = ("ok", ckpt.finalize(staging, final, described))
            except Exception as err:  # every rank must learn of it, not only rank 0
                outcome = ("error", f"{type(err).__name__}: {err}")
        status, payload = dd.all_gather_objects(outcome)[0]
        if status == "error":
            raise ckpt.CheckpointError(f"saving checkpoint {final} failed on rank 0: {payload}")
        return payload

    def load(
        self, final: Path, parts: CheckpointParts, accept: Callable[[Mapping[str, Any]], None]
    ) -> Restored:
        """Verify every file's sha256, then reshard the saved state into this mesh."""
        manifest, sha = ckpt.verify(final)
        meta = manifest["meta"]
        if meta.get("format") != FORMAT:
            raise ckpt.CheckpointError(
                f"checkpoint {final} was not written by the fsdp2 backend "
                f"(format {meta.get('format')!r})"
            )
        accept(meta)
        state = _sharded_state(parts)
        dcp.load(state, checkpoint_id=str(final))
        set_state_dict(
            parts.model, parts.optimizer,
            model_state_dict=state["model"], optim_state_dict=state["optim"],
        )
        parts.scheduler.load_state_dict(ckpt.read_torch(final, "scheduler.pt"))
        rng_name = f"rng_rank{parts.rank}.pt"
        same_world = meta["world_size"] == parts.world_size and rng_name in manifest["files"]
        rng = ckpt.read_torch(final, rng_name) if same_world else None
        return Restored(meta, sha, manifest["files"], rng)
