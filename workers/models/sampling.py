"""Sampling primitives: the config, one token draw, completions, reference logprobs.

The decoding loop is ``workers.models.decoder`` (``Decoder``, ``sample``). Its algorithm
(one call samples ``n`` completions of one prompt, batched):

1. Repeat the prompt ``n`` times and run it through the model once (prefill), keeping
   the KV cache. Without a cache every step re-runs the whole prefix (slow, for tests
   and benchmarks only).
2. Each step scales the last position's logits by ``1 / temperature``, optionally
   restricts the draw to the nucleus (``top_p``), draws one token per row from a
   caller-owned :class:`torch.Generator` (never the global RNG, so a call is
   deterministic given the weights and the seed), and records the token's log
   probability under the *temperature-scaled, untruncated* distribution -- the same
   quantity the trainer recomputes with a full forward pass (see ``workers.batch``).
3. A row that emits EOS is finished: EOS is part of its completion, later draws for it
   are ignored. Sampling stops when every row has finished or after
   ``max_new_tokens``.

Between two token steps the caller may apply a weight update that arrived mid-group;
every token records the version that sampled it.

Models implement ``model(input_ids, past=cache, return_cache=True) -> (logits, cache)``
with an opaque cache object; ``model(input_ids) -> logits`` without one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from workers.models.config import SamplingSection


@dataclass(frozen=True)
class Completion:
    """One sampled completion."""

    #: sampled token ids, including the EOS when the model emitted one
    tokens: list[int]
    #: [len(tokens)] float32, log p(token | prefix) under the temperature-scaled model
    logprobs: torch.Tensor
    #: True when the completion ended with EOS (False: truncated at max_new_tokens)
    stopped: bool
    #: [len(tokens)] int64, the weight version that sampled each token (None: not
    #: recorded, e.g. by an older writer; then every token counts as the group's start)
    versions: torch.Tensor | None = None


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero out tokens outside the top-p nucleus (keeps at least the most likely)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)


def draw(
    logits: torch.Tensor, cfg: SamplingSection, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from ``logits`` [B, V]; returns (tokens [B], logprobs [B])."""
    logp = F.log_softmax(logits.float() / cfg.temperature, dim=-1)
    probs = logp.exp()
    if cfg.top_p < 1.0:
        probs = _nucleus(probs, cfg.top_p)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def sequence_logprobs(
    model: nn.Module, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Per-token logprobs of ``input_ids`` [T] under one full forward pass.

    Returns [T] float32 with position 0 set to 0 (nothing predicts the first token);
    the reference the generator's cached logprobs are checked against.
    """
    with torch.no_grad():
        logits = model(input_ids[None, :])[0].float() / temperature
    logp = F.log_softmax(logits[:-1], dim=-1).gather(-1, input_ids[1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), logp.cpu()])
