"""Building a sharded model for the FSDP2 trainer: mesh, meta init, broadcast, gathers.

::

    world = dp x tp ranks          mesh ("dp", "tp"), row-major: rank = dp_index * tp + tp_index
    rank 0:   factory() on CPU --------------------------+ full state dict (then dropped)
    all:      factory() on the meta device (no memory)   |
              [tp plan per block] -> fully_shard(block) for each transformer block
              -> fully_shard(root) -> to_empty -> set_model_state_dict(broadcast_from_rank0)
              -> buffers broadcast from rank 0 (non-persistent ones, e.g. rotary
                 inv_freq, are not in the state dict and would be garbage after to_empty)

Reads of full tensors are collectives: ``full_tensor()`` of a sharded parameter is an
all-gather, so :func:`digest_full` and :func:`gather_full` must run on every rank in the
same order. Both gather one parameter at a time (never the whole model twice on a rank).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from workers.trainer.config import BuiltModelFactory, ModelFactory


def ensure_process_group() -> None:
    """A world-size-1 gloo group when none exists (FSDP2 and DCP need one)."""
    if dist.is_initialized():
        return
    from workers.trainer.distributed import find_free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1
    )


def make_mesh(device_type: str, tensor_parallel: int) -> DeviceMesh:
    """A ("dp", "tp") mesh over the default group; dp = world // tp."""
    world = dist.get_world_size()
    if tensor_parallel < 1 or world % tensor_parallel:
        raise ValueError(
            f"train.tensor_parallel = {tensor_parallel} does not divide the world size {world}"
        )
    return init_device_mesh(
        device_type, (world // tensor_parallel, tensor_parallel), mesh_dim_names=("dp", "tp")
    )


def build_on_meta(factory: ModelFactory) -> nn.Module:
    """The factory's module with every parameter and buffer on the meta device.

    A local HF model is built from its config (``from_pretrained`` would read the
    weights, which only rank 0 needs).
    """
    if isinstance(factory, BuiltModelFactory) and factory.model.kind == "hf":
        from transformers import AutoConfig, AutoModelForCausalLM

        from workers.models.hf import _DTYPES, HFCausalLM

        hf_cfg = AutoConfig.from_pretrained(factory.model.path, local_files_only=True)
        with torch.device("meta"):
            # the dtype build_model's load_hf gives the real model (its default)
            inner = AutoModelForCausalLM.from_config(hf_cfg).to(_DTYPES["float32"])
        return HFCausalLM(inner).eval()
    with torch.device("meta"):
        return factory()


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: children of the ModuleList holding the most parameters."""
    best: nn.ModuleList | None = None
    best_n = 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            n = sum(p.numel() for p in module.parameters())
            if n > best_n:
                best, best_n = module, n
    return [] if best is None else list(best)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """Every module ``fully_shard`` wrapped in ``model`` (the root first)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def shard_model(
    model: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool = True
) -> nn.Module:
    """Tensor-parallel plan (tp > 1), then ``fully_shard`` per block and at the root."""
    from torch.distributed.fsdp import fully_shard

    # The tiny model's blocks return their attention keys/values as views (for the
    # sampler's cache); FSDP warns on every forward that an in-place op on a view would
    # skip its hook. Nothing writes to them in place (they only feed torch.cat), so the
    # warning is noise in the user's terminal.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    if mesh["tp"].size() > 1:
        from workers.trainer.fsdp2_tp import apply_tensor_parallel

        apply_tensor_parallel(transformer_blocks(model), mesh["tp"])
    dp_mesh = mesh["dp"]
    for block in transformer_blocks(model):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return model


def materialise_from_rank0(
    model: nn.Module,
    full_state: dict[str, torch.Tensor] | None,
    full_buffers: dict[str, torch.Tensor] | None,
    device: torch.device,
) -> None:
    """Allocate the (sharded) storage and fill it from rank 0's full state and buffers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # a copy: set_model_state_dict replaces the entries of the dict it is given
    source = dict(full_state or {}) if dist.get_rank() == 0 else {}
    set_model_state_dict(model, source, options=options)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            local = buf.to_local() if isinstance(buf, DTensor) else buf
            if dist.get_rank() == 0 and full_buffers is not None:
                local.copy_(full_buffers[name])
            dist.broadcast(local, src=0)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank (an all-gather for a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def iter_full_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full detached CPU tensor), sorted by name, gathered one at a time."""
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        yield name, full_tensor(p.detach()).to("cpu")


def digest_full(model: nn.Module) -> str:
    """sha256 over full parameters; the same bytes as ``torch_backend.digest_parameters``."""
    h = hashlib.sha256()
    for name, t in iter_full_parameters(model):
        t = t.contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def gather_full(model: nn.Module, *, keep: bool) -> dict[str, torch.Tensor]:
    """The state dict's tensors as full CPU copies, one all-gather at a time.

    Every rank must call it (the gathers are collectives); ranks with ``keep=False``
    drop each tensor as soon as it is gathered and return an empty dict.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor):
            continue
        full = full_tensor(t.detach())
        if keep:
            out[name] = full.to("cpu", copy=True)
    return out


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over the full tensors, from the local shards.

    Grouped by device mesh (with tp, block parameters live on the 2-D mesh, the rest on
    "dp"): each group's norm is a partial DTensor, reduced by ``full_tensor``.
    """
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        key = t.device_mesh if isinstance(t, DTensor) else None
        groups.setdefault(key, []).append(t)
    norms = [
        full_tensor(torch.nn.utils.get_total_norm(ts, 2.0, foreach=True))
        for _, ts in sorted(groups.items(), key=lambda kv: str(kv[0]))
    ]
    return torch.linalg.vector_norm(torch.stack(norms))


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds for ``tensors`` (local shards of DTensors)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total
