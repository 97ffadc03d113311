"""Build a model and its tokenizer from the ``[model]`` table.

``kind="tiny"``: the built-in transformer with the char tokenizer, initialised from
the run's ``seed`` without touching the global RNG. ``kind="hf"``: an HF causal LM and
tokenizer from the local directory ``path``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from workers.models.config import ModelSection
from workers.models.tiny import TinyCausalLM, TinyConfig
from workers.models.tokenizer import DEFAULT_ALPHABET, CharTokenizer


class Tokenizer(Protocol):
    """What the generator needs from a tokenizer (CharTokenizer, HFTokenizer)."""

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def build_model(cfg: ModelSection, seed: int = 0) -> tuple[nn.Module, Tokenizer]:
    """The model (in eval mode) and its tokenizer; ``seed`` (the run's) initialises the
    tiny model's weights."""
    if cfg.kind == "hf":
        from workers.models.hf import load_hf

        return load_hf(cfg.path)
    tokenizer = CharTokenizer(cfg.alphabet or DEFAULT_ALPHABET)
    shape = TinyConfig(
        vocab_size=tokenizer.vocab_size,
        context_len=cfg.context_len,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyCausalLM(shape)
    return model.eval(), tokenizer


def context_len(model: nn.Module) -> int:
    """Longest sequence ``model`` accepts."""
    if isinstance(model, TinyCausalLM):
        return model.config.context_len
    return int(model.context_len)  # HFCausalLM
