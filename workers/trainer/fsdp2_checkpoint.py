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

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from workers.trainer import checkpoint as ckpt
from workers.trainer import distributed as dd
from workers.trainer.api import CheckpointInfo

if TYPE_CHECKING:
    from workers.trainer.fsdp2_backend import Fsdp2Trainer

FORMAT = "fsdp2-dcp"


def _sharded_state(t: "Fsdp2Trainer") -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(t._model, t._optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save(t: "Fsdp2Trainer", final: Path) -> CheckpointInfo:
    """Collective over every rank; returns the same info on each."""
    if final.exists():
        raise ckpt.CheckpointError(f"checkpoint directory {final} already exists")
    if t.rank == 0:
        ckpt.prepare_staging(final)
    dd.barrier()
    staging = ckpt.staging_dir(final)
    dcp.save(_sharded_state(t), checkpoint_id=str(staging))
    ckpt.write_torch(staging, f"rng_rank{t.rank}.pt", t._rng_state())
    if t.rank == 0:
        ckpt.write_torch(staging, "scheduler.pt", t._scheduler.state_dict())
    digest = t.weights_digest()  # a collective: every rank computes it
    dd.barrier()
    outcome: tuple[str, Any] = ("ok", None)
    if t.rank == 0:
        meta = {
            "format": FORMAT,
            "trainer_version": t._version,
            "step": t._last_step,
            "world_size": t.world_size,
            "mesh": list(t.mesh.shape),
            "weights_digest": digest,
            "reference_digest": t._reference_digest,
        }
        try:
            outcome = ("ok", ckpt.finalize(staging, final, meta))
        except Exception as err:  # every rank must learn of it, not only rank 0
            outcome = ("error", f"{type(err).__name__}: {err}")
    status, payload = dd.all_gather_objects(outcome)[0]
    if status == "error":
        raise ckpt.CheckpointError(f"saving checkpoint {final} failed on rank 0: {payload}")
    sha, files = payload
    return CheckpointInfo(str(final), t._version, t._last_step, sha, files)


def load(t: "Fsdp2Trainer", final: Path) -> CheckpointInfo:
    """Verify every file's sha256, then reshard the saved state into this mesh."""
    manifest, sha = ckpt.verify(final)
    meta = manifest["meta"]
    if meta.get("format") != FORMAT:
        raise ckpt.CheckpointError(
            f"checkpoint {final} was not written by the fsdp2 backend "
            f"(format {meta.get('format')!r})"
        )
    if t._reference_digest is not None and meta.get("reference_digest") not in (
        None,
        t._reference_digest,
    ):
        raise ckpt.CheckpointError(
            f"checkpoint {final} was trained against a different reference model"
        )
    state = _sharded_state(t)
    dcp.load(state, checkpoint_id=str(final))
    set_state_dict(
        t._model, t._optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    t._scheduler.load_state_dict(ckpt.read_torch(final, "scheduler.pt"))
    rng_name = f"rng_rank{t.rank}.pt"
    if meta["world_size"] == t.world_size and rng_name in manifest["files"]:
        t._set_rng_state(ckpt.read_torch(final, rng_name))
    else:  # a different world size: reseed deterministically
        torch.manual_seed(t.config.seed + 1 + t.rank + 7919 * meta["trainer_version"])
    t._version = int(meta["trainer_version"])
    t._last_step = meta["step"]
    if t.weights_digest() != meta["weights_digest"]:
        raise ckpt.CheckpointCorruptError(
            f"checkpoint {final}: weights digest after loading differs from the manifest"
        )
    return CheckpointInfo(str(final), t._version, t._last_step, sha, manifest["files"])
