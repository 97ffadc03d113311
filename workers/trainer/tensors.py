"""Tensor helpers the trainer shares: logits of any causal LM, the weights digest the
log records, trimming a padded batch, the zero-weight dummy batch, the device.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from workers.batch import TrainBatch


def model_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of any causal LM whose output is a tensor or has ``.logits``."""
    out = model(input_ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def digest_parameters(module: nn.Module) -> str:
    """sha256 over parameters in sorted-name order, including name, dtype and shape."""
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _trim(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """Drop all-padding trailing columns (right padding) and move to ``device``."""
    cols = batch.attention_mask.any(dim=0).nonzero()
    t = int(cols.max()) + 1 if len(cols) else 1
    return batch.trimmed(t).to(device)


def resolve_device(name: str | None) -> torch.device:
    """``TrainerRuntime.device``: None = the current CUDA device if any, else the CPU."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def dummy_batch(device: torch.device) -> TrainBatch:
    """One row, two tokens, empty loss mask: loss 0 and a gradient of exactly 0."""
    return TrainBatch(
        input_ids=torch.zeros(1, 2, dtype=torch.int64, device=device),
        attention_mask=torch.ones(1, 2, dtype=torch.bool, device=device),
        loss_mask=torch.zeros(1, 2, dtype=torch.bool, device=device),
        generator_logprobs=torch.zeros(1, 2, device=device),
        advantages=torch.zeros(1, device=device),
    )
