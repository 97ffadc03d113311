"""The Redis store's connection helpers: the pinned hot-path connection, URL redaction,
script calls, and the translation of redis-py's errors into the store's own."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import redis
from redis import exceptions as rex
from redis.sentinel import MasterNotFoundError

try:  # redis-py's own packer when hiredis is installed (a dependency): C, one call
    from hiredis import pack_command as _pack_command
except ImportError:  # pragma: no cover - then every command goes through redis-py's packer
    _pack_command = None

from events.errors import (
    StoreDataError, StorePermissionError, StoreUnavailableError, StoreUrlError,
)
from events.redis_store.url import redact_url

if TYPE_CHECKING:
    from events.redis_store.layout import Script


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
        packed = pack(args)
        if packed is None:
            return self._call(lambda conn: (conn.send_command(*args), conn.read_response())[1])
        return self._call(lambda conn: (conn.send_packed_command(packed), conn.read_response())[1])

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


def pack(args: tuple[Any, ...]) -> list[bytes] | None:
    """One command as RESP bytes, ready for ``send_packed_command``; None without hiredis.

    The bytes redis-py would send (its hiredis packer makes the same call), less its
    wrapper: a command name split on spaces and a per-argument type check over an
    append's ~35 arguments; a 5-pause append's round trip costs ~36 us of client CPU
    this way against ~42 us through ``send_command`` (``bench/bench_append_cpu.py``).
    hiredis takes str, int, float and bytes (every command the store sends); what it
    refuses is left to redis-py (None), whose packer turns a bytearray or memoryview
    into bytes first and raises its own ``DataError`` for the rest. So is a name with a
    space in it (``"CONFIG GET"``), which redis-py splits.
    """
    name = args[0]
    if _pack_command is None or (" " if isinstance(name, str) else b" ") in name:
        return None
    try:
        return [_pack_command(args)]
    except TypeError:
        return None


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


def run_script(client: Any, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """EVALSHA, falling back to EVAL when the server lacks the script (restart, flush)."""
    try:
        return client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    except rex.NoScriptError:
        return client.execute_command("EVAL", script.source, len(keys), *keys, *args)


class HandshakeBoundedSSLConnection(redis.SSLConnection):
    """A ``rediss://`` connection whose TLS handshake is bounded by the connect timeout.

    redis-py runs the handshake under the command timeout (30 s in the CLI). A plain
    Redis port reads the ClientHello as the start of an inline command and waits for
    the rest, so a rediss:// URL naming it waited that long before its one line.
    """

    def _wrap_socket_with_ssl(self, sock: socket.socket) -> Any:
        sock.settimeout(self.socket_connect_timeout)
        try:
            tls = super()._wrap_socket_with_ssl(sock)
        except socket.timeout:
            raise rex.TimeoutError(f"no TLS handshake within {self.socket_connect_timeout} s "
                                   "(the connect timeout)") from None
        tls.settimeout(self.socket_timeout)
        return tls


def tls_bounded(url: str) -> dict[str, Any]:
    """redis-py's keyword for a URL's connections: rediss:// bounds its TLS handshake."""
    return {"connection_class": HandshakeBoundedSSLConnection} if url.startswith("rediss://") else {}


