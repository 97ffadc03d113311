"""``task.name = "ledger"``: a tool whose every call has a side effect, made exactly once.

The environment of the chaos tests, and the smallest example of what an environment
must do to be exactly-once (``docs/agents.md``). Every model turn is a call to a tool
whose side effect is one line appended to a ledger file of its own (``path``): the
call's idempotency key and its result (the ledger's length when it ran). The ledger is
also the tool's memory of keys: a call whose key is already in it is answered from it
and not made again -- so the environment deduplicates by key (``dedupes_by_key``).

With ``dedupe = false`` the tool does not look (a call made again would append a second
line) and says so: ``dedupes_by_key = False``. The controller then never makes a call
whose result was lost again; it starts that episode over with new keys instead.

The tool keeps nothing in the instance (its state is the ledger), so a resumed episode
needs nothing rebuilt: ``restore_step`` does nothing. An episode is ``turns`` calls long;
each turn earns ``(number of ids in the call mod 3) / (2 turns)``, a reward that differs
between samples so groups have something to learn from.

``RLC_LEDGER_KILL_AT=key[,key...]`` (a test hook, off by default) SIGKILLs the process
right after the side effect of those keys, before the result can be recorded: the
"environment worker died mid-call" case of the chaos tests.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from workers.envs.base import Action, EnvStep, Observation, StepKey
from workers.tasks.base import Example

KILL_ENV = "RLC_LEDGER_KILL_AT"


def read_ledger(path: str | Path) -> list[tuple[str, str]]:
    """(key, result) per complete line, in the order the calls ran."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # a line cut by a kill has no newline: not a call
    return [tuple(line.split("\t", 1)) for line in lines if "\t" in line]  # type: ignore[misc]


def ledger_call(path: str | Path, key: str, dedupe: bool) -> str:
    """Run the side effect of the call keyed ``key``: one line appended to the ledger at
    ``path`` (in one write). With ``dedupe`` a key the ledger holds is answered from it
    and nothing happens. A key named in ``KILL_ENV`` kills the process right after its
    effect, before the result can be recorded."""
    lines = read_ledger(path)
    result = dict(lines).get(key) if dedupe else None
    if result is None:
        result = str(len(lines) % 1000)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{key}\t{result}\n".encode())
        finally:
            os.close(fd)
        if key in os.environ.get(KILL_ENV, "").split(","):
            os.kill(os.getpid(), signal.SIGKILL)
    return result


def turn_reward(action: Action, turns: int) -> float:
    return (len(action.token_ids) % 3) / (2 * turns)


@dataclass
class LedgerEnv:
    """One episode of calls to the ledger tool."""

    path: str
    turns: int
    dedupes_by_key: bool = True

    def reset(self, key: StepKey) -> Observation:
        return Observation(text=f"go{key.sample % 10}:")

    def step(self, action: Action, key: StepKey) -> EnvStep:
        done = key.turn >= self.turns
        result = ledger_call(self.path, str(key), self.dedupes_by_key)
        return EnvStep(Observation(text=f">{result}"), turn_reward(action, self.turns), done,
                       {"ledger": result})

    def restore_step(self, action: Action, recorded: EnvStep, key: StepKey) -> Observation | None:
        """Nothing to rebuild: the tool's state is its ledger, not this instance (and its
        observation is the ledger's line, which only a call would read)."""
        return None


class LedgerTask:
    """Episodes of ``turns`` ledger calls; prompts ``go<i>:``."""

    name = "ledger"

    def __init__(self, *, path: str = "", turns: int = 3, dedupe: bool = True) -> None:
        if not path:
            raise ValueError("ledger: task.options.path (the ledger file) is required")
        if turns < 1:
            raise ValueError(f"ledger: turns must be >= 1, got {turns}")
        self.path, self.max_turns, self.dedupe = path, turns, dedupe

    def examples(self, count: int, seed: int) -> list[Example]:
        return [Example(prompt=f"go{(seed + i) % 10}:", answer="") for i in range(count)]

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        """A single completion scored without calling the tool (no side effect)."""
        return (len(completion) % 3) / (2 * self.max_turns)

    def make_env(self, example: Example) -> LedgerEnv:
        return LedgerEnv(self.path, self.max_turns, self.dedupe)
