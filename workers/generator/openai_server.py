"""An OpenAI-compatible chat-completions endpoint served by a generator.

Agent code written for the OpenAI client runs unchanged against a generator's model::

    client = OpenAI(base_url=server.session_url("episode-7"), api_key="unused")
    reply = client.chat.completions.create(model="policy", messages=[...])

One session per episode, named in the URL (``/sessions/<id>/v1/chat/completions``;
plain ``/v1/chat/completions`` takes it from the body's ``session_id``, e.g. the
client's ``extra_body``). Each request must resend the conversation so far exactly
(``workers.envs.chat``): the session appends only the new messages' ids and the model's
sampled ids, so the trajectory it hands the trainer (:meth:`OpenAIServer.trajectory`)
is token for token what the model saw and produced. The response carries, beside the
standard fields, ``token_ids`` (the completion's ids, EOS included) and
``prompt_token_ids`` per choice, and standard ``logprobs`` with each token's sampling
logprob. Every completion passes through the turn recorder, like the episode runner's.

Errors are JSON ``{"error": {"message", "type"}}`` with status 400 (a request the
session cannot serve exactly; the session is left as it was), 404 (unknown path, a GET,
or a session that has ended or, on a server that opens none on request, was never
opened) or 500 (the server's own fault, e.g. the sampler raising); the message names
the problem.

A server lives as long as its generator and serves every episode of it, so an episode
leaves nothing behind: :meth:`OpenAIServer.end_session` drops the session, its last
reply and its turns in the server's own record (a recorder handed in belongs to its
caller, who keeps or drops it). A request to an ended session is a 404 naming it, never
a fresh session that nobody would end. A server that opens sessions on request keeps
the ids it ended (the ids only) to tell them apart from new ones; the generator's
server (``open_on_request=False``, ``workers.envs.agent``) opens none on request and
keeps nothing. A request still waiting when its session ends is refused, keeping nothing.
A resend of the request the session's last reply answered (the client retries
one whose reply it lost) gets that reply again, without sampling.
The server is a ``ThreadingHTTPServer`` bound to loopback by default. Each session's
requests are served in turn and the model samples for one request at a time; sessions
are otherwise independent, so one whose (durable) recorder waits for the log to take
a pause holds up no other. Each completion also carries ``step_key``, its turn's
idempotency key, for the agent's tools to deduplicate by (``workers.envs.agent``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import quote, unquote, urlsplit


from workers.envs.base import StepKey
from workers.envs.chat import ChatRequestError, ChatSession, PlainTemplate, serve_turn
from workers.envs.recorder import (
    InMemoryTurnRecorder,
    ModelTurn,
    ReplayMismatchError,
    TurnRecorder,
    TurnRequest,
)
from workers.envs.sampler import HoldingWeights, TurnSampler, generator_sampler
from workers.envs.tools import ToolCallFormat
from workers.envs.trajectory import Trajectory
from workers.models.config import SamplingSection
from workers.models.factory import context_len

#: request fields the endpoint accepts (others are refused, not silently ignored)
_KNOWN = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "n",
          "stream", "logprobs", "top_logprobs", "session_id", "tools", "tool_choice", "seed"}


class SessionNotOpenError(LookupError):
    """A request names a session that has ended, or that this server would not open."""


class OpenAIServer:
    """Chat completions over one model, one :class:`ChatSession` per episode."""

    def __init__(
        self,
        sampler: TurnSampler,
        template: PlainTemplate,
        context_len: int,
        *,
        run_id: str = "run",
        temperature: float = 1.0,
        max_tokens: int = 16,
        recorder: TurnRecorder | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        open_on_request: bool = True,
    ) -> None:
        self.sampler, self.template, self.context_len = sampler, template, context_len
        self.run_id, self.temperature, self.max_tokens = run_id, temperature, max_tokens
        #: where completions are recorded; None: the server's own record, from which an
        #: ended session's turns are dropped
        self.recorder: TurnRecorder | None = recorder
        self._own_record = InMemoryTurnRecorder()
        #: whether a request naming an unknown session opens it (else: 404)
        self.open_on_request = open_on_request
        #: ids of ended sessions, refused by name (kept only when sessions open on request)
        self._ended: set[str] = set()
        self.sessions: dict[str, ChatSession] = {}
        #: each session's last response, answered again to a client's retry of it
        self._replies: dict[str, dict[str, Any]] = {}
        #: a session's own recorder and sampler (an episode group's), where it has them
        self._bound: dict[str, tuple[TurnRecorder, TurnSampler]] = {}
        #: the sessions' table; each session's requests; the model (one sample at a time)
        self._lock = threading.Lock()
        self._session_locks: dict[str, threading.Lock] = {}
        self._model_lock = threading.Lock()
        self._http = ThreadingHTTPServer((host, port), _handler(self.handle))
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    @classmethod
    def for_generator(
        cls, gen: Any, sampling: SamplingSection, tools: ToolCallFormat | None = None,
        *, seed: int = 0, **kwargs: Any,
    ) -> OpenAIServer:
        """Serve ``gen``'s model (a ``workers.generator.Generator``) at its current weights.

        Each completion holds the generator's weights like a group does (a refit lands
        between token steps and the turn records both versions), so the generator serves
        either a group or a completion at a time, never both at once.
        """
        sampler = generator_sampler(gen, sampling, seed)
        kwargs.setdefault("run_id", gen.run_id)
        return cls(HoldingWeights(sampler, gen.weights), PlainTemplate(gen.tokenizer, tools),
                   context_len(gen.model), temperature=sampling.temperature,
                   max_tokens=sampling.max_new_tokens, **kwargs)

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def session_url(self, session_id: str) -> str:
        """The ``base_url`` an OpenAI client uses for one episode."""
        # quoted whole: an id with '/', a space or non-ASCII stays one path segment
        return f"{self.url}/sessions/{quote(session_id, safe='')}/v1"

    def start(self) -> OpenAIServer:
        """Serve in a background thread (a no-op if already serving)."""
        if not self._thread.is_alive():
            self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for a serve loop that never ran
            self._http.shutdown()
        self._http.server_close()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open_session(
        self, session_id: str, key: StepKey, *,
        recorder: TurnRecorder | None = None, sampler: TurnSampler | None = None,
    ) -> None:
        """Open ``session_id`` with its recorder key (an episode's: run, group, sample),
        before the client's first request; a session opened by a request is keyed
        (run, session id, 0). ``recorder`` and ``sampler`` (both or neither) serve this
        session instead of the server's: a durable recorder blocks a request while the
        log takes a pause, and only that session's requests wait for it."""
        with self._lock:
            if session_id in self.sessions:
                raise ValueError(f"session {session_id!r} is already open")
            self._ended.discard(session_id)  # opened again on purpose
            self.sessions[session_id] = ChatSession(key, self.template, self.context_len)
            if recorder is not None and sampler is not None:
                self._bound[session_id] = (recorder, sampler)

    def end_session(self, session_id: str) -> Trajectory:
        """Free the session (the client is done with it); its trajectory. Later requests
        naming it get a 404."""
        with self._lock:
            session = self.sessions.pop(session_id, None)
            if session is None:
                raise KeyError(f"no open session {session_id!r}")
            self._replies.pop(session_id, None)
            self._bound.pop(session_id, None)
            self._session_locks.pop(session_id, None)
            self._own_record.forget(session.key)
            if self.open_on_request:
                self._ended.add(session_id)
            return session.trajectory

    def trajectory(self, session_id: str) -> Trajectory:
        """The session's exact token trajectory (set per-turn rewards on it to train)."""
        if session_id not in self.sessions:
            raise KeyError(f"no session {session_id!r}")
        return self.sessions[session_id].trajectory

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Serve one POST; returns (status, JSON body)."""
        parts = urlsplit(path).path.strip("/").split("/")
        if parts[-2:] != ["chat", "completions"]:
            return 404, _error(f"unknown path {path!r}; POST .../v1/chat/completions", "not_found")
        session_id = (unquote(parts[1]) if parts[0] == "sessions" and len(parts) == 5
                      else body.get("session_id"))
        try:
            if not isinstance(session_id, str) or not session_id:
                raise ChatRequestError(
                    "no session: use base_url .../sessions/<id>/v1 or send 'session_id'"
                )
            with self._lock:
                session_lock = self._session_locks.setdefault(session_id, threading.Lock())
            with session_lock:
                return 200, self._complete(session_id, body)
        except SessionNotOpenError as err:
            with self._lock:  # no lock kept for a session that is not open
                if session_id not in self.sessions:
                    self._session_locks.pop(session_id, None)
            return 404, _error(str(err), "not_found")
        except (ChatRequestError, ReplayMismatchError) as err:
            # a mismatch is the agent's doing: a replayed session asked other than it did
            return 400, _error(str(err), "invalid_request_error")
        except Exception as err:  # a fault of the server's, not of the request
            return 500, _error(f"the server failed: {type(err).__name__}: {err}", "server_error")

    def _complete(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        max_tokens = self._check(body)
        with self._lock:
            session = self.sessions.get(session_id)
            if session is None:
                session = self._opened_by_request(session_id)
            own = self.recorder if self.recorder is not None else self._own_record
            recorder, sampler = self._bound.get(session_id, (own, self.sampler))
        if session.is_resend(body["messages"]):
            return self._replies[session_id]  # served once, never sampled twice
        prompt_len = len(session.trajectory.input_ids)
        message, turn = serve_turn(session, recorder, _Serialized(sampler, self._model_lock),
                                   body["messages"], max_tokens)
        prompt_ids = session.trajectory.input_ids[: session.trajectory.turns[-1].start]
        reply = _response(session_id, body.get("model", "policy"), message, turn, prompt_ids,
                          self.template.tokenizer.decode, prompt_len)
        with self._lock:  # ended while the request waited (at a pause): keep nothing of it
            if self.sessions.get(session_id) is not session:
                raise SessionNotOpenError(
                    f"session {session_id!r} ended while its request waited; nobody is left "
                    "to answer")
            self._replies[session_id] = reply
        # the turn's idempotency key: the agent's tools deduplicate their effects by it
        reply["step_key"] = str(session.key.at(len(session.trajectory.turns)))
        if session.tool_call_error:
            reply["choices"][0]["tool_call_error"] = session.tool_call_error
        return reply

    def _opened_by_request(self, session_id: str) -> ChatSession:
        if session_id in self._ended:
            raise SessionNotOpenError(
                f"session {session_id!r} has ended; a new episode needs a new session id")
        if not self.open_on_request:
            raise SessionNotOpenError(
                f"session {session_id!r} is not open: it has ended, or was never opened "
                "(this server's sessions are opened by the generator, one per episode)")
        key = StepKey(self.run_id, session_id, 0, 0)
        session = self.sessions[session_id] = ChatSession(key, self.template, self.context_len)
        return session

    def _check(self, body: dict[str, Any]) -> int:
        # a field sent as null asks for nothing (agent frameworks send their unset ones)
        unknown = sorted(k for k in set(body) - _KNOWN if body[k] is not None)
        if unknown:
            raise ChatRequestError(f"unsupported request field(s) {unknown}")
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise ChatRequestError("'messages' must be a non-empty list")
        if body.get("stream"):
            raise ChatRequestError("stream=true is not supported")
        if body.get("n") not in (None, 1):
            raise ChatRequestError(f"n must be 1 (one episode per session), got {body['n']!r}")
        if body.get("top_logprobs"):
            raise ChatRequestError(
                f"top_logprobs is not offered (got {body['top_logprobs']!r}); each token's "
                "own logprob comes with logprobs=true")
        self._check_tools(body)
        temperature = body.get("temperature")
        if temperature is not None and (
            not isinstance(temperature, (int, float)) or isinstance(temperature, bool)
        ):
            raise ChatRequestError(f"temperature must be a number, got {temperature!r}")
        if temperature is not None and float(temperature) != self.temperature:
            raise ChatRequestError(
                f"temperature must be {self.temperature} (the run's sampling temperature, "
                f"which the trainer's logprobs assume), got {temperature}"
            )
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ChatRequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        return max_tokens

    def _check_tools(self, body: dict[str, Any]) -> None:
        """The model calls the tools of the server's format, nothing else: a request that
        asks for other tools, or forbids or forces calls, cannot be honoured."""
        if body.get("tool_choice") not in (None, "auto"):
            raise ChatRequestError(
                f"tool_choice {body['tool_choice']!r} is not offered: the model decides "
                "whether a turn is a call ('auto')")
        known = [t.name for t in self.template.tools.tools] if self.template.tools else []
        for i, tool in enumerate(body.get("tools") or []):
            name = (tool.get("function") or {}).get("name") if isinstance(tool, dict) else None
            if name not in known:
                raise ChatRequestError(
                    f"tools[{i}]: tool {name!r} is not one this model calls "
                    f"(its tools: {known or 'none'})")


def _response(
    session_id: str,
    model: str,
    message: dict[str, Any],
    turn: ModelTurn,
    prompt_ids: list[int],
    decode: Callable[[list[int]], str],
    new_prompt_start: int,
) -> dict[str, Any]:
    finish = "tool_calls" if message.get("tool_calls") else "stop" if turn.stopped else "length"
    content = [
        {"token": decode([t]), "logprob": lp, "bytes": list(decode([t]).encode()), "top_logprobs": []}
        for t, lp in zip(turn.tokens, turn.logprobs)
    ]
    return {
        "id": f"chatcmpl-{session_id}-{len(prompt_ids)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0, "message": message, "finish_reason": finish,
            "logprobs": {"content": content, "refusal": None},
            # extensions: the exact ids (what the trajectory trains on)
            "token_ids": list(turn.tokens),
            "prompt_token_ids": list(prompt_ids),
        }],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(turn.tokens),
                  "total_tokens": len(prompt_ids) + len(turn.tokens),
                  "new_prompt_tokens": len(prompt_ids) - new_prompt_start},
        "weight_version": [turn.version_start, turn.version_end],
    }


class _Serialized:
    """A sampler used by one request at a time: the model is one, its sessions many."""

    def __init__(self, sampler: TurnSampler, lock: threading.Lock) -> None:
        self.sampler, self.lock = sampler, lock

    def generate(self, requests: Sequence[TurnRequest]) -> list[ModelTurn]:
        with self.lock:
            return self.sampler.generate(requests)


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _handler(handle: Callable[[str, dict[str, Any]], tuple[int, dict[str, Any]]]) -> type:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
            except ValueError as err:
                status, out = 400, _error(f"invalid JSON body: {err}", "invalid_request_error")
            else:
                status, out = handle(self.path, body)
            self._send(status, out)

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            # JSON, and not a 5xx the OpenAI client would retry (e.g. models.list())
            self._send(404, _error(
                f"unknown path {self.path!r}: only POST .../v1/chat/completions is served",
                "not_found"))

        def _send(self, status: int, out: dict[str, Any]) -> None:
            data = json.dumps(out).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except ConnectionError:
                # the client left (its timeout ran out while the request waited at a
                # pause): nobody to answer, and no fault of the server's to print
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the run's logs record episodes, not HTTP lines

    return Handler
