"""Generator: rows in the workers.batch convention, rewards, determinism, version tags."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.batch import ROW_FIELDS, collate
from workers.dataplane import MemoryDataPlane
from workers.generator import Generator
from workers.models.config import ModelSection, SamplingSection
from workers.models.factory import build_model
from workers.models.sampling import sequence_logprobs
from workers.models.tokenizer import EOS_ID, CharTokenizer
from workers.tasks import Example, PromptTooLongError, make_task
from workers.weight_sync import StaleWeightsError, cpu_state_dict

CFG = ModelSection(context_len=32, d_model=32, n_heads=2)
SEED = 3


class ScriptedLM(nn.Module):
    """Emits ``script`` after the prompt, whatever the prompt (for known completions)."""

    def __init__(self, script: list[int], prompt_len: int, vocab: int) -> None:
        super().__init__()
        self.script, self.prompt_len, self.vocab = script, prompt_len, vocab
        self.dummy = nn.Parameter(torch.zeros(()))
        self.context_len = 64

    def forward(self, input_ids, past=None, return_cache=False):
        b, t = input_ids.shape
        start = 0 if past is None else past
        logits = torch.zeros(b, t, self.vocab)
        for i in range(t):
            j = start + i + 1 - self.prompt_len  # index of the token position i predicts
            if 0 <= j < len(self.script):
                logits[:, i, self.script[j]] = 50.0
        return (logits, start + t) if return_cache else logits


def make_generator(model=None, task="reverse", **kw):
    tok = CharTokenizer()
    if model is None:
        model, tok = build_model(CFG, SEED)
    plane = MemoryDataPlane()
    return Generator(model, tok, make_task(task), plane, "run-1", **kw), plane


@pytest.mark.parametrize(
    "completion, eos, want", [("cba", True, 1.0), ("cbd", True, 0.8 * 2 / 3 + 0.2), ("cbaa", False, 0.6)]
)
def test_rewards_for_known_completions(completion, eos, want):
    tok = CharTokenizer()
    script = tok.encode(completion) + ([EOS_ID] if eos else [])
    model = ScriptedLM(script, prompt_len=4, vocab=tok.vocab_size)
    gen, plane = make_generator(model)
    sampling = SamplingSection(max_new_tokens=len(completion) + (1 if eos else 0))
    result = gen.generate_group("g1", Example("abc>", "cba"), 3, sampling, seed=0)
    assert result.rewards == pytest.approx([want] * 3)
    rows = plane.get("run-1", result.keys)
    assert [tok.decode(r["input_ids"].tolist()[4:]) for r in rows] == [completion] * 3
    assert [r["reward"].item() for r in rows] == pytest.approx([want] * 3)


def test_rows_match_row_fields_and_alignment_convention():
    gen, plane = make_generator()
    sampling = SamplingSection(temperature=0.8, max_new_tokens=10)
    ex = Example("abd>", "dba")
    result = gen.generate_group("g7", ex, 8, sampling, seed=11, attempt=2)
    assert result.keys == [f"run-1/g7/a2/s{i}" for i in range(8)]
    assert (result.group_id, result.attempt, result.partition) == ("g7", 2, "run-1")
    rows = plane.get("run-1", result.keys)
    for row, reward, clen in zip(rows, result.rewards, result.completion_lens):
        assert {k: v.dtype for k, v in row.items()} == ROW_FIELDS
        p, c = int(row["prompt_len"]), int(row["completion_len"])
        assert (p, c) == (4, clen) and row["input_ids"].shape == (p + c,)
        assert row["input_ids"][:p].tolist() == gen.tokenizer.encode(ex.prompt)
        assert not row["loss_mask"][:p].any() and row["loss_mask"][p:].all()
        assert (row["generator_logprobs"][:p] == 0).all()
        ref = sequence_logprobs(gen.model, row["input_ids"], sampling.temperature)
        torch.testing.assert_close(row["generator_logprobs"][p:], ref[p:], atol=1e-5, rtol=0)
        completion = row["input_ids"][p:].tolist()
        stopped = completion[-1] == EOS_ID
        assert stopped or c == sampling.max_new_tokens
        want = gen.task.reward(ex, gen.tokenizer.decode(completion), stopped)
        assert reward == pytest.approx(want) and row["reward"].item() == pytest.approx(want)
    collate(rows, [0.0] * len(rows))  # rows are what the trainer's collate expects
    assert plane.tags("run-1")["run-1/g7/a2/s3"]["group"] == "g7"


def test_same_weights_and_seed_give_identical_rows():
    gen_a, plane_a = make_generator()
    gen_b, plane_b = make_generator()
    sampling = SamplingSection(max_new_tokens=8)
    ex = Example("cab>", "bac")
    ra = gen_a.generate_group("g", ex, 6, sampling, seed=42)
    rb = gen_b.generate_group("g", ex, 6, sampling, seed=42)
    assert ra == rb
    for x, y in zip(plane_a.get("run-1", ra.keys), plane_b.get("run-1", rb.keys)):
        assert all(torch.equal(x[k], y[k]) for k in ROW_FIELDS)
    rc = gen_a.generate_group("h", ex, 6, sampling, seed=43)
    rows_a = [r["input_ids"].tolist() for r in plane_a.get("run-1", ra.keys)]
    rows_c = [r["input_ids"].tolist() for r in plane_a.get("run-1", rc.keys)]
    assert rows_a != rows_c


def test_update_landing_mid_group_is_recorded():
    other, _ = build_model(CFG, 99)
    updates: dict = {}

    def hook(step: int) -> None:
        if step in updates:
            gen.update_weights(5, updates.pop(step))

    gen, plane = make_generator(on_step=hook)
    sampling = SamplingSection(max_new_tokens=12)
    before = gen.generate_group("g0", Example("abc>", "cba"), 16, sampling, seed=0)
    assert (before.weight_version_start, before.weight_version_end) == (0, 0)
    updates[1] = cpu_state_dict(other)  # applied at the boundary after token step 1
    result = gen.generate_group("g1", Example("abc>", "cba"), 16, sampling, seed=1)
    assert (result.weight_version_start, result.weight_version_end) == (0, 5)
    assert gen.weight_version == 5
    tags = plane.tags("run-1")[result.keys[0]]
    assert (tags["v_start"], tags["v_end"]) == (0, 5)
    after = gen.generate_group("g2", Example("abc>", "cba"), 4, sampling, seed=2)
    assert (after.weight_version_start, after.weight_version_end) == (5, 5)


def test_generator_refuses_older_weights():
    gen, _ = make_generator(weight_version=3)
    sd = cpu_state_dict(gen.model)
    assert gen.update_weights(3, sd).version == 3  # re-publishing the held version: ack
    with pytest.raises(StaleWeightsError, match="holds .*3.*older version 2"):
        gen.update_weights(2, sd)
    assert gen.update_weights(4, sd).version == 4


def test_too_long_prompt_is_rejected_before_sampling():
    gen, plane = make_generator(task="copy")
    with pytest.raises(PromptTooLongError, match="context of 32"):
        gen.generate_group("g", Example("a" * 30 + ">", "x"), 2, SamplingSection(max_new_tokens=4), 0)
    assert plane.list("run-1") == []
