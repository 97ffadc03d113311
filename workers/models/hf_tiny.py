"""Write a small, randomly initialised Hugging Face model directory (no downloads).

For tests, benchmarks and demos of the HF paths (``model.kind = "hf"``, the vLLM
generator): a Llama-style causal LM and a character-level tokenizer built locally with
``tokenizers`` over the built-in tasks' alphabet, both saved with ``save_pretrained``
so that ``AutoModelForCausalLM``, ``AutoTokenizer`` and vLLM load the directory as
they would a downloaded one.

The head size defaults to 32: vLLM's CPU attention kernels accept 32, 64, 80 ... 512,
not 16. Token ids: 0 is padding, 1 is end-of-sequence, then the alphabet in order
(the same ids as ``workers.models.tokenizer.CharTokenizer``).

    python -m workers.models.hf_tiny DIR [--layers 2] [--hidden 64] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from workers.models.tokenizer import DEFAULT_ALPHABET

PAD, EOS = "<pad>", "</s>"


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A ``PreTrainedTokenizerFast`` with one token per character of ``alphabet``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, **{c: i + 2 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=PAD
    )


def write_tiny_hf_model(
    path: str | os.PathLike[str],
    *,
    alphabet: str = DEFAULT_ALPHABET,
    hidden_size: int = 64,
    num_layers: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 128,
    context_len: int = 64,
    seed: int = 0,
) -> Path:
    """Write model + tokenizer to ``path`` (created); returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % head_dim:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of head_dim {head_dim}")
    tokenizer = build_char_tokenizer(alphabet)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=hidden_size // head_dim,
        head_dim=head_dim,
        max_position_embeddings=context_len,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # A larger init than HF's 0.02 so that samples from the random model vary.
        cfg.initializer_range = 0.1
        model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = write_tiny_hf_model(args.path, num_layers=args.layers, hidden_size=args.hidden, seed=args.seed)
    print(out)


if __name__ == "__main__":
    main()
