"""The pre-check of an HF model directory: what the workers would fail on, found first.

Real directories written by ``save_pretrained`` (a tiny random Llama with a character
tokenizer, and a Qwen2 whose tokenizer files are gone: the case where every group
failed with "cannot sample from an empty prompt"), each broken one way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from workers.models.hf_check import HFDirError, check_hf_dir  # noqa: E402

PROMPT = "abc>"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    from workers.models.hf_tiny import write_tiny_hf_model

    return write_tiny_hf_model(tmp_path_factory.mktemp("hf") / "good", context_len=48)


def _broken(good: Path, tmp_path: Path, break_it) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(good, copy)
    break_it(copy)
    return copy


def _no_tokenizer(d: Path) -> None:
    for f in d.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            f.unlink()


def test_a_good_directory_gives_its_tokenizer_and_context(good):
    found = check_hf_dir(good, PROMPT)
    assert found.context_len == 48 and len(found.tokenizer.encode(PROMPT)) == 4


def _truncate(d: Path) -> None:
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def _shard_index(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))


BROKEN = {
    "invalid config.json": (lambda d: (d / "config.json").write_text("{not json"),
                            "config.json cannot be loaded"),
    "no config.json": (lambda d: (d / "config.json").unlink(), "no config.json"),
    "not a causal LM": (lambda d: (d / "config.json").write_text('{"model_type": "vit"}'),
                        "not a causal language model"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "no weights"),
    "truncated weights": (_truncate, "model.safetensors is truncated"),
    "missing shard": (_shard_index, "model-00001-of-00002.safetensors"),
    "no tokenizer": (_no_tokenizer, "the tokenizer cannot be loaded"),
    "tokenizer of another model": (
        lambda d: (d / "config.json").write_text(
            json.dumps({**json.loads((d / "config.json").read_text()), "vocab_size": 3})),
        "outside the model's vocab_size 3"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_directory_is_one_sentence_naming_the_problem(good, tmp_path, case):
    break_it, says = BROKEN[case]
    with pytest.raises(HFDirError) as err:
        check_hf_dir(_broken(good, tmp_path, break_it), PROMPT)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_tokenizer_that_encodes_prompts_to_nothing_is_refused(tmp_path):
    """transformers builds an empty Qwen2 tokenizer when the files are missing."""
    from tests.hf_fixture import save_tiny_hf_lm

    model = save_tiny_hf_lm(tmp_path / "qwen2", "qwen2")
    _no_tokenizer(model)
    with pytest.raises(HFDirError, match="encodes the prompt 'abc>' to no tokens") as err:
        check_hf_dir(model, PROMPT)
    assert "has none of tokenizer.json" in str(err.value)
