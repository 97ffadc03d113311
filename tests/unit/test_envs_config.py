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


def test_a_task_s_run_defaults_fill_only_what_the_user_left_unset(tmp_path):
    from workers.envs.calculator import CALCULATOR_ALPHABET

    cfg = load_config(overrides=['task.name="calculator"'])
    assert cfg.model.alphabet == CALCULATOR_ALPHABET and cfg.train.loss.entropy_coef == 0.08
    assert cfg.model.context_len == 32 and cfg.train.lr == 3e-3  # what it does not name
    mine = load_config(overrides=['task.name="calculator"', "train.loss.entropy_coef=0.0",
                                  'model.alphabet="0123456789+-*=>x"'])
    assert mine.model.alphabet.endswith("x") and mine.train.loss.entropy_coef == 0.0
    # a file counts as the user's too, and the task may be named there
    path = tmp_path / "run.toml"
    path.write_text('[task]\nname = "calculator-notool"\n[train.loss]\nentropy_coef = 0.01\n')
    from_file = load_config(path)
    assert from_file.model.alphabet == CALCULATOR_ALPHABET
    assert from_file.train.loss.entropy_coef == 0.01
    # a task that declares none leaves the run's defaults alone
    assert load_config().model.alphabet == "" and load_config().train.loss.entropy_coef == 0.0


def test_a_run_says_which_of_its_task_s_defaults_it_took():
    from controller.config import config_to_dict
    from workers.tasks.config import task_defaults_in_effect

    def taken(*overrides: str) -> list[str]:
        cfg = load_config(overrides=['task.name="calculator"', *overrides])
        return task_defaults_in_effect(cfg.task.name, config_to_dict(cfg))

    alphabet = "model.alphabet='0123456789+-*=>c'"
    assert taken() == [alphabet, "train.loss.entropy_coef=0.08"]
    assert taken("train.loss.entropy_coef=0.01") == [alphabet]
    assert task_defaults_in_effect("reverse", config_to_dict(load_config())) == []
    assert task_defaults_in_effect("no-such-task", config_to_dict(load_config())) == []


#: everything GuessTheNumber's messages hold but the newline
_GAME_CHARS = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
               " .,:;!?'()[]<>=+-*/_")


def test_a_game_whose_first_observation_the_tokenizer_cannot_encode_is_refused_before_the_run():
    """A TextArena game's prompt is a label (its seed); the model reads the game's first
    message, so that is what the preflight encodes, or every group fails once the run is up."""
    pytest.importorskip("textarena")
    base = ['task.name="textarena/GuessTheNumber-v0"', "task.options={max_turns=3}",
            "model.context_len=1024", "task.num_prompts=4"]
    with pytest.raises(CliError, match=r"^config: task 'textarena/GuessTheNumber-v0': its first "
                       r"observation cannot be encoded \(model.alphabet\?\): character '\\n'"):
        check_config(load_config(overrides=[*base, f'model.alphabet="{_GAME_CHARS}"']))
    with pytest.raises(CliError, match=r"its first observation is \d+ tokens; the model's "
                       r"context of 64 leaves no room"):
        check_config(load_config(overrides=[*base[:2], "model.context_len=64", "task.num_prompts=4",
                                            f'model.alphabet="{_GAME_CHARS}\\n"']))
    check_config(load_config(overrides=[*base, f'model.alphabet="{_GAME_CHARS}\\n"']))


def test_answers_the_model_cannot_write_are_refused_before_the_run():
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ():->"
    base = ['task.name="reasoning-gym/spell_backward"', "task.num_prompts=16",
            "model.context_len=64", f'model.alphabet="{alphabet}"']
    with pytest.raises(CliError, match=r"^config: task 'reasoning-gym/spell_backward' \(answer_format "
                       r"'tag'\): the model cannot write its answers \(model.alphabet\?\): "
                       r"character '<'"):
        check_config(load_config(overrides=[
            *base, 'task.options={min_word_len=3, max_word_len=3, answer_format="tag"}']))
    check_config(load_config(overrides=[
        *base[:3], f'model.alphabet="{alphabet}</"',
        'task.options={min_word_len=3, max_word_len=3, answer_format="tag"}']))
