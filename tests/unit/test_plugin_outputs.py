"""What a plugin task or environment hands back is checked where it enters the run.

``float()`` read a reward of ``"0.5"`` as a number (a run trained on it, and a durable
episode's ``EnvStepsCompleted`` would carry the text, an entry no reader decodes) and
failed on ``None`` with a message naming neither task nor reward; ``examples()`` that
returned strings or nothing stopped the run's preflight with a traceback. Each is now
one sentence naming the task (or environment and step) and what came back.
"""

from __future__ import annotations

import numpy as np
import pytest

from workers.dataplane import MemoryDataPlane
from workers.envs.base import EnvError, EnvStep, Observation
from workers.generator import Generator
from workers.models.config import ModelSection, SamplingSection
from workers.models.factory import build_model
from workers.tasks import Example, prompt_set
from workers.tasks.builtin import ReverseTask
from tests.unit.test_envs_runner import KEYS, runner

BAD = [("0.5", TypeError, "returned a reward of '0.5' (str); expected a number"),
       (None, TypeError, "returned a reward of None (NoneType); expected a number"),
       (float("nan"), ValueError, "returned a reward of nan; expected a finite number"),
       # a bool was taken as 1.0/0.0 here while the agent and TextArena paths refuse it
       (True, TypeError, "returned a reward of True (bool); expected a number"),
       # numpy's bool has __float__ too: a comparison of arrays returned as the reward
       (np.True_, TypeError, "returned a reward of np.True_ (bool); expected a number")]


class Returns(ReverseTask):
    """The reverse task, its reward() or examples() replaced by a fixed answer."""

    name = "plugins:Returns"

    def __init__(self, reward=None, examples=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self._reward, self._examples = reward, examples

    def reward(self, example, completion, stopped):  # type: ignore[no-untyped-def]
        return self._reward

    def examples(self, count, seed):  # type: ignore[no-untyped-def]
        return self._examples


@pytest.mark.parametrize(("value", "error", "says"), BAD)
def test_a_task_reward_that_is_not_a_finite_number_fails_the_group_naming_it(value, error, says):
    model, tok = build_model(ModelSection(context_len=32, d_model=32, n_heads=2), 3)
    gen = Generator(model, tok, Returns(reward=value), MemoryDataPlane(), "run-1")
    with pytest.raises(error) as err:
        gen.generate_group("g1", Example("abc>", "cba"), 2, SamplingSection(max_new_tokens=3), 0)
    assert str(err.value) == f"task 'plugins:Returns' {says}"


@pytest.mark.parametrize(("value", "error", "says"), BAD)
def test_an_env_step_reward_that_is_not_a_finite_number_is_an_env_error(value, error, says):
    class Env:
        dedupes_by_key = True

        def reset(self, key):  # type: ignore[no-untyped-def]
            return Observation(text="12*3=")

        def step(self, action, key):  # type: ignore[no-untyped-def]
            return EnvStep(Observation(text=""), value, True)

    model, _ = build_model(ModelSection(context_len=32, d_model=32, n_heads=2))
    with pytest.raises(EnvError) as err:
        runner(model).run(KEYS[:1], [Env()])
    assert str(err.value) == f"calculator step() at run/g0/s0/t1 {says}"


def test_a_numeric_reward_of_another_type_is_still_taken() -> None:
    import numpy as np

    model, tok = build_model(ModelSection(context_len=32, d_model=32, n_heads=2), 3)
    plane = MemoryDataPlane()
    gen = Generator(model, tok, Returns(reward=np.float32(0.25)), plane, "run-1")
    result = gen.generate_group("g1", Example("abc>", "cba"), 2, SamplingSection(max_new_tokens=3), 0)
    rows = plane.get("run-1", list(result.keys))
    assert [float(r["reward"]) for r in rows] == [0.25, 0.25]


@pytest.mark.parametrize(("examples", "says"), [
    (["abc>"], ": item 0 is str 'abc>'; expected an Example(prompt, answer)"),
    ([], " returned no examples"),
    (None, " returned NoneType; expected a list of Example"),
    ([Example("abc>", "cba"), Example(5, "x")], ": item 1 has a prompt of type int (5); expected str"),
])
def test_examples_that_are_not_a_list_of_text_examples_are_one_sentence(examples, says):
    with pytest.raises((TypeError, ValueError)) as err:
        prompt_set(Returns(examples=examples), 4, 0)
    assert str(err.value) == f"task 'plugins:Returns': examples(4, seed){says}"
