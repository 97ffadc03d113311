"""A small randomly initialised HF Llama / Qwen2 model with a tokenizer, saved locally.

No download: the tokenizer is a character-level BPE without merges built in memory,
the model is built from a config with a seed. Tied input/output embeddings by default
(the case sharding must preserve).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

CHARS = "abcdefghijklmnopqrstuvwxyz>0123456789+="


def save_tiny_hf_lm(
    directory: str | Path,
    arch: Literal["llama", "qwen2"] = "llama",
    *,
    tie: bool = True,
    seed: int = 0,
) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    directory = Path(directory)
    vocab = {"<pad>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # one token per character
    backend.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(directory)
    shape = dict(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    model.save_pretrained(directory)
    return directory
