"""What the workers will load from an HF model directory, checked without loading weights.

``rl-controller run`` calls :func:`check_hf_dir` before anything is written or started,
so a directory the trainer or a generator could not use costs one line instead of a
run that starts Ray, writes its first events and then fails (or, with a tokenizer
that encodes every prompt to nothing, fails every group). Checked, in the order the
workers load them:

* ``config.json`` parses and names a causal-LM architecture this ``transformers`` has;
* a weights file is there: ``model.safetensors`` (its header read and its tensors
  within the file) or ``pytorch_model.bin``, or a sharded index whose shards all exist;
* the tokenizer loads (``AutoTokenizer``, as ``workers.models.hf.load_hf`` does),
  defines an end-of-sequence token, and encodes a prompt of the run to at least one
  token, every id inside the model's vocabulary.

Every failure is an :class:`HFDirError` whose message names the directory's problem.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class HFDirError(ValueError):
    """An HF model directory the workers could not use; the message says why."""


@dataclass(frozen=True)
class HFDir:
    """What the run's pre-check goes on with: the tokenizer and the model's context."""

    tokenizer: Any  # workers.models.hf_tokenizer.HFTokenizer
    context_len: int


def config_context_len(config: Any) -> int:
    """The longest sequence an HF model config allows."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ValueError("the HF model config names no maximum context length")


def check_hf_dir(path: str | os.PathLike[str], probe_prompt: str) -> HFDir:
    """Raise :class:`HFDirError` unless the workers can load ``path`` and encode prompts."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise HFDirError(f"{str(path)!r} is not a directory")
    config = _check_config(root)
    _check_weights(root)
    tokenizer = _check_tokenizer(root, config, probe_prompt)
    try:
        context_len = config_context_len(config)
    except ValueError as err:
        raise HFDirError(f"config.json: {err}") from None
    return HFDir(tokenizer=tokenizer, context_len=context_len)


def _check_config(root: Path) -> Any:
    if not (root / "config.json").is_file():
        raise HFDirError("no config.json (expected a directory written by save_pretrained)")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(root, local_files_only=True)
    except Exception as err:  # invalid JSON, an unknown model_type, a missing key...
        raise HFDirError(f"config.json cannot be loaded: {_first_line(err)}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise HFDirError(
            f"config.json: model_type {config.model_type!r} is not a causal language model "
            "this transformers can build"
        )
    return config


def _check_weights(root: Path) -> None:
    for name in INDEX_FILES:
        if (root / name).is_file():
            return _check_shards(root, name)
    for name in WEIGHT_FILES:
        if (root / name).is_file():
            if name.endswith(".safetensors"):
                _check_safetensors(root / name)
            return None
    raise HFDirError(f"no weights: none of {', '.join(WEIGHT_FILES + INDEX_FILES)}")


def _check_shards(root: Path, index: str) -> None:
    try:
        shards = set(json.loads((root / index).read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise HFDirError(f"{index} cannot be read: {_first_line(err)}") from None
    missing = sorted(s for s in shards if not (root / s).is_file())
    if missing:
        raise HFDirError(f"{index} names weight files that are not there: {', '.join(missing)}")


def _check_safetensors(file: Path) -> None:
    """The header parses and every tensor lies inside the file (not truncated)."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
                  default=0)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
        raise HFDirError(f"{file.name} is not a safetensors file: {_first_line(err)}") from None
    if 8 + n + end > size:
        raise HFDirError(f"{file.name} is truncated: its tensors need {8 + n + end} bytes, "
                         f"the file has {size}")


def _check_tokenizer(root: Path, config: Any, probe_prompt: str) -> Any:
    from workers.models.hf_tokenizer import load_hf_tokenizer

    files = [name for name in TOKENIZER_FILES if (root / name).is_file()]
    hint = "" if files else f" (the directory has none of {', '.join(TOKENIZER_FILES)})"
    try:
        tokenizer = load_hf_tokenizer(root)
        ids = tokenizer.encode(probe_prompt)
    except Exception as err:
        raise HFDirError(f"the tokenizer cannot be loaded: {_first_line(err)}{hint}") from None
    if not ids:
        raise HFDirError(f"the tokenizer encodes the prompt {probe_prompt!r} to no tokens{hint}")
    vocab = config.to_dict().get("vocab_size")  # a nested (multimodal) config has none here
    if vocab is not None and max(ids) >= vocab:
        raise HFDirError(
            f"the tokenizer gives token id {max(ids)} for {probe_prompt!r}, outside the "
            f"model's vocab_size {vocab}: tokenizer and weights do not belong together"
        )
    return tokenizer


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
