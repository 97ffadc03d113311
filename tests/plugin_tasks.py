"""Task plugins the CLI tests name as ``task.name = "tests.plugin_tasks:Class"``."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.envs.tools import ToolCallFormat
from workers.tasks.base import Example
from workers.tasks.builtin import ReverseTask

#: while the file this names exists, RewardFailsWhileMarked's reward() raises
MARKER_ENV = "RLC_TEST_REWARD_BROKEN"
MESSAGE = "reward service unreachable (the test's marker file exists)"
#: the file RewardHeldWhileMarked reads: while it exists, holding the number N, every
#: reward after the first N waits
HOLD_ENV = "RLC_TEST_REWARD_HOLD"

_given = itertools.count()  # rewards asked for in this process (every local generator)
_given_lock = threading.Lock()


def hold_rewards_after(marker: Path, n: int) -> None:
    """Let the first ``n`` rewards of a run with ``HOLD_ENV = marker`` through, hold the
    rest (written whole: the task never reads half a number)."""
    part = marker.with_name(marker.name + ".part")
    part.write_text(str(n))
    os.replace(part, marker)


@dataclass(frozen=True)
class RewardFailsWhileMarked(ReverseTask):
    """The reverse task with a bug its user can fix: ``reward()`` raises while the marker
    file exists (workers read the environment the run was started with)."""

    name = "tests.plugin_tasks:RewardFailsWhileMarked"

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        marker = os.environ.get(MARKER_ENV, "")
        if marker and Path(marker).exists():
            raise RuntimeError(MESSAGE)
        return super().reward(example, completion, stopped)


@dataclass(frozen=True)
class RewardHeldWhileMarked(ReverseTask):
    """The reverse task whose run a test can hold at a known point: while the file named
    by ``HOLD_ENV`` exists, holding N, every reward after the first N of this process
    waits (counted per process: with ``--local-workers`` every generator's, with Ray
    each generator actor's own; a Ray run inherits the variable from the command's
    environment). Deleting the file lets the run go on. A run held this way is alive by construction, so a test
    can watch it between two points without racing it."""

    name = "tests.plugin_tasks:RewardHeldWhileMarked"

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        with _given_lock:
            index = next(_given)
        marker = Path(os.environ.get(HOLD_ENV) or "/nonexistent")  # unset: never held (a resume)
        while True:  # polls the file: what this waits on is the test changing it
            try:
                allowed = int(marker.read_text())
            except FileNotFoundError:
                break
            if index < allowed:
                break
            time.sleep(0.05)
        return super().reward(example, completion, stopped)


#: the ``--set`` that makes a run's task RewardHeldWhileMarked
HELD_TASK = ["--set", f'task.name="{RewardHeldWhileMarked.name}"']


def held_env(hold: Path) -> dict[str, str]:
    """What a run's environment needs for RewardHeldWhileMarked: the hold file, and this
    repository on the path (its generators, Ray actors included, import the task)."""
    return {HOLD_ENV: str(hold), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


@dataclass(frozen=True)
class _Lookup:
    """A tool with no marker whose grammar takes any text: every model turn is a call
    to it, so an untrained tiny model's episode exercises the tool round trip."""

    name: str = "lookup"
    marker: str = ""

    def parse(self, raw: str) -> dict[str, str]:
        return {"query": raw}

    def run(self, arguments: Mapping[str, Any]) -> str:
        return str(arguments["query"])[::-1]


#: a file ReverseAgent appends each episode's ids to (the e2e test compares the rows)
AGENT_LOG_ENV = "RLC_TEST_AGENT_LOG"
LOOKUP_FORMAT = ToolCallFormat(tools=(_Lookup(),))
LOOKUP_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "reverse a string",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}


@dataclass(frozen=True)
class ReverseAgent(ReverseTask):
    """The reverse task played by agent code written for the OpenAI client: ask, run the
    tool call the model makes, send its result back, score the final reply."""

    name = "tests.plugin_tasks:ReverseAgent"
    tool_format: ToolCallFormat | None = LOOKUP_FORMAT

    def run_agent(self, client: Any, model: str, example: Example) -> float:
        messages: list[dict[str, Any]] = [{"role": "user", "content": example.prompt}]
        reply = client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP_TOOL])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            result = LOOKUP_FORMAT.tool(call.function.name).run(json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "?"})
        final = client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP_TOOL])
        choice = final.choices[0]
        log = os.environ.get(AGENT_LOG_ENV)
        if log:  # what the session holds, as its last reply reports it (one write: whole)
            ids = choice.model_extra["prompt_token_ids"] + choice.model_extra["token_ids"]
            with open(log, "a") as f:
                f.write(json.dumps({"prompt": example.prompt, "ids": ids}) + "\n")
        text = choice.message.content if not choice.message.tool_calls else (
            json.loads(choice.message.tool_calls[0].function.arguments)["query"])
        return self.reward(example, text or "", choice.finish_reason != "length")


class LedgerAgent:
    """The ``ledger`` task (``workers.envs.ledger``) played by agent code: every reply's
    tool call runs a tool whose side effect is a line in a ledger file, keyed by the
    reply's ``step_key``; with ``dedupe`` the ledger is also the tool's memory of keys (a
    key it holds is answered from it, not run again), and the task declares
    ``dedupes_by_key``. ``KILL_ENV`` kills the process right after the side effect of
    the keys it names, before the next request can record the result. Each of the
    ``turns`` replies earns ``(its ids mod 3) / (2 turns)``; the episode's reward is
    their sum."""

    name = "tests.plugin_tasks:LedgerAgent"
    tool_format = LOOKUP_FORMAT

    def __init__(self, *, path: str = "", turns: int = 3, dedupe: bool = True) -> None:
        if not path:
            raise ValueError("LedgerAgent: task.options.path (the ledger file) is required")
        self.path, self.turns, self.dedupes_by_key = path, turns, dedupe

    def examples(self, count: int, seed: int) -> list[Example]:
        return [Example(prompt=f"go{(seed + i) % 10}:", answer="") for i in range(count)]

    def reward(self, example: Example, completion: str, stopped: bool) -> float:
        return (len(completion) % 3) / (2 * self.turns)

    def tool(self, key: str) -> str:
        from workers.envs.ledger import ledger_call

        return ledger_call(self.path, key, self.dedupes_by_key)

    def run_agent(self, client: Any, model: str, example: Example) -> float:
        messages: list[dict[str, Any]] = [{"role": "user", "content": example.prompt}]
        total = 0.0
        for _ in range(self.turns):
            reply = client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP_TOOL])
            choice = reply.choices[0]
            total += (len(choice.model_extra["token_ids"]) % 3) / (2 * self.turns)
            messages.append(choice.message.model_dump(exclude_none=True))
            result = self.tool(reply.model_extra["step_key"])
            for call in choice.message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            if not choice.message.tool_calls:
                messages.append({"role": "user", "content": result})
        return total


class NanOnceAgent(LedgerAgent):
    """LedgerAgent whose first episode of prompt ``nan_prompt`` returns a reward of nan
    (``AgentError``: that group's own failure); every other episode plays as usual."""

    name = "tests.plugin_tasks:NanOnceAgent"
    nan_prompt = ""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._lock, self._spent = threading.Lock(), False

    def run_agent(self, client: Any, model: str, example: Example) -> float:
        total = super().run_agent(client, model, example)
        with self._lock:
            if example.prompt == self.nan_prompt and not self._spent:
                self._spent = True
                return float("nan")
        return total
