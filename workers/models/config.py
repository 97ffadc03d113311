"""``[model]`` and ``[sampling]``: which model every worker builds and how generators
draw completions from it.

The controller's ``Config`` composes these Structs and hands them, unchanged, to the
workers (``workers.service.WorkerSpec``), and the components take them as they are:
``workers.models.factory.build_model(model, seed)`` (the run's seed is the one value
it adds) and ``workers.models.sampling`` draw with ``SamplingSection``. No torch
import, so loading a config stays cheap.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import msgspec

from events.config_checks import one_of, positive, require

ModelKind = Literal["tiny", "hf"]

#: what a refit landing between two token steps does with the KV cache
#: (``workers.models.decoder``)
KvOnRefit = Literal["recompute", "keep"]
KV_ON_REFIT: tuple[KvOnRefit, ...] = ("recompute", "keep")


class ModelSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[model]``: the policy the trainer and every generator build alike."""

    kind: ModelKind = "tiny"
    """Built-in tiny transformer, or a Hugging Face model from a local directory."""
    path: str = ""
    """Local directory of an HF model (kind = "hf"); never downloaded."""
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    context_len: int = 32
    """Longest prompt + completion in tokens (tiny model)."""
    alphabet: str = ""
    """Characters the tiny model's tokenizer knows; "" = digits, a few operators and
    lowercase letters (wider prompts, e.g. reasoning-gym's, need a wider alphabet)."""

    def __post_init__(self) -> None:
        one_of("model.kind", self.kind, get_args(ModelKind))
        positive("model", self, "d_model", "n_layers", "n_heads", "context_len")
        if self.kind == "hf" and not self.path:
            raise ValueError('model.path is required when model.kind = "hf"')


class SamplingSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[sampling]``: how generators draw completions (the loss uses the temperature too)."""

    temperature: float = 1.0
    top_p: float = 1.0
    """Nucleus sampling; 1.0 = the whole vocabulary."""
    max_new_tokens: int = 6

    def __post_init__(self) -> None:
        ok = self.temperature > 0 and math.isfinite(self.temperature)
        require(ok, "sampling.temperature", "> 0 and finite", self.temperature)
        require(0 < self.top_p <= 1, "sampling.top_p", "in (0, 1]", self.top_p)
        positive("sampling", self, "max_new_tokens")
