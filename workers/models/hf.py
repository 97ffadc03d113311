"""Hugging Face causal LMs from a local directory, behind the workers' model interface.

``HFCausalLM`` wraps an ``AutoModelForCausalLM`` so it looks like the tiny model:
``model(input_ids) -> logits`` ([B, T] int64 -> [B, T, vocab]) and
``model(input_ids, past=cache, return_cache=True) -> (logits, cache)`` for cached
sampling (the cache is HF's ``past_key_values``, opaque to callers). ``HFTokenizer``
(``workers.models.hf_tokenizer``, torch-free) gives an HF tokenizer the char tokenizer's
interface.

Loading never touches the network: ``HF_HUB_OFFLINE=1`` is set and
``local_files_only=True`` is passed, so a missing file is an error, not a download.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from workers.models.hf_check import config_context_len
from workers.models.hf_tokenizer import HFTokenizer, load_hf_tokenizer

__all__ = ["HFCausalLM", "HFTokenizer", "load_hf", "load_hf_tokenizer"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFCausalLM(nn.Module):
    """An HF causal LM with the ``model(input_ids, past=, return_cache=)`` interface."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    @property
    def context_len(self) -> int:
        return config_context_len(self.model.config)

    def forward(
        self,
        input_ids: torch.Tensor,
        past: Any = None,
        return_cache: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        start = 0 if past is None else past.get_seq_length()
        if start + input_ids.shape[1] > self.context_len:
            raise ValueError(
                f"sequence of {start + input_ids.shape[1]} tokens exceeds context_len "
                f"{self.context_len}"
            )
        out = self.model(
            input_ids=input_ids, past_key_values=past, use_cache=return_cache or past is not None
        )
        return (out.logits, out.past_key_values) if return_cache else out.logits


def load_hf(path: str | os.PathLike[str], dtype: str = "float32") -> tuple[HFCausalLM, HFTokenizer]:
    """Load model and tokenizer from a local directory (``save_pretrained`` layout)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"HF model directory {str(path)!r} does not exist")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Cast after loading: the dtype keyword changed name across transformers versions.
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(_DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.eval()
    return HFCausalLM(model), HFTokenizer(tokenizer)
