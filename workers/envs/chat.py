"""A chat session over exact token ids: the model side of the OpenAI-compatible endpoint.

Agent code sends the whole conversation with every request, as the OpenAI API wants.
Re-encoding that text would not give back the ids the model generated (a BPE merges
differently across a turn boundary, a char model drops padding), so a session never
re-encodes what it has already seen: it keeps the trajectory's ids, checks that the
request's history is exactly the conversation so far, encodes only the new messages
(user, system or tool; never an assistant message it did not write), and appends the
model's sampled ids as they came out. The trajectory trains on those ids.

Messages render through a :class:`PlainTemplate`: a message's content is encoded as it
is; a tool result as the tool format's ``<result_marker><content>`` -- the same ids an
environment's observation would have -- and an assistant turn that the tool format
parses as a call is returned as ``tool_calls``. A chat template with role headers
(an HF tokenizer's) would render the same way, one message at a time.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.envs.base import Action, StepKey, ToolCallParseError
from workers.envs.recorder import (
    ModelTurn,
    StepOutcome,
    TurnRecorder,
    TurnRequest,
    digest,
    external_call,
)
from workers.envs.sampler import TurnSampler
from workers.envs.tools import ToolCallFormat
from workers.envs.trajectory import Trajectory
from workers.models.factory import Tokenizer


class ChatRequestError(ValueError):
    """A request the session cannot serve token-exactly (the message says why)."""


@dataclass(frozen=True)
class PlainTemplate:
    """Each message's content as is; tool results behind the tool format's marker."""

    tokenizer: Tokenizer
    tools: ToolCallFormat | None = None

    def render(self, message: Mapping[str, Any], index: int) -> list[int]:
        role, content = message.get("role"), message.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if role not in ("system", "user", "tool", "developer") or not isinstance(content, str):
            raise ChatRequestError(
                f"message {index}: expected role system/developer/user/tool with text "
                f"content, got role {role!r} with content {type(content).__name__}"
            )
        if role == "tool" and self.tools is not None:
            content = self.tools.render_result(content)
        try:
            return self.tokenizer.encode(content)
        except ValueError as err:
            raise ChatRequestError(f"message {index} cannot be encoded: {err}") from None


@dataclass
class ChatSession:
    """One episode seen through chat completions."""

    key: StepKey
    template: PlainTemplate
    context_len: int
    trajectory: Trajectory = field(init=False)
    #: the conversation so far, as the client must send it back
    history: list[dict[str, Any]] = field(default_factory=list)
    #: why the last turn, which starts like a tool call, is not one ("" if it is, or is text)
    tool_call_error: str = ""
    #: the result of the last turn that the latest request brought (its new messages)
    answered: tuple[StepKey, StepOutcome] | None = None

    def __post_init__(self) -> None:
        self.trajectory = Trajectory(self.key)

    def prepare(self, messages: Sequence[Mapping[str, Any]], max_tokens: int) -> TurnRequest:
        """Check the history, append the new messages' ids; the next turn's request.

        A refused request leaves the session as it was (:func:`serve_turn` restores it),
        so the client can correct the request and send it again."""
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise ChatRequestError(f"message {i} must be a JSON object, got {type(m).__name__}")
        if len(messages) <= len(self.history):
            raise ChatRequestError(
                f"the request has {len(messages)} messages; the session already holds "
                f"{len(self.history)}: send the whole conversation plus a new message"
            )
        for i, (sent, held) in enumerate(zip(messages, self.history)):
            if _canonical(sent) != _canonical(held):
                raise ChatRequestError(
                    f"message {i} ({held.get('role')}) differs from this session's history: "
                    "token-in-token-out needs the exact conversation (start a new session "
                    "to change it)"
                )
        ids: list[int] = []
        new = messages[len(self.history):]
        for i in range(len(self.history), len(messages)):
            if messages[i].get("role") == "assistant":
                raise ChatRequestError(
                    f"message {i}: an assistant message this session did not generate"
                )
            ids += self.template.render(messages[i], i)
            self.history.append(dict(messages[i]))
        self.answered = None
        if not self.trajectory.turns:
            self.trajectory.append_observation(ids)
        else:
            # the last turn's call answered: its observation, and what was sent (a tool
            # call's id is not in the ids, yet a replay must send it back the same)
            self.answered = (self.key.at(len(self.trajectory.turns)), StepOutcome(
                0.0, False, "", tuple(ids), {"messages": digest(*map(_canonical, new))}))
            self.trajectory.close_turn(0.0, ids, {})
        room = self.context_len - len(self.trajectory.input_ids)
        if room < 1:
            raise ChatRequestError(
                f"the conversation is {len(self.trajectory.input_ids)} tokens; the model's "
                f"context of {self.context_len} leaves no room for a reply"
            )
        turn = len(self.trajectory.turns) + 1
        return TurnRequest(self.key.at(turn), tuple(self.trajectory.input_ids), min(max_tokens, room))

    def is_resend(self, messages: Sequence[Mapping[str, Any]]) -> bool:
        """``messages`` is the request the session's last reply answered, sent again (a
        client retries a request whose reply it did not receive)."""
        if not self.history or self.history[-1].get("role") != "assistant":
            return False
        asked = self.history[:-1]
        return len(messages) == len(asked) and all(
            isinstance(m, Mapping) and _canonical(m) == _canonical(h)
            for m, h in zip(messages, asked)
        )

    def complete(self, turn: ModelTurn) -> dict[str, Any]:
        """Append the model's turn; the assistant message the client will send back."""
        self.trajectory.append_turn(len(self.trajectory.turns) + 1, turn)
        text = self.template.tokenizer.decode(list(turn.tokens))
        message: dict[str, Any] = {"role": "assistant", "content": text}
        call, self.tool_call_error = None, ""
        if self.template.tools is not None:
            try:
                call = self.template.tools.parse(text)
            except ToolCallParseError as err:
                # not a well-formed call: the client sees the text, and why it is not a call
                self.tool_call_error = str(err)
        if call is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{self.key.group}_{self.key.sample}_{len(self.trajectory.turns)}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(dict(call.arguments))},
            }]}
        self.history.append(message)
        return message


