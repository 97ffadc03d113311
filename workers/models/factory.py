"""Build a model and its tokenizer from a small typed config.

``kind="tiny"``: the built-in transformer with the char tokenizer, initialised from
``init_seed`` without touching the global RNG. ``kind="hf"``: an HF causal LM and
tokenizer from the local directory ``path``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn

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


@dataclass(frozen=True)
class ModelConfig:
    """Which model the trainer and generators build (they must build the same one)."""

    kind: Literal["tiny", "hf"] = "tiny"
    #: tiny: longest prompt + completion, in tokens
    context_len: int = 64
    #: tiny: width, depth and attention heads
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    #: tiny: characters the tokenizer knows
    alphabet: str = DEFAULT_ALPHABET
    #: tiny: seed of the random initialisation
    init_seed: int = 0
    #: hf: local directory written by ``save_pretrained`` (model and tokenizer)
    path: str | None = None
    #: hf: parameter dtype
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    def __post_init__(self) -> None:
        if self.kind not in ("tiny", "hf"):
            raise ValueError(f"ModelConfig.kind must be 'tiny' or 'hf', got {self.kind!r}")
        if self.kind == "hf" and not self.path:
            raise ValueError("ModelConfig.path is required when kind='hf'")


def build_model(cfg: ModelConfig) -> tuple[nn.Module, Tokenizer]:
    """The model (in eval mode) and its tokenizer."""
    if cfg.kind == "hf":
        from workers.models.hf import load_hf

        assert cfg.path is not None
        return load_hf(cfg.path, cfg.dtype)
    tokenizer = CharTokenizer(cfg.alphabet)
    shape = TinyConfig(
        vocab_size=tokenizer.vocab_size,
        context_len=cfg.context_len,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        model = TinyCausalLM(shape)
    return model.eval(), tokenizer


def context_len(model: nn.Module) -> int:
    """Longest sequence ``model`` accepts."""
    if isinstance(model, TinyCausalLM):
        return model.config.context_len
    return int(model.context_len)  # HFCausalLM
