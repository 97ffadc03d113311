"""``task.name = "textarena/<EnvId>"``: a single-player TextArena game as an episode task.

TextArena (PyPI ``textarena``) is a collection of text games with one API:
``reset(num_players, seed)``, ``get_observation() -> (player, messages)``,
``step(action) -> (done, info)``, ``close() -> (rewards, game_info)``. It installs
from PyPI with four small dependencies and none of its single-player games needs a
network or a model hub, which is why it is the multi-turn package here (verifiers
pins an older ``openai`` and pulls about twenty packages; OpenEnv pulls gradio and
fastmcp and runs its environments as servers).

The adapter builds the game's raw variant (no TextArena wrappers), so each step's
observation is exactly the messages the game produced since the model's last turn:
they are joined into text, encoded once and appended (the model's own action, which
TextArena echoes back, is already in the context and is not repeated). The game's
reward comes from ``close()`` when it ends and lands on the final turn; earlier turns
earn 0. Games for two or more players need opponents and are refused with a clear
error. Game options (``max_turns``, ``min_number``, ...) pass through as task options.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from workers.envs.base import Action, EnvError, EnvStep, Observation, StepKey, UnknownEnvError
from workers.envs.task import single_turn_reward
from workers.tasks.base import Example

PREFIX = "textarena/"
_PLAYER_ACTION = 2  # textarena.ObservationType.PLAYER_ACTION: the player's own move, echoed


def _registry() -> Mapping[str, Any]:
    try:
        from textarena.envs.registration import ENV_REGISTRY
    except ImportError as err:  # pragma: no cover - the package is a dependency
        raise UnknownEnvError(
            f"{PREFIX}*: the textarena package is not installed ({err}); pip install textarena"
        ) from None
    return ENV_REGISTRY


def _raw_id(env_id: str) -> str:
    registry = _registry()
    raw = env_id if env_id.endswith("-raw") else f"{env_id}-raw"
    if raw not in registry:
        names = sorted(k for k in registry if not k.endswith(("-raw", "-train")))
        close = difflib.get_close_matches(env_id, names, n=3)
        hint = f"; did you mean {', '.join(PREFIX + c for c in close)}?" if close else ""
        raise UnknownEnvError(
            f"unknown TextArena environment {env_id!r} in task name {PREFIX + env_id!r}{hint} "
            f"({len(names)} environments, e.g. {', '.join(names[:8])}, ...)"
        )
    return raw


def render(messages: Any, player: int) -> str:
    """The text of the game's messages to ``player`` (its own echoed moves left out)."""
    if isinstance(messages, str):
        return messages
    parts = [m[1] for m in messages if not (m[0] == player and _kind(m[2]) == _PLAYER_ACTION)]
    return "\n".join(parts) + ("\n" if parts else "")


def _kind(kind: Any) -> int:
    # TextArena's observation kinds are an Enum in some releases and plain ints in others
    return int(kind.value if isinstance(kind, Enum) else kind)


@dataclass
class TextArenaEnv:
    """One game, played by the model as player 0."""

    env_id: str
    seed: int
    options: Mapping[str, Any] = field(default_factory=dict)
    #: a game is an in-process simulation: a step already applied (same key) is
    #: answered from this instance's record, never applied twice; a resumed game is
    #: rebuilt by ``restore_step``
    dedupes_by_key: bool = True

    def reset(self, key: StepKey) -> Observation:
        import textarena

        raw = _raw_id(self.env_id)
        self._results: dict[StepKey, EnvStep] = {}
        try:
            self._env = textarena.make(raw, **dict(self.options))
        except TypeError as err:
            raise ValueError(f"{PREFIX}{self.env_id}: invalid options {dict(self.options)}: {err}") from None
        except Exception as err:
            raise EnvError(f"{PREFIX}{self.env_id}: textarena could not build it: "
                           f"{type(err).__name__}: {err}") from err
        try:
            self._env.reset(num_players=1, seed=self.seed)
        except Exception as err:
            raise EnvError(
                f"{PREFIX}{self.env_id} did not start as a single-player game "
                f"({type(err).__name__}: {err}); only single-player games are supported"
            ) from err
        player, messages = self._env.get_observation()
        self._player = player
        return Observation(text=render(messages, player))

    def step(self, action: Action, key: StepKey) -> EnvStep:
        if key in self._results:
            return self._results[key]
        done, info = self._env.step(action.text)
        if done:
            rewards, game_info = self._env.close()
            reward = float((rewards or {}).get(self._player, 0.0))
            if not math.isfinite(reward):
                raise EnvError(f"{PREFIX}{self.env_id} returned reward {reward} at {key}")
            details = dict((game_info or {}).get(self._player, {}))
            result = EnvStep(Observation(text=""), reward, True, _jsonable(details))
        else:
            player, messages = self._env.get_observation()
            result = EnvStep(Observation(text=render(messages, player)), 0.0, False,
                             _jsonable(dict(info or {})))
        self._results[key] = result
        return result

    def restore_step(self, action: Action, recorded: EnvStep, key: StepKey) -> None:
        """A recorded move, re-applied to this fresh game (``workers.envs.base``): the game
        is an in-process simulation seeded by the example, so replaying the moves on a
        new instance rebuilds its state with no effect outside it; the recorded result
        stands (a game that answers otherwise fails the episode at its next move)."""
        done, _ = self._env.step(action.text)
        self._results[key] = recorded
        if not done:
            self._env.get_observation()  # taken, as the live step took it: not shown again
        if bool(done) != recorded.done:
            raise EnvError(
                f"{PREFIX}{self.env_id} is not deterministic on replay at {key}: the log "
                f"recorded done={recorded.done}, the re-applied move gave done={bool(done)}"
            )


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {str(k): v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
            for k, v in d.items()}


class TextArenaTask:
    """A TextArena game: each prompt is a seed, each sample plays one game."""

    def __init__(self, env_id: str, *, max_turns: int = 8, **options: Any) -> None:
        _raw_id(env_id)
        if max_turns < 1:
            raise ValueError(f"{PREFIX}{env_id}: max_turns must be >= 1, got {max_turns}")
        self.env_id = env_id
        self.name = PREFIX + env_id
        self.max_turns = max_turns
        self.options = dict(options)
        # fail at load, not mid-run: build and start one game now
        TextArenaEnv(env_id, 0, self.options).reset(StepKey("check", "check", 0, 0))

    def examples(self, count: int, seed: int) -> list[Example]:
        # the game draws its puzzle from the seed; the prompt names it for the logs
        return [Example(prompt=f"{self.name} seed {seed + i}", answer="",
                        metadata={"seed": seed + i}) for i in range(count)]

    def make_env(self, example: Example) -> TextArenaEnv:
        return TextArenaEnv(self.env_id, int(example.metadata["seed"]), self.options)

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        return single_turn_reward(self, example, completion, stopped)


def make_textarena_task(env_id: str, **options: Any) -> TextArenaTask:
    """The task family's factory (``workers.tasks.base`` resolves the prefix)."""
    return TextArenaTask(env_id, **options)