def _canonical(message: Mapping[str, Any]) -> dict[str, Any]:
    """What must match between a resent message and the recorded one."""
    out: dict[str, Any] = {"role": message.get("role"), "content": message.get("content") or None}
    calls = message.get("tool_calls")
    if calls:
        try:
            out["tool_calls"] = [
                (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in calls
            ]
        except (KeyError, TypeError, ValueError):
            out["tool_calls"] = ("malformed", repr(calls))  # matches no call the session made
    return out


def serve_turn(
    session: ChatSession,
    recorder: TurnRecorder,
    sampler: TurnSampler,
    messages: Sequence[Mapping[str, Any]],
    max_tokens: int,
) -> tuple[dict[str, Any], ModelTurn]:
    """One chat completion of ``session``: through the recorder, like every model turn.

    The turn's call is whatever the agent does with the completion (its tools), so it
    is recorded in two steps: its intent before the completion is returned, its result
    (the next request's new messages, as observation ids) when that request comes; the
    agent's reward closes the last turn (``workers.envs.agent``). A replayed session is
    checked at both: another context or other new messages is a ``ReplayMismatchError``
    naming the turn.

    A request refused or failed on the way (a message that cannot be encoded, no room
    in the context, the sampler raising) leaves the session exactly as it was: a
    half-appended request would shift every later id, or refuse the corrected resend.
    """
    saved = copy.deepcopy(session.trajectory), list(session.history)
    try:
        request = session.prepare(messages, max_tokens)
        if session.answered is not None:  # the last turn's result, before the next turn
            recorder.env_completed([session.answered])
        (turn,) = recorder.model_turns([request], sampler.generate)
        message = session.complete(turn)
        # the intent: in the record before the agent sees the turn (and acts on it)
        action = Action(session.template.tokenizer.decode(list(turn.tokens)), turn.tokens, turn.stopped)
        recorder.env_requested([external_call(
            request.key, action, digest(request.context, turn.tokens, turn.stopped))])
        return message, turn
    except BaseException:
        session.trajectory, session.history = saved
        raise
