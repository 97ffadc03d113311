"""A generator handed an episode task writes one trajectory row per sample, and the
rows train (they are what ``collate`` and the trainer take)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_envs_runner import OracleLM, planned
from workers.batch import OPTIONAL_ROW_FIELDS, ROW_FIELDS, collate
from workers.dataplane import MemoryDataPlane
from workers.generator import Generator
from workers.models.config import ModelSection, SamplingSection
from workers.models.factory import build_model
from workers.models.sampling import sequence_logprobs
from workers.models.tokenizer import CharTokenizer
from workers.tasks import Example, make_task

TOK = CharTokenizer()


def test_calculator_group_rows_hold_the_episodes_with_per_turn_rewards():
    model = OracleLM(planned("47*38=", "47*38", ">1786", "1786"), TOK.vocab_size)
    plane = MemoryDataPlane()
    gen = Generator(model, TOK, make_task("calculator"), plane, "run-1")
    result = gen.generate_group("g3", Example("47*38=", "1786"), 2, SamplingSection(max_new_tokens=8),
                                seed=0, attempt=1)
    assert result.keys == ["run-1/g3/a1/s0", "run-1/g3/a1/s1"]
    assert result.rewards == pytest.approx([1.0, 1.0])
    assert result.prompt_len == 6 and result.completion_lens == [16, 16]
    for row in plane.get("run-1", result.keys):
        # token_versions is optional (OPTIONAL_ROW_FIELDS): episode rows do not write it yet
        assert set(ROW_FIELDS) - OPTIONAL_ROW_FIELDS <= set(row)
        assert row["token_rewards"].dtype == torch.float32
        assert row["input_ids"].tolist() == planned("47*38=", "47*38", ">1786", "1786")
        assert row["loss_mask"].tolist() == [False] * 6 + [True] * 6 + [False] * 5 + [True] * 5
        assert row["token_rewards"][11].item() == pytest.approx(0.2)
        assert row["token_rewards"][21].item() == pytest.approx(0.8)
        assert row["token_rewards"].sum().item() == pytest.approx(row["reward"].item())
    assert plane.tags("run-1")["run-1/g3/a1/s0"]["turns"] == 2


def test_episode_rows_from_the_tiny_model_carry_the_trainers_logprobs():
    model, tok = build_model(ModelSection(context_len=32, d_model=32, n_heads=2), 4)
    plane = MemoryDataPlane()
    gen = Generator(model, tok, make_task("calculator"), plane, "run-1")
    result = gen.generate_group("g1", make_task("calculator").examples(1, 0)[0], 4,
                                SamplingSection(max_new_tokens=8), seed=5)
    rows = plane.get("run-1", result.keys)
    for row in rows:
        mask = row["loss_mask"]
        ref = sequence_logprobs(model, row["input_ids"])
        torch.testing.assert_close(row["generator_logprobs"][mask], ref[mask], atol=2e-5, rtol=0)
    batch = collate(rows, [0.5, -0.5, 1.0, -1.0])
    assert batch.loss_mask.sum() == sum(int(r["loss_mask"].sum()) for r in rows)
    # the group is deterministic given the weights and the seed
    again = gen.generate_group("g2", make_task("calculator").examples(1, 0)[0], 4,
                               SamplingSection(max_new_tokens=8), seed=5)
    assert [r["input_ids"].tolist() for r in plane.get("run-1", again.keys)] == [
        r["input_ids"].tolist() for r in rows]


def test_the_learning_probe_trains_a_few_steps_on_episodes(tmp_path, capsys):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        import learn_episodes
    finally:
        sys.path.pop(0)
    out = tmp_path / "curve.jsonl"
    assert learn_episodes.main(["--task", "calculator", "--max-steps", "2", "--groups", "2",
                                "--n", "4", "--show", "1", "--out", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert all(0.0 <= x["reward"] <= 1.0 and x["grad_norm"] > 0 for x in lines)
    assert "prompt" in capsys.readouterr().out  # --show printed an episode
