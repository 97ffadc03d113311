"""Tool calls in a model's text, for models too small for JSON: ``<marker><arguments>``.

A turn whose text starts with a tool's one-character marker is a call to that tool;
the rest of the text is its argument string, which the tool parses. A tool with an
empty marker is called by any turn its grammar accepts (the calculator: ``47*38``).
Any other text is not a call (for the calculator task: the final answer). A result goes
back to the model as ``<result_marker><result>``, encoded once and appended as it is.

One parser serves both paths into an environment: the episode runner's (the env
parses the model's turn) and the OpenAI-compatible endpoint's (the server turns the
same text into ``tool_calls`` of the response, the agent answers with a ``tool``
message, and the chat template renders it exactly as the env would).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from workers.envs.base import ToolCallParseError


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: which tool, its raw argument text and its parsed arguments."""

    name: str
    raw: str
    arguments: Mapping[str, Any]


class Tool(Protocol):
    """A tool an environment (or an agent) executes."""

    name: str
    #: the character that starts a call to it in the model's text
    marker: str

    def parse(self, raw: str) -> Mapping[str, Any]:
        """Arguments from the text after the marker; ToolCallParseError if malformed."""
        ...

    def run(self, arguments: Mapping[str, Any]) -> str:
        """Execute the call; the result as text."""
        ...


@dataclass(frozen=True)
class ToolCallFormat:
    """Which markers call which tools, and how a result is shown to the model."""

    tools: tuple[Tool, ...]
    #: prefix of a tool result in the model's context
    result_marker: str = ">"

    def __post_init__(self) -> None:
        markers = [t.marker for t in self.tools]
        if len(set(markers)) != len(markers) or any(len(m) > 1 for m in markers):
            raise ValueError(f"tool markers must be distinct, at most one character: {markers}")

    def tool(self, name: str) -> Tool:
        for t in self.tools:
            if t.name == name:
                return t
        known = ", ".join(t.name for t in self.tools)
        raise ToolCallParseError(f"unknown tool {name!r} (known: {known})")

    def parse(self, text: str) -> ToolCall | None:
        """The call in ``text``, None if it is not a call; ToolCallParseError if it
        starts with a tool's marker but its arguments do not parse. A tool with an empty
        marker is called by any text its own grammar accepts (and nothing else)."""
        for t in self.tools:
            if t.marker and text.startswith(t.marker):
                raw = text[len(t.marker):]
                return ToolCall(t.name, raw, t.parse(raw))
        for t in self.tools:
            if not t.marker:
                try:
                    return ToolCall(t.name, text, t.parse(text))
                except ToolCallParseError:
                    continue
        return None

    def render_call(self, name: str, raw: str) -> str:
        return self.tool(name).marker + raw

    def render_result(self, result: str) -> str:
        return self.result_marker + result


_EXPRESSION = re.compile(r"(\d{1,9})([+\-*])(\d{1,9})")


@dataclass(frozen=True)
class Calculator:
    """Integer arithmetic on two operands: ``47*38`` -> ``1786``."""

    name: str = "calculator"
    #: none: an arithmetic expression is a call by its shape
    marker: str = ""

    def parse(self, raw: str) -> Mapping[str, Any]:
        match = _EXPRESSION.fullmatch(raw)
        if match is None:
            raise ToolCallParseError(
                f"{self.name} call {self.marker + raw!r} does not parse: expected "
                f"{self.marker}<integer><+|-|*><integer>, e.g. {self.marker}47*38"
            )
        return {"expression": raw}

    def run(self, arguments: Mapping[str, Any]) -> str:
        expression = arguments.get("expression")
        match = _EXPRESSION.fullmatch(expression) if isinstance(expression, str) else None
        if match is None:
            raise ToolCallParseError(
                f"{self.name}: arguments {dict(arguments)!r} need 'expression' like '47*38'"
            )
        a, op, b = int(match[1]), match[2], int(match[3])
        return str(a + b if op == "+" else a - b if op == "-" else a * b)
