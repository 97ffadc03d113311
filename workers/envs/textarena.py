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
import random
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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
    parts = []
    for m in messages:
        sender, text, kind = _fields(m)
        if not (sender == player and kind == _PLAYER_ACTION):
            parts.append(text)
    return "\n".join(parts) + ("\n" if parts else "")


def _fields(message: Any) -> tuple[Any, str, int]:
    """(sender, text, kind) of one message. Read by type, not position: some games
    (Countdown, Cryptarithm in textarena 0.7.4) pass ``add_observation`` its arguments
    out of order, so their echoed moves arrive as (kind, sender, text)."""
    texts = [x for x in message if isinstance(x, str)]
    kinds = [x for x in message if isinstance(x, Enum)]
    if len(message) != 3 or len(texts) != 1 or len(kinds) > 1:
        raise EnvError(f"a game message that is not (sender, text, kind): {message!r}")
    if not kinds:  # plain-int kinds (older releases): the documented order
        return message[0], texts[0], int(message[2])
    (sender,) = [x for x in message if x is not texts[0] and x is not kinds[0]]
    return sender, texts[0], int(kinds[0].value)


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
        self._rng: tuple[Any, Any] | None = None
        with _own_random(self):
            return self._reset()

    def _reset(self) -> Observation:
        import textarena

        raw = _raw_id(self.env_id)
        self._results: dict[StepKey, EnvStep] = {}
        try:
            with _no_downloads(self.env_id):
                self._env = textarena.make(raw, **dict(self.options))
        except UnknownEnvError:
            raise
        except TypeError as err:
            raise ValueError(f"{PREFIX}{self.env_id}: invalid options {dict(self.options)}: {err}") from None
        except Exception as err:
            raise EnvError(f"{PREFIX}{self.env_id}: textarena could not build it: "
                           f"{type(err).__name__}: {err}") from err
        try:
            self._env.reset(num_players=1, seed=self.seed)
        except Exception as err:
            if _starts_with_two(raw, self.options, self.seed):
                raise EnvError(
                    f"{PREFIX}{self.env_id} did not start as a single-player game "
                    f"({type(err).__name__}: {err}); only single-player games are supported"
                ) from err
            # not a matter of players: the options (or the game itself) are at fault
            raise EnvError(
                f"{PREFIX}{self.env_id} could not start with options {dict(self.options)}: "
                f"{type(err).__name__}: {err}"
            ) from err
        player, messages = self._env.get_observation()
        self._player = player
        return Observation(text=render(messages, player))

    def step(self, action: Action, key: StepKey) -> EnvStep:
        if key in self._results:
            return self._results[key]
        with _own_random(self):
            return self._step(action, key)

    def _step(self, action: Action, key: StepKey) -> EnvStep:
        done, info = self._env.step(action.text)
        if done:
            rewards, game_info = self._env.close()
            reward = (rewards or {}).get(self._player, 0.0)
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) \
                    or not math.isfinite(reward):
                raise EnvError(f"{PREFIX}{self.env_id} returned reward {reward!r} at {key}")
            reward = float(reward)
            details = dict((game_info or {}).get(self._player, {}))
            result = EnvStep(Observation(text=""), reward, True, _jsonable(details))
        else:
            player, messages = self._env.get_observation()
            result = EnvStep(Observation(text=render(messages, player)), 0.0, False,
                             _jsonable(dict(info or {})))
        self._results[key] = result
        return result

    def restore_step(self, action: Action, recorded: EnvStep, key: StepKey) -> Observation:
        """A recorded move, re-applied to this fresh game (``workers.envs.base``): the game
        is an in-process simulation seeded by the example, so replaying the moves on a
        new instance rebuilds its state with no effect outside it. The game must reach
        the recorded step's end, reward and observation (the text the game showed, which
        is its state as the model saw it); the runner, whose record holds the observation
        as ids, checks the returned one against them."""
        with _own_random(self):
            done, _ = self._env.step(action.text)
            if done:
                rewards, _ = self._env.close()
                got = EnvStep(Observation(text=""), float((rewards or {}).get(self._player, 0.0)),
                              True)
            else:  # taken, as the live step took it: not shown again
                player, messages = self._env.get_observation()
                got = EnvStep(Observation(text=render(messages, player)), 0.0, False)
        self._results[key] = recorded
        # the text is compared where the record has it (the runner's has ids: it compares)
        if (got.done, got.reward) != (recorded.done, recorded.reward) \
                or recorded.observation.text not in (None, got.observation.text):
            raise EnvError(
                f"{PREFIX}{self.env_id} is not deterministic on replay at {key}: the log "
                f"recorded {_shown(recorded)}, the re-applied move gave {_shown(got)}"
            )
        return got.observation


