"""``task.name = "reasoning-gym/<dataset>"``: a reasoning-gym dataset as a task.

reasoning-gym (PyPI ``reasoning-gym``) generates its problems procedurally from a seed
and scores answers with its own verifier, so nothing is downloaded: the prompts are the
dataset's questions, the reward is ``dataset.score_answer(completion, entry)`` in [0, 1].
The dataset's own config keys pass through as task options (``[task] options`` or
``make_task("reasoning-gym/spell_backward", min_word_len=3, max_word_len=3)``); a key the
dataset's config does not have is an error naming it and the keys it has.

``answer_format = "tag"`` scores what is inside ``<answer>...</answer>`` (the format
reasoning-gym's own prompts ask an LLM for); the default ``"raw"`` scores the whole
completion, which suits a model trained from scratch to answer directly.

Used as an episode (``workers.envs.task.as_episode_task``) it is one turn: the question,
then the scored answer. Importing reasoning_gym takes about a second and registers its
100-odd datasets; it happens when a run names one, not before.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any, Literal

from workers.envs.base import EnvError, UnknownEnvError
from workers.tasks.base import Example

PREFIX = "reasoning-gym/"


def _registry() -> Mapping[str, tuple[type, type]]:
    try:
        import reasoning_gym  # noqa: F401  (registers the datasets)
        from reasoning_gym.factory import DATASETS
    except ImportError as err:  # pragma: no cover - the package is a dependency
        raise UnknownEnvError(
            f"{PREFIX}*: the reasoning-gym package is not installed ({err}); "
            "pip install reasoning-gym"
        ) from None
    return DATASETS


def dataset_names() -> list[str]:
    return sorted(_registry())


class ReasoningGymTask:
    """One reasoning-gym dataset: its questions as prompts, its scorer as the reward."""

    def __init__(
        self, dataset: str, *, answer_format: Literal["raw", "tag"] = "raw", **config: Any
    ) -> None:
        registry = _registry()
        if dataset not in registry:
            close = difflib.get_close_matches(dataset, registry, n=3)
            hint = f"; did you mean {', '.join(PREFIX + c for c in close)}?" if close else ""
            raise UnknownEnvError(
                f"unknown reasoning-gym dataset {dataset!r} in task name {PREFIX + dataset!r}"
                f"{hint} ({len(registry)} datasets: {', '.join(sorted(registry))})"
            )
        if answer_format not in ("raw", "tag"):
            raise ValueError(f"{PREFIX}{dataset}: answer_format must be 'raw' or 'tag', "
                             f"got {answer_format!r}")
        fields = {f.name for f in dataclasses.fields(registry[dataset][1])} - {"seed", "size"}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise ValueError(
                f"{PREFIX}{dataset}: unknown option(s) {unknown}; its config has "
                f"{sorted(fields)}"
            )
        self.dataset = dataset
        self.name = PREFIX + dataset
        self.answer_format = answer_format
        self.config = dict(config)
        self._scorer: Any = None

    def _create(self, seed: int, size: int) -> Any:
        import reasoning_gym

        try:
            return reasoning_gym.create_dataset(self.dataset, seed=seed, size=size, **self.config)
        except (AssertionError, ValueError, TypeError) as err:
            raise ValueError(f"{self.name}: invalid config {self.config}: {err}") from None

    def examples(self, count: int, seed: int) -> list[Example]:
        data = self._create(seed, count)
        if self._scorer is None:
            self._scorer = data
        return [
            Example(prompt=e["question"], answer=str(e["answer"]),
                    metadata={"metadata": e.get("metadata", {})})
            for e in (data[i] for i in range(count))
        ]

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        if self._scorer is None:
            self._scorer = self._create(0, 1)
        answer: str | None = completion
        if self.answer_format == "tag":
            from reasoning_gym.utils import extract_answer

            answer = extract_answer(completion)
        entry = {"question": example.prompt, "answer": example.answer,
                 "metadata": dict(example.metadata.get("metadata", {}))}
        try:
            score = float(self._scorer.score_answer(answer, entry))
        except Exception as err:
            raise EnvError(
                f"{self.name}: the dataset's scorer raised on completion {completion!r}: "
                f"{type(err).__name__}: {err}"
            ) from err
        if not math.isfinite(score):
            raise EnvError(f"{self.name}: the dataset's scorer returned {score}")
        return min(1.0, max(0.0, score))


def make_reasoning_gym_task(dataset: str, **options: Any) -> ReasoningGymTask:
    """The task family's factory (``workers.tasks.base`` resolves the prefix)."""
    return ReasoningGymTask(dataset, **options)
