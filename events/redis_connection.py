"""The Redis store's connection helpers: the pinned hot-path connection and URL redaction."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis import exceptions as rex


def redact_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))


class PinnedConnection:
    """One connection held out of the client's pool for the controller's hot path.

    Appends and epoch checks are a few commands per group; through the client each
    costs about 2.5x the CPU of the round trip itself (command routing, retry and
    observability layers). This sends on a connection redis-py set up (so AUTH, TLS and
    the database are its), and keeps the client's retry semantics: a command that hit
    a connection error is sent again on a fresh connection (safe for appends, whose
    replays are recognised by event id), up to ``retries`` times and for at least
    ``retry_window_s`` (long enough to ride out a Sentinel failover when set).
    """

    def __init__(self, client: Any, retries: int = 3, retry_window_s: float = 0.0) -> None:
        self._pool = client.connection_pool
        self._retries = retries
        self._retry_window_s = retry_window_s
        self._conn: Any = None
        self._lock = threading.Lock()

    def execute_command(self, *args: Any) -> Any:
        return self._call(lambda conn: (conn.send_command(*args), conn.read_response())[1])

    def execute_many(self, *commands: tuple[Any, ...]) -> list[Any]:
        """Several commands in one round trip on one connection (``WAIT`` needs that).

        Every reply is read before the first error reply is raised, so the connection
        stays in step.
        """
        return self._call(lambda conn: send_many(conn, commands))

    def _call(self, send: Callable[[Any], Any]) -> Any:
        with self._lock:
            attempt = 0
            deadline = time.monotonic() + self._retry_window_s
            while True:
                try:
                    if self._conn is None:
                        self._conn = self._connect()
                    return send(self._conn)
                except (rex.ConnectionError, rex.TimeoutError):
                    self._drop()
                    if attempt >= self._retries and time.monotonic() >= deadline:
                        raise
                    attempt += 1
                    time.sleep(min(0.05 * attempt, 0.5))

    def _connect(self) -> Any:
        try:
            return self._pool.get_connection()
        except TypeError:  # redis-py < 5.3 wants a command name
            return self._pool.get_connection("EVALSHA")

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.disconnect()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()


def send_many(conn: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    conn.send_packed_command(conn.pack_commands(commands))
    replies: list[Any] = []
    error: rex.ResponseError | None = None
    for _ in commands:
        try:
            replies.append(conn.read_response())
        except rex.ResponseError as err:
            error = error or err
            replies.append(err)
    if error is not None:
        raise error
    return replies


class Sequential:
    """``execute_many`` for a client handed in (fakeredis): one command after another."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def execute_command(self, *args: Any) -> Any:
        return self._client.execute_command(*args)

    def execute_many(self, *commands: tuple[Any, ...]) -> list[Any]:
        return [self._client.execute_command(*c) for c in commands]
