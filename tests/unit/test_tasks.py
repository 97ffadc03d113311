"""Tasks: rewards, determinism, the registry, plugins and the JSONL loader."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from workers.models.tokenizer import CharTokenizer
from workers.tasks import (
    DEFAULT_TASK,
    DatasetError,
    Example,
    PromptTooLongError,
    Task,
    UnknownTaskError,
    available_tasks,
    check_prompts_fit,
    load_jsonl,
    make_task,
    prompt_set,
    shaped_match_reward,
)


@pytest.mark.parametrize(
    "completion, stopped, want",
    [
        ("cba", True, 1.0),  # exact answer + EOS
        ("cba", False, 0.8),  # right letters, ran out of budget
        ("cbx", True, 0.8 * 2 / 3 + 0.2),
        ("cbaxx", False, 0.8 * 3 / 5),  # extra characters dilute
        ("cbaxx", True, 0.8 * 3 / 5 + 0.2 * (1 - 2 / 3)),  # graded stop bonus
        ("c", True, 0.8 / 3 + 0.2 * (1 - 2 / 3)),
        ("", True, 0.0),
        ("", False, 0.0),
        ("xyz", False, 0.0),
    ],
)
def test_reverse_reward_for_known_completions(completion, stopped, want):
    task = make_task("reverse")
    ex = Example(prompt="abc>", answer="cba")
    assert task.reward(ex, completion, stopped) == pytest.approx(want)


def test_addition_examples_and_reward():
    task = make_task("addition")
    for ex in task.examples(50, seed=3):
        a, b = ex.prompt.rstrip("=").split("+")
        assert int(ex.answer) == int(a) + int(b) and int(a) < 100 and int(b) < 100
        assert task.reward(ex, ex.answer, True) == 1.0
    assert task.reward(Example("47+38=", "85"), "86", True) == pytest.approx(0.4 + 0.2)


def test_reward_is_one_only_for_exact_answer_with_eos():
    for answer in ["a", "ab", "105"]:
        assert shaped_match_reward(answer, answer, True) == 1.0
        assert shaped_match_reward(answer, answer, False) < 1.0
        assert shaped_match_reward(answer + "x", answer, True) < 1.0


@pytest.mark.parametrize("name", ["reverse", "copy", "addition"])
def test_examples_are_a_pure_function_of_the_seed(name):
    task = make_task(name)
    assert task.examples(20, seed=7) == task.examples(20, seed=7)
    assert task.examples(20, seed=7) != task.examples(20, seed=8)
    assert isinstance(task, Task) and task.name == name


def test_random_completions_score_low_on_default_task():
    import random

    task = make_task(DEFAULT_TASK)
    rng = random.Random(0)
    alphabet = CharTokenizer().alphabet
    scores = []
    for ex in task.examples(200, seed=0):
        comp = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
        scores.append(task.reward(ex, comp, rng.random() < 0.3))
    assert sum(scores) / len(scores) <= 0.2


def test_unknown_task_names_the_available_ones():
    with pytest.raises(UnknownTaskError) as err:
        make_task("reversal")
    for name in available_tasks():
        assert name in str(err.value)
    assert {"reverse", "copy", "addition"} <= set(available_tasks())


def test_task_options_are_passed_through():
    task = make_task("reverse", length=5, alphabet="xy")
    ex = task.examples(1, seed=0)[0]
    assert len(ex.answer) == 5 and set(ex.answer) <= {"x", "y"}


def test_plugin_task_loads_from_module_colon_class(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(
        textwrap.dedent(
            """
            from workers.tasks import Example

            class Echo:
                name = "echo"

                def __init__(self, word="hi"):
                    self.word = word

                def examples(self, count, seed):
                    return [Example(prompt=self.word + ">", answer=self.word)] * count

                def reward(self, example, completion, stopped):
                    return float(completion == example.answer)

            class NotATask:
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        task = make_task("my_tasks:Echo", word="yo")
        assert task.examples(2, 0)[0].prompt == "yo>"
        assert task.reward(task.examples(1, 0)[0], "yo", True) == 1.0
        with pytest.raises(TypeError, match="Task protocol"):
            make_task("my_tasks:NotATask")
        with pytest.raises(UnknownTaskError, match="no task class"):
            make_task("my_tasks:Missing")
        with pytest.raises(UnknownTaskError, match="cannot import"):
            make_task("no_such_module_xyz:Task")
    finally:
        sys.modules.pop("my_tasks", None)


def _write(tmp_path, lines):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_loads_examples_with_metadata(tmp_path):
    path = _write(
        tmp_path,
        [
            json.dumps({"prompt": "ab>", "answer": "ba"}),
            "",
            json.dumps({"prompt": "1+2=", "answer": "3", "metadata": {"src": "x"}}),
        ],
    )
    assert load_jsonl(path) == [
        Example("ab>", "ba"),
        Example("1+2=", "3", {"src": "x"}),
    ]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"prompt": "ab>", "answer": ', "not valid JSON"),
        ('["ab>", "ba"]', "expected a JSON object"),
        ('{"prompt": "ab>"}', "'answer' is missing"),
        ('{"answer": "ba"}', "'prompt' is missing"),
        ('{"prompt": 3, "answer": "x"}', "'prompt' must be a string, got int"),
        ('{"prompt": "ab>", "answer": null}', "'answer' must be a string, got NoneType"),
        ('{"prompt": "ab>", "answer": "ba", "extra": 1}', "unknown keys"),
        ('{"prompt": "ab>", "answer": "ba", "metadata": 5}', "'metadata' must be an object"),
    ],
)
def test_jsonl_malformed_line_is_reported_with_its_number(tmp_path, bad_line, message):
    good = json.dumps({"prompt": "ab>", "answer": "ba"})
    path = _write(tmp_path, [good, "", good, bad_line])
    with pytest.raises(DatasetError, match=f"prompts.jsonl:4: {message}"):
        load_jsonl(path)


def test_jsonl_too_long_prompt_is_rejected_with_line_number(tmp_path):
    tok = CharTokenizer()
    path = _write(
        tmp_path,
        [json.dumps({"prompt": "ab>", "answer": "ba"}), json.dumps({"prompt": "a" * 60, "answer": "x"})],
    )
    with pytest.raises(PromptTooLongError, match=r"prompts.jsonl:2: prompt is 60 tokens.*at most 56"):
        load_jsonl(path, encode=tok.encode, context_len=64, max_new_tokens=8)
    assert len(load_jsonl(path, encode=tok.encode, context_len=68, max_new_tokens=8)) == 2


def test_prompt_outside_tokenizer_alphabet_is_a_dataset_error():
    tok = CharTokenizer()
    with pytest.raises(DatasetError, match="example 0"):
        check_prompts_fit([Example("ABC>", "x")], tok.encode, 64, 8)


def test_prompt_set_generates_or_loads_and_checks_fit(tmp_path):
    task = make_task("reverse")
    assert prompt_set(task, 5, seed=1) == task.examples(5, seed=1)
    path = _write(tmp_path, [json.dumps({"prompt": "abcd>", "answer": "dcba"})])
    assert prompt_set(task, 5, seed=1, path=str(path)) == [Example("abcd>", "dcba")]
    tok = CharTokenizer()
    with pytest.raises(PromptTooLongError, match="prompts.jsonl:1"):
        prompt_set(task, 5, 1, str(path), encode=tok.encode, context_len=8, max_new_tokens=4)
    with pytest.raises(PromptTooLongError, match="example 0"):
        prompt_set(task, 5, 1, encode=tok.encode, context_len=6, max_new_tokens=4)
