"""megatron-core's ``GPTModel`` behind the workers' model interface (``model(ids) -> logits``).

Used by the megatron trainer backend (``workers.trainer.megatron_backend``) and its
tests; megatron-core is imported only when a model is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class McoreGPTFactory:
    """Picklable factory for mcore's ``GPTModel`` (local layer spec, tied embeddings)."""

    vocab_size: int
    context_len: int = 64
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4

    def __call__(self) -> nn.Module:
        return McoreGPTLM(self)


class McoreGPTLM(nn.Module):
    """``GPTModel`` behind the workers' model interface: ``model(input_ids) -> logits``."""

    def __init__(self, cfg: McoreGPTFactory) -> None:
        super().__init__()
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        self.context_len = cfg.context_len
        self.config = TransformerConfig(
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=not torch.cuda.is_available(),
            params_dtype=torch.float32,
        )
        self.gpt = GPTModel(
            self.config,
            get_gpt_layer_local_spec(),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.context_len,
            position_embedding_type="learned_absolute",
            share_embeddings_and_output_weights=True,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        if t > self.context_len:
            raise ValueError(f"sequence of {t} tokens exceeds context_len {self.context_len}")
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        # mcore masks where True; passing it avoids its CUDA-only default causal mask
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).triu(1)
        return self.gpt(input_ids, positions, attention_mask=causal[None, None])
