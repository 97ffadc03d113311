"""An HF tokenizer behind the char tokenizer's interface, loaded from a local directory.

No torch import here: the run's pre-check (``workers.models.hf_check``) loads the
tokenizer the workers will use without building a model.
"""

from __future__ import annotations

import os
from typing import Any


class HFTokenizer:
    """An HF tokenizer with ``encode``/``decode``/``eos_id``/``pad_id``/``vocab_size``."""

    def __init__(self, tokenizer: Any) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the HF tokenizer defines no eos_token; sampling needs one")
        self.tokenizer = tokenizer

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self.eos_id if pad is None else int(pad)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Decode up to the first EOS."""
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_hf_tokenizer(path: str | os.PathLike[str]) -> HFTokenizer:
    """The tokenizer alone (the vLLM generator loads the model in its engine)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"HF model directory {str(path)!r} does not exist")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
