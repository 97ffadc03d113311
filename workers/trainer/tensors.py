"""Tensor helpers the torch-based trainer backends share: logits of any causal LM, the
weights digest the log records, and trimming a padded batch.
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
    ref, versions = batch.reference_logprobs, batch.token_versions
    return TrainBatch(
        input_ids=batch.input_ids[:, :t].to(device),
        attention_mask=batch.attention_mask[:, :t].to(device),
        loss_mask=batch.loss_mask[:, :t].to(device),
        generator_logprobs=batch.generator_logprobs[:, :t].to(device),
        advantages=batch.advantages.to(device),
        reference_logprobs=None if ref is None else ref[:, :t].to(device),
        token_versions=None if versions is None else versions[:, :t].to(device),
    )
