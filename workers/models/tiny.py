"""A small causal transformer in plain torch, fast enough to train with RL on 2 CPU cores.

Pre-norm GPT blocks (LayerNorm -> causal self-attention -> LayerNorm -> MLP), learned
positional embeddings, tied input/output embeddings. ``forward`` accepts an optional
KV cache so sampling costs O(T) per new token instead of O(T^2).

Interface shared by every model the workers use (the tiny one and HF models wrapped by
``workers.models.hf``): ``model(input_ids) -> logits`` with ``input_ids`` ``[B, T]``
int64 and logits ``[B, T, vocab]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

#: Per-layer (key, value) tensors, each [B, heads, T_cached, head_dim].
KVCache = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class TinyConfig:
    """Shape of the tiny transformer."""

    vocab_size: int
    #: longest sequence (prompt + completion) the model accepts, in tokens
    context_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    #: MLP hidden width as a multiple of d_model
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )


class _Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(
        self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        # With a cache, the t new queries sit at the end of the key sequence; the
        # causal mask must be offset accordingly (is_causal assumes square).
        if past is None:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif t == 1:
            att = F.scaled_dot_product_attention(q, k, v)
        else:
            total = k.shape[2]
            mask = torch.ones(t, total, dtype=torch.bool, device=x.device).tril(total - t)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        x = x + self.mlp(self.ln2(x))
        return x, (k, v)


class TinyCausalLM(nn.Module):
    """The built-in tiny causal LM."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,
        past: KVCache | None = None,
        return_cache: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, KVCache]:
        b, t = input_ids.shape
        start = 0 if past is None else past[0][0].shape[2]
        if start + t > self.config.context_len:
            raise ValueError(
                f"sequence of {start + t} tokens exceeds context_len {self.config.context_len}"
            )
        positions = torch.arange(start, start + t, device=input_ids.device)
        x = self.tok(input_ids) + self.pos(positions)
        cache: KVCache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if past is None else past[i])
            cache.append(kv)
        logits = self.ln_f(x) @ self.tok.weight.T
        return (logits, cache) if return_cache else logits
