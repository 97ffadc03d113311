"""A run naming an episode task is checked before anything starts: the name, its
options, the prompts against the tiny model's alphabet, and the generator backend."""

from __future__ import annotations

import pytest

from cli.common import CliError
from cli.preflight import check_config
from controller.config import load_config
from tests.hf_fixture import save_tiny_hf_lm

pytest.importorskip("reasoning_gym", reason="the envs extra (pip install -e '.[envs]')")


def test_calculator_passes_the_preflight_with_the_default_model():
    check_config(load_config(overrides=['task.name="calculator"', "task.num_prompts=64"]))


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (['task.name="reasoning-gym/spel_backward"'],
         r"^config: task.name: unknown reasoning-gym dataset 'spel_backward'.*did you mean"),
        (['task.name="reasoning-gym/spell_backward"', "task.options={word_len=3}"],
         r"cannot be built: ValueError: reasoning-gym/spell_backward: unknown option"),
        (['task.name="calculator"', "task.options={digits=9}"],
         r"cannot be built: ValueError: calculator: digits must be in 1..4"),
        # the question's capital S is not in the tiny model's default alphabet
        (['task.name="reasoning-gym/spell_backward"', "task.num_prompts=4"],
         r"character 'S' in 'Spell this word backward"),
    ],
)
def test_a_bad_episode_task_is_one_line_naming_it(overrides, reason):
    with pytest.raises(CliError, match=reason):
        check_config(load_config(overrides=overrides))


def test_a_wide_alphabet_lets_the_tiny_model_take_reasoning_gym_questions():
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ():->"
    check_config(load_config(overrides=[
        'task.name="reasoning-gym/spell_backward"', "task.num_prompts=16",
        "task.options={min_word_len=3, max_word_len=3}", f'model.alphabet="{alphabet}"',
        "model.context_len=64",
    ]))


def test_episode_tasks_are_refused_on_the_vllm_generator(tmp_path):
    path = save_tiny_hf_lm(tmp_path / "hf")
    cfg = load_config(overrides=['task.name="calculator"', 'rollout.backend="vllm"',
                                 'model.kind="hf"', f'model.path="{path}"'])
    with pytest.raises(CliError, match=r"runs multi-turn episodes.*rollout.backend = \"torch\""):
        check_config(cfg)