@contextlib.contextmanager
def translate_errors(safe_url: str, key: str = "") -> Iterator[None]:
    """redis-py's connection, replica, permission and auth errors as the store's own;
    ``key``: the key the commands read, named when it holds another Redis type."""
    try:
        yield
    except (rex.ConnectionError, rex.TimeoutError) as err:
        raise unavailable(safe_url, err) from err
    except rex.ReadOnlyError as err:  # a demoted primary: writes go elsewhere now
        raise StoreUnavailableError(
            f"Redis at {safe_url} is a read-only replica (after a failover the "
            f"primary is elsewhere; --redis-sentinel follows it): {err}"
        ) from err
    except rex.NoPermissionError as err:
        raise StorePermissionError(
            f"Redis at {safe_url} refused a command: {one_line(err)}"
        ) from err
    except rex.ResponseError as err:
        if str(err).startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
            raise unavailable(safe_url, err) from err
        # a key of another type, a counter that is not a number (HINCRBY); a pipeline's
        # error names its key itself
        if "WRONGTYPE" in str(err) or "hash value is not an integer" in str(err):
            raise StoreDataError(  # no address: the dashboard shows this line
                f"{f'key {key}' if key else 'a key'} holds another kind of value than "
                f"rl-controller writes there ({one_line(err)}); it was changed outside "
                "rl-controller"
            ) from err
        if "DB index is out of range" in str(err):  # SELECT of the URL's /DB at connect
            raise StoreUnavailableError(
                f"Redis at {safe_url} is unavailable: it has no database with the number "
                "the URL names after the port (the server's 'databases' setting caps it)"
            ) from err
        raise


def unavailable(safe_url: str, err: Exception) -> StoreUnavailableError:
    """The error for a server that cannot be reached or refused us, with the likely why."""
    reason = one_line(err)
    if isinstance(err, MasterNotFoundError):
        # redis-py appends the repr of every sentinel's client (a few hundred characters
        # each) after " : "; the name asked for is what the user can act on
        reason = (f"{reason.split(' : ', 1)[0]} (did any sentinel answer? are they up "
                  "and monitoring that --redis-master name?)")
    elif isinstance(err, (rex.AuthenticationError, rex.ResponseError)):
        reason = f"authentication failed (check the password in the URL): {reason}"
    elif "CERTIFICATE_VERIFY_FAILED" in reason:
        reason = (
            "TLS certificate verification failed: the server's certificate is not signed "
            "by the CA given (ssl_ca_certs in the URL) or does not name this host"
        )
    elif reason.startswith("no TLS handshake") or "WRONG_VERSION_NUMBER" in reason:
        # no answer, or one that is not TLS (a plain port that answered the ClientHello)
        reason = (f"{reason.split(' (_ssl', 1)[0]}: is this a plain Redis port? "
                  "Then the URL is redis://")
    elif safe_url.startswith("rediss://"):
        reason = f"{reason} (TLS: does the server accept TLS on this port?)"
    return StoreUnavailableError(f"Redis at {safe_url} is unavailable: {reason}")


def check_url_options(client: Any, safe_url: str) -> None:
    """Refuse a URL parameter redis-py does not know for the URL's kind of connection.

    redis-py hands every query parameter it does not parse itself to the connection's
    constructor, so ``?ssl_ca_certs=...`` on a ``redis://`` URL (or a typo) would be a
    TypeError traceback at the first command. Building one connection object here (it
    opens no socket) asks the same constructor first.
    """
    pool = client.connection_pool
    try:
        pool.connection_class(**pool.connection_kwargs)
    except TypeError as err:
        name = str(err).rpartition("argument ")[2].strip("'")
        hint = " (TLS parameters need a rediss:// URL)" if name.startswith("ssl") else ""
        scheme = safe_url.partition("://")[0]
        raise StoreUrlError(
            f"{safe_url!r}: redis-py knows no URL parameter {name!r} for a {scheme}:// "
            f"connection{hint}"
        ) from None


def compiled_parser(client: Any) -> bool:
    """True when ``client`` is redis-py's own and parses replies with ``hiredis``."""
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:  # pragma: no cover - very old redis-py
        return False
    return bool(HIREDIS_AVAILABLE) and type(client).__module__.startswith("redis.")


def answers_ping(url: str, timeout_s: float = 2.0) -> bool:
    """True when a server at ``url`` answers PING (False while loading, or unreachable).

    The embedded-server manager asks this instead of speaking the protocol itself.
    """
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except rex.RedisError:
        return False
    finally:
        client.close()


def one_line(err: Exception) -> str:
    return " ".join(str(err).split()) or type(err).__name__
