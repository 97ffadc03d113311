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
import json
import math
import os
import pickle
import subprocess
import sys
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
        if sys.flags.hash_randomization:
            entries = self._entries_at_fixed_hash(seed, count)
        else:  # PYTHONHASHSEED=0 here already
            data = self._create(seed, count)
            entries = [data[i] for i in range(count)]
        return [
            Example(prompt=e["question"], answer=str(e["answer"]),
                    metadata={"metadata": e.get("metadata", {})})
            for e in entries
        ]

    def _entries_at_fixed_hash(self, seed: int, count: int) -> list[dict[str, Any]]:
        """The dataset's entries as a process with ``PYTHONHASHSEED=0`` makes them.

        Some datasets (isomorphic_strings, knight_swap, polynomial_multiplication,
        ransom_note, word_ladder, ...) draw from sets of strings, whose order follows the
        process's hash seed: each generator process, and a resumed run, would pose other
        questions under the same prompt index than the log's. A child process with a
        fixed hash seed makes them the same everywhere."""
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, self.dataset, json.dumps(self.config), str(seed),
             str(count)],
            env={**os.environ, "PYTHONHASHSEED": "0"}, capture_output=True, check=False,
        )
        if child.returncode == 2:  # the dataset refused its config
            raise ValueError(child.stderr.decode().strip().splitlines()[-1])
        if child.returncode != 0:
            raise EnvError(f"{self.name}: generating its questions failed: "
                           f"{child.stderr.decode().strip()[-500:]}")
        return pickle.loads(child.stdout)

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        if self._scorer is None:  # scoring reads the entry and the config, not the questions
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


#: the child of ``_entries_at_fixed_hash``: argv dataset, config (JSON), seed, count
_CHILD = """
import json, pickle, sys
import reasoning_gym
name, config, seed, count = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out, sys.stdout = sys.stdout.buffer, sys.stderr  # what a dataset prints stays out of the pickle
try:
    data = reasoning_gym.create_dataset(name, seed=seed, size=count, **config)
except (AssertionError, ValueError, TypeError) as err:
    print(f"reasoning-gym/{name}: invalid config {config}: {err}", file=sys.stderr)
    sys.exit(2)
out.write(pickle.dumps([data[i] for i in range(count)]))
"""


def make_reasoning_gym_task(dataset: str, **options: Any) -> ReasoningGymTask:
    """The task family's factory (``workers.tasks.base`` resolves the prefix)."""
    return ReasoningGymTask(dataset, **options)