def _shown(step: EnvStep) -> str:
    """A step as a replay check names it: its end, reward and observation text."""
    text = step.observation.text
    seen = "" if text is None else f", observation {text[:120]!r}"
    return f"done={step.done}, reward {step.reward}{seen}"


@contextmanager
def _no_downloads(env_id: str) -> Iterator[None]:
    """Build a game with ``nltk.download`` refusing to fetch what is not installed.

    TextArena's word games (Wordle, Hangman, WordLadder, ...) call ``nltk.download``
    when their module is imported: a network fetch at run time, and, offline, a game
    that fails later with a long LookupError. Data already installed is used as is.
    """
    try:
        import nltk
    except ImportError:  # pragma: no cover - textarena depends on it
        yield
        return

    def download(info_or_id: Any = None, *args: Any, **kwargs: Any) -> bool:
        ids = [info_or_id] if isinstance(info_or_id, str) else list(info_or_id or [])
        missing = [i for i in ids if not _nltk_installed(nltk, i)]
        if missing:
            raise UnknownEnvError(
                f"{PREFIX}{env_id} needs nltk data {missing}, which TextArena would download "
                f"at run time; install it first (python -m nltk.downloader {' '.join(missing)})"
            )
        return True

    original, nltk.download = nltk.download, download
    try:
        yield
    finally:
        nltk.download = original


def _nltk_installed(nltk: Any, resource: str) -> bool:
    for kind in ("corpora", "taggers", "tokenizers", "chunkers", "models", "misc"):
        try:
            nltk.data.find(f"{kind}/{resource}")
            return True
        except LookupError:
            continue
    return False


#: the process's random state is swapped per call, so calls of two games never overlap
_RANDOM_LOCK = threading.Lock()


@contextmanager
def _own_random(env: TextArenaEnv) -> Iterator[None]:
    """Run a game call on the game's own random state, not the process's.

    TextArena's games draw from the global ``random`` (2048 spawns its tiles with
    ``random.choice`` on every move) and ``numpy.random``, seeded once in ``reset``. A
    group's episodes step in turn in one process, so each game's draws would depend
    on the others' moves, and a game resumed alone after a crash (``restore_step``)
    would continue from another board than the one its log recorded. With its own
    state, seeded from the example, a game is a function of its seed and its moves.
    """
    import numpy as np

    with _RANDOM_LOCK:
        outside = random.getstate(), np.random.get_state()
        if env._rng is None:
            random.seed(env.seed)
            np.random.seed(env.seed % 2**32)
        else:
            random.setstate(env._rng[0])
            np.random.set_state(env._rng[1])
        try:
            yield
        finally:
            env._rng = random.getstate(), np.random.get_state()
            random.setstate(outside[0])
            np.random.set_state(outside[1])


def _starts_with_two(raw: str, options: Mapping[str, Any], seed: int) -> bool:
    """Whether the game starts for two players (a game that failed to start for one)."""
    import textarena

    try:
        textarena.make(raw, **dict(options)).reset(num_players=2, seed=seed)
    except Exception:
        return False
    return True


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
        # fail at load, not mid-run: build and start one game now, and make one malformed
        # move in it, as a model in training does from its first turn
        check = TextArenaEnv(env_id, 0, self.options)
        key = StepKey("check", "check", 0, 0)
        check.reset(key)
        try:  # a game allows one malformed move; the next ends it, through its own path
            for turn in (1, 2, 3):
                if check.step(Action("?", (), True), key.at(turn)).done:
                    break
        except Exception as err:
            raise EnvError(
                f"{self.name} fails when malformed moves end it ({err}), so a model's "
                "malformed moves would fail its groups; pick another game"
            ) from err

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
