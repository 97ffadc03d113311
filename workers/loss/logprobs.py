"""Per-token logprobs and entropy from a causal LM's logits, aligned like ``workers.batch``.

Logits at t - 1 predict token t, so position 0 gets 0. Computed in at least float32
whatever the model's dtype (bf16/fp16 are upcast, fp64 is kept), at the generators'
sampling temperature (logits / tau).
"""

from __future__ import annotations

import torch

#: log-ratios are clamped here before ``exp`` (see the ``workers.loss`` docstring)
LOG_RATIO_MAX = 20.0


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = logits[:, :-1]
    scaled = scaled.to(torch.promote_types(scaled.dtype, torch.float32))
    return scaled / temperature if temperature != 1.0 else scaled


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """[B, T] log p(input_ids[t] | input_ids[<t]) at ``temperature``; position 0 is 0."""
    lp, _ = token_logprobs_and_entropy(logits, input_ids, temperature, entropy=False)
    return lp


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([B, T] logprobs, [B, T] entropy H_t = -sum_v p log p of the predicting
    distribution, or None). The entropy is detached unless ``entropy_grad`` (a bonus)."""
    scaled = _scaled(logits, temperature)
    target = input_ids[:, 1:].unsqueeze(-1)
    norm = torch.logsumexp(scaled, dim=-1)
    lp = scaled.gather(-1, target).squeeze(-1) - norm
    lp = torch.nn.functional.pad(lp, (1, 0))
    if not entropy:
        return lp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        src, lse = (scaled, norm) if entropy_grad else (scaled.detach(), norm.detach())
        # H = logsumexp(z) - sum_v softmax(z)_v z_v: one softmax, no [B, T, V] log-softmax
        ent = lse - (torch.softmax(src, dim=-1) * src).sum(dim=-1)
    return lp, torch.nn.functional.pad(ent, (1, 0))


def valid_counts(loss_mask: torch.Tensor) -> tuple[int, int]:
    """(valid sequences, valid tokens): a sequence is valid if it has a loss-bearing token."""
    return int(loss_mask.any(dim=1).sum()), int(loss_mask.sum())
