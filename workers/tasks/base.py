"""The Task protocol, the task registry and plugin loading.

A task turns a seed into prompts with known answers and scores a completion with a
deterministic, verifiable reward in [0, 1]. Built-in tasks register themselves by
name; a user task is named ``"package.module:ClassName"`` and loaded on demand.
"""

from __future__ import annotations

import copy
import importlib
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, SupportsFloat, TypeVar, runtime_checkable

from workers.errors import GroupError


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer."""

    prompt: str
    answer: str
    #: free-form, JSON-compatible extra data (passed through to the task's reward)
    metadata: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    """What the generator needs from a task."""

    #: registry name (or ``module:Class`` for a plugin)
    name: str

    def examples(self, count: int, seed: int) -> list[Example]:
        """``count`` examples, a pure function of ``seed``."""
        ...

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        """Score ``completion`` (decoded, EOS excluded) in [0, 1].

        ``stopped`` is True when the model ended the completion with EOS, False
        when it ran out of ``max_new_tokens``.
        """
        ...


@runtime_checkable
class SimulatesDecode(Protocol):
    """A task that stands in for a slower model (benchmarks): it names the seconds each
    real token step of a group should take (``Generator.simulated_decode``)."""

    def step_latency_s(self, example: Example, max_steps: int) -> float: ...


@runtime_checkable
class TunedTask(Protocol):
    """A task class that names the run settings it is tuned for (config tables, e.g.
    ``{"model": {"context_len": 16}}``); ``run`` puts the file and ``--set`` on top."""

    run_defaults: dict[str, Any]


class UnknownTaskError(ValueError):
    """A task name that is neither registered nor a loadable ``module:Class``."""


_REGISTRY: dict[str, Callable[..., Task]] = {}

T = TypeVar("T")


def register_task(name: str) -> Callable[[T], T]:
    """Class decorator adding a built-in task under ``name``."""

    def add(cls: T) -> T:
        if name in _REGISTRY:
            raise ValueError(f"task {name!r} is already registered")
        _REGISTRY[name] = cls  # type: ignore[assignment]
        return cls

    return add


#: built-ins that live elsewhere (the multi-turn ones in ``workers.envs``, which builds on
#: this module): name -> "module:Class", imported on first use
_ELSEWHERE: dict[str, str] = {
    "calculator": "workers.envs.calculator:CalculatorTask",
    "calculator-notool": "workers.envs.calculator:CalculatorNoToolTask",
    "ledger": "workers.envs.ledger:LedgerTask",
}

#: task families named "<prefix><name>" (e.g. "reasoning-gym/leg_counting"): prefix ->
#: "module:function" building the task from the rest of the name; imported on first use
#: so that a family's package is loaded only by the runs that use it
_FAMILIES: dict[str, str] = {
    "reasoning-gym/": "workers.envs.reasoning_gym:make_reasoning_gym_task",
    "textarena/": "workers.envs.textarena:make_textarena_task",
}


def available_tasks() -> list[str]:
    """Names of the registered tasks, sorted (families as ``prefix<name>``)."""
    names = sorted({*_REGISTRY, *_ELSEWHERE})
    return names + [f"{prefix}<name>" for prefix in sorted(_FAMILIES)]


def make_task(spec: str, **options: Any) -> Task:
    """Build a task from a registry name or a ``module:Class`` plugin spec."""
    family = next((p for p in _FAMILIES if spec.startswith(p)), None)
    if spec in _REGISTRY:
        task = _REGISTRY[spec](**options)
    elif spec in _ELSEWHERE:
        task = _load_plugin(_ELSEWHERE[spec])(**options)
    elif family is not None:
        task = _load_plugin(_FAMILIES[family])(spec[len(family):], **options)
    elif ":" in spec:
        task = _load_plugin(spec)(**options)
    else:
        raise UnknownTaskError(
            f"unknown task {spec!r}; available: {', '.join(available_tasks())} "
            "(or a plugin as 'package.module:ClassName')"
        )
    if not isinstance(task, Task):
        raise TypeError(
            f"task {spec!r} does not implement the Task protocol "
            "(needs a 'name' attribute and 'examples' and 'reward' methods)"
        )
    return task


def task_run_defaults(spec: str) -> dict[str, Any]:
    """The run settings a built-in task is tuned for (its class's ``run_defaults``: config
    tables, e.g. ``{"model": {"context_len": 16}}``); {} for a task that declares none,
    a family or a plugin (a user's module is imported only when the run builds its task)."""
    if spec in _REGISTRY:
        cls: Any = _REGISTRY[spec]
    elif spec in _ELSEWHERE:
        cls = _load_plugin(_ELSEWHERE[spec])
    else:
        return {}
    return copy.deepcopy(dict(cls.run_defaults)) if isinstance(cls, TunedTask) else {}


def _load_plugin(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UnknownTaskError(f"plugin task {spec!r} must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UnknownTaskError(f"cannot import plugin task module {module_name!r}: {err}") from err
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UnknownTaskError(f"module {module_name!r} has no task class {attr!r}") from None


class RewardTypeError(GroupError, TypeError):
    """A reward that is not a number (``checked_reward``): its group's own failure."""


class RewardValueError(GroupError, ValueError):
    """A reward that is not finite (``checked_reward``): its group's own failure."""


def checked_reward(where: str, value: object) -> float:
    """A task's or environment's reward as the run stores it: a finite number.

    ``float()`` alone would read the text ``"0.5"`` as a number and fail on ``None`` with
    a message that names neither the task nor the reward; ``where`` names who returned it
    (``task 'mod:Cls'``, ``env step() at run/g1/s0/t1``). A bool is refused as the
    agent and TextArena paths refuse it: ``True`` is more likely a check's result
    returned by mistake than a reward of 1.0 (``float(done)`` says it is meant). NumPy's
    bool (a comparison of arrays) is refused alike, looked up only where numpy is already
    loaded: a value of that type cannot exist otherwise, and a config load stays free of it.
    """
    if (isinstance(value, (str, bytes, bool)) or _is_numpy_bool(value)
            or not isinstance(value, SupportsFloat)):
        raise RewardTypeError(f"{where} returned a reward of {value!r} ({type(value).__name__}); "
                        "expected a number")
    reward = float(value)  # type: ignore[arg-type]
    if not math.isfinite(reward):
        raise RewardValueError(f"{where} returned a reward of {reward}; expected a finite number")
    return reward


def _is_numpy_bool(value: object) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.bool_)


def checked_examples(task: Task, examples: object, count: int) -> list[Example]:
    """What a task's ``examples(count, seed)`` returned, refused in one sentence unless
    it is a non-empty list of :class:`Example` with text prompts and answers."""
    where = f"task {task.name!r}: examples({count}, seed)"
    if not isinstance(examples, list):
        raise TypeError(f"{where} returned {type(examples).__name__}; expected a list of Example")
    if not examples:
        raise ValueError(f"{where} returned no examples")
    for i, example in enumerate(examples):
        if not isinstance(example, Example):
            raise TypeError(f"{where}: item {i} is {type(example).__name__} {example!r:.60}; "
                            "expected an Example(prompt, answer)")
        for name in ("prompt", "answer"):
            if not isinstance(getattr(example, name), str):
                value = getattr(example, name)
                raise TypeError(f"{where}: item {i} has a {name} of type "
                                f"{type(value).__name__} ({value!r:.60}); expected str")
    return examples


def shaped_match_reward(completion: str, answer: str, stopped: bool) -> float:
    """Partial credit for RL bootstrapping, in [0, 1].

    ``0.8 * matches / max(len(answer), len(completion))`` -- each right character pays a
    little and extra characters dilute the score -- plus a stop bonus of
    ``0.2 * max(0, 1 - |len(completion) - len(answer)| / len(answer))`` when the
    completion ended with EOS. The bonus is graded so that emitting EOS at all is
    rewarded early in training (before the model finds the exact length); otherwise
    a policy that has learnt the letters never discovers where to stop.
    Exactly 1.0 iff the completion is the answer followed by EOS.
    """
    width = max(len(answer), len(completion))
    if width == 0:
        return 1.0 if stopped else 0.0
    matches = sum(a == b for a, b in zip(completion, answer))
    bonus = 0.0
    if stopped and answer:
        bonus = max(0.0, 1.0 - abs(len(completion) - len(answer)) / len(answer))
    elif stopped:
        bonus = 1.0 if not completion else 0.0
    # (4x + y) / 5 rather than 0.8x + 0.2y: the exact answer scores exactly 1.0
    return (4.0 * matches / width + bonus) / 5.0
