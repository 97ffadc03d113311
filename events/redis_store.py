"""RedisEventStore: the run log as a Redis Stream. The only module that imports ``redis``.

Keys per run (the braces are a Redis Cluster hash tag, so the append script's two keys
always live in one slot)::

    rlc:{<run_id>}:events     stream; entry id 0-<position>, fields type / id / data / h
    rlc:{<run_id>}:meta       hash; epoch (the fencing token), chain_head, chain_len
    rlc:{<run_id>}:snapshot   hash; position, data, chain (newest snapshot only)
    rlc:runs                  set of run ids

``data`` is the event's JSON (``events.codec``), so ``redis-cli XRANGE`` shows the log;
``h`` is the entry's hash-chain link (``events.chain``).
The stream is never trimmed: it is the source of truth.

An append is ONE server-side Lua script (EVALSHA, EVAL when the server lost it), so a
batch is one round trip and one fsync under ``appendfsync always``, and the fencing
check, the position check, the idempotent-retry comparison and the XADDs are atomic.
Works on Redis >= 6.2 (no FUNCTION, no server-side idempotency keys).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis import exceptions as rex

from events.chain import CHAIN_REFUSED, HASH_FIELD, ChainHead, ChainWriter, check_snapshot_link
from events.codec import encode
from events.errors import (
    ChainError,
    ConcurrencyError,
    EpochNotClaimedError,
    EventDecodeError,
    EventStoreError,
    FencedError,
    RunNotFoundError,
    StorePermissionError,
    StoreUnavailableError,
)
from events.replication import StoreConfig, check_confirmed, replicated_append, wait_command
from events.schema import Event, StoredEvent
from events.store import (
    READ_PAGE_SIZE,
    RawEntry,
    RunInfo,
    check_append_args,
    check_range,
    check_run_id,
    check_snapshot_position,
    decode_entries,
)

RUNS_KEY = "rlc:runs"

# KEYS: stream, meta. ARGV: epoch, expected position, n, previous chain hash ('' for
# the first entry or a log without a chain), chain algorithm (recorded with the first
# chained entry), then (type, id, data, h) * n; h is '' when
# the log has no chain. Replies {appended(1)|replayed(0), first position} or an error
# "RLC_<KIND> <n>". The chain check sits with the epoch and position checks: one script.
_APPEND_LUA = """
local epoch = tonumber(ARGV[1])
local expected = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local current = tonumber(redis.call('HGET', KEYS[2], 'epoch') or '0')
if epoch < current then return redis.error_reply('RLC_FENCED ' .. current) end
if epoch > current then return redis.error_reply('RLC_UNCLAIMED ' .. current) end
local len = redis.call('XLEN', KEYS[1])
if len == expected then
  local head = redis.call('HGET', KEYS[2], 'chain_head') or ''
  if ARGV[4] ~= head then return redis.error_reply('RLC_CHAIN ' .. len) end
  local h = ''
  for i = 1, n do
    local b = 5 + (i - 1) * 4
    h = ARGV[b + 4]
    if h == '' then
      redis.call('XADD', KEYS[1], '0-' .. (expected + i),
                 'type', ARGV[b + 1], 'id', ARGV[b + 2], 'data', ARGV[b + 3])
    else
      redis.call('XADD', KEYS[1], '0-' .. (expected + i),
                 'type', ARGV[b + 1], 'id', ARGV[b + 2], 'data', ARGV[b + 3], 'h', h)
    end
  end
  if h ~= '' then
    redis.call('HSET', KEYS[2], 'chain_head', h, 'chain_len', expected + n)
    if ARGV[4] == '' then redis.call('HSET', KEYS[2], 'chain_alg', ARGV[5]) end
  end
  return {1, expected + 1}
end
if len < expected then return redis.error_reply('RLC_BEHIND ' .. len) end
local entries = redis.call('XRANGE', KEYS[1], '0-' .. (expected + 1), '0-' .. (expected + n))
if #entries < n then return redis.error_reply('RLC_PARTIAL ' .. len) end
for i = 1, n do
  local fields = entries[i][2]
  local stored, h = false, ''
  for j = 1, #fields, 2 do
    if fields[j] == 'id' then stored = fields[j + 1] end
    if fields[j] == 'h' then h = fields[j + 1] end
  end
  if stored ~= ARGV[5 + (i - 1) * 4 + 2] then
    return redis.error_reply('RLC_MISMATCH ' .. len .. ' ' .. (expected + i))
  end
  if h ~= ARGV[5 + i * 4] then return redis.error_reply('RLC_CHAIN ' .. len) end
end
return {0, expected + 1}
"""

# KEYS: snapshot hash, stream. ARGV: position, data. Keeps the newest snapshot only,
# with the chain hash of the entry at its position ('' when none).
_SNAPSHOT_LUA = """
local cur = redis.call('HGET', KEYS[1], 'position')
if cur and tonumber(cur) > tonumber(ARGV[1]) then return 0 end
local h = ''
local e = redis.call('XRANGE', KEYS[2], '0-' .. ARGV[1], '0-' .. ARGV[1])
if #e == 1 then
  local f = e[1][2]
  for j = 1, #f, 2 do if f[j] == 'h' then h = f[j + 1] end end
end
redis.call('HSET', KEYS[1], 'position', ARGV[1], 'data', ARGV[2], 'chain', h)
return 1
"""

# KEYS: stream. ARGV: type, id, data. Unchecked append, for tests and repair tools.
_RAW_LUA = """
local pos = redis.call('XLEN', KEYS[1]) + 1
redis.call('XADD', KEYS[1], '0-' .. pos, 'type', ARGV[1], 'id', ARGV[2], 'data', ARGV[3])
return pos
"""


def events_key(run_id: str) -> str:
    return f"rlc:{{{run_id}}}:events"


def meta_key(run_id: str) -> str:
    return f"rlc:{{{run_id}}}:meta"


def snapshot_key(run_id: str) -> str:
    return f"rlc:{{{run_id}}}:snapshot"


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


class _Script:
    """A Lua script run with EVALSHA, falling back to EVAL when the server lacks it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except rex.NoScriptError:
            return client.execute_command("EVAL", self.source, len(keys), *keys, *args)


class _PinnedConnection:
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
        return self._call(lambda conn: _send_many(conn, commands))

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


def _send_many(conn: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
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


class _Sequential:
    """``execute_many`` for a client handed in (fakeredis): one command after another."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def execute_command(self, *args: Any) -> Any:
        return self._client.execute_command(*args)

    def execute_many(self, *commands: tuple[Any, ...]) -> list[Any]:
        return [self._client.execute_command(*c) for c in commands]


_APPEND = _Script(_APPEND_LUA)
_SNAPSHOT = _Script(_SNAPSHOT_LUA)
_RAW = _Script(_RAW_LUA)


class RedisEventStore:
    """EventStore over Redis Streams. See the module docstring for keys and the script.

    ``url`` is ``redis://[:password@]host:port[/db]`` or ``rediss://`` for TLS. Tests
    may pass a ready ``client`` (fakeredis) plus an ``async_client_factory`` for
    :meth:`follow`; ``url`` then only names the store in messages.

    redis-py retries a command after a connection error; that is safe for appends
    because a replayed batch is recognised by its event ids.
    """

    def __init__(
        self,
        url: str,
        *,
        client: Any | None = None,
        async_client_factory: Callable[[], Any] | None = None,
        connect_timeout_s: float = 5.0,
        command_timeout_s: float | None = 30.0,
        replication: StoreConfig | None = None,
        pin_client: bool = False,
        retry_window_s: float = 0.0,
        chain_key: bytes | None = None,
    ) -> None:
        self.url = url
        #: appends wait for this many replicas (``events.replication``)
        self.replication = (replication or StoreConfig()).check()
        self._chain = ChainWriter(chain_key)
        self._safe_url = redact_url(url)
        self._connect_timeout_s = connect_timeout_s
        self._async_factory = async_client_factory or self._default_async_client
        with self._translate():
            if client is None:
                client = redis.Redis.from_url(
                    url,
                    socket_connect_timeout=connect_timeout_s,
                    socket_timeout=command_timeout_s,  # also bounds a TLS handshake
                    decode_responses=False,
                )
                self._hot: Any = _PinnedConnection(client, retry_window_s=retry_window_s)
            elif pin_client:  # a real client set up elsewhere (Sentinel)
                self._hot = _PinnedConnection(client, retry_window_s=retry_window_s)
            else:
                self._hot = _Sequential(client)  # a client handed in (fakeredis)
            self._client = client
            self._client.ping()  # fail fast: bad host, password or TLS setup

    @property
    def client(self) -> Any:
        """The underlying redis client, for tools and benchmarks."""
        return self._client

    # -- errors --------------------------------------------------------------------

    @contextlib.contextmanager
    def _translate(self) -> Iterator[None]:
        try:
            yield
        except (rex.ConnectionError, rex.TimeoutError) as err:
            raise self._unavailable(err) from err
        except rex.ReadOnlyError as err:  # a demoted primary: writes go elsewhere now
            raise StoreUnavailableError(
                f"Redis at {self._safe_url} is a read-only replica (after a failover the "
                f"primary is elsewhere; --redis-sentinel follows it): {err}"
            ) from err
        except rex.NoPermissionError as err:
            raise StorePermissionError(
                f"Redis at {self._safe_url} refused a command: {_one_line(err)} (this Redis "
                "user may not do that; 'run' needs the controller user, see docs/security.md)"
            ) from err
        except rex.ResponseError as err:
            if str(err).startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
                raise self._unavailable(err) from err
            raise

    def _unavailable(self, err: Exception) -> StoreUnavailableError:
        reason = _one_line(err)
        if isinstance(err, (rex.AuthenticationError, rex.ResponseError)):
            reason = f"authentication failed (check the password in the URL): {reason}"
        elif "CERTIFICATE_VERIFY_FAILED" in reason:
            reason = (
                "TLS certificate verification failed: the server's certificate is not signed "
                "by the CA given (ssl_ca_certs in the URL) or does not name this host"
            )
        elif self._safe_url.startswith("rediss://"):
            reason = f"{reason} (TLS: does the server accept TLS on this port?)"
        return StoreUnavailableError(f"Redis at {self._safe_url} is unavailable: {reason}")

    def _default_async_client(self) -> Any:
        return redis.asyncio.Redis.from_url(
            self.url, socket_connect_timeout=self._connect_timeout_s, decode_responses=False
        )

    def _require_run(self, run_id: str) -> None:
        check_run_id(run_id)
        if not self.run_exists(run_id):
            raise RunNotFoundError(run_id, self._run_ids())

    def _run_ids(self) -> list[str]:
        with self._translate():
            return sorted(m.decode() for m in self._client.smembers(RUNS_KEY))

    # -- writes --------------------------------------------------------------------

    def claim_epoch(self, run_id: str) -> int:
        check_run_id(run_id)
        with self._translate():
            pipe = self._client.pipeline(transaction=False)
            pipe.hincrby(meta_key(run_id), "epoch", 1)
            pipe.sadd(RUNS_KEY, run_id)
            if self.replication.replicas:  # same connection, so WAIT covers the claim
                pipe.execute_command(*wait_command(self.replication))
            epoch, _, *waited = pipe.execute()
        if waited:
            check_confirmed(waited[0], self.replication, self._safe_url)
        return int(epoch)

    def append(
        self, run_id: str, events: Sequence[Event], *, expected_position: int, epoch: int
    ) -> list[int]:
        check_run_id(run_id)
        check_append_args(events, expected_position, epoch)
        entries = [(type(e).__name__, e.event_id, encode(e)) for e in events]
        prev, hashes = self._chain.batch(
            run_id, expected_position, entries, lambda p: self._hash_at(run_id, p)
        )
        alg = self._chain.algorithm
        args: list[Any] = [epoch, expected_position, len(events), prev, alg]
        for entry, link in zip(entries, hashes):
            args += (*entry, link)
        keys = (events_key(run_id), meta_key(run_id))
        try:
            with self._translate():
                if self.replication.replicas:
                    _, first = replicated_append(
                        self._hot, _APPEND, keys, args, self.replication,
                        run_id=run_id, where=self._safe_url,
                    )
                else:
                    _, first = _APPEND(self._hot, keys, args)
        except rex.ResponseError as err:
            self._chain.forget(run_id)
            raise _append_error(run_id, epoch, expected_position, str(err)) from None
        self._chain.appended(run_id, expected_position + len(events), hashes[-1])
        return list(range(int(first), int(first) + len(events)))

    def _hash_at(self, run_id: str, position: int) -> str:
        """The chain hash stored with the entry at ``position`` ("" when it has none)."""
        entries = self.read_raw(run_id, position, position, 1)
        return entries[0].chain if entries else ""

    def chain_head(self, run_id: str) -> ChainHead | None:
        """The chain head in the run's meta; None for a run without a chain."""
        self._require_run(run_id)
        with self._translate():
            head, length, alg = self._client.hmget(
                meta_key(run_id), ["chain_head", "chain_len", "chain_alg"]
            )
        if head is None:
            return None
        return ChainHead(_text(head), int(length or 0), _text(alg or b""))

    def append_raw(
        self, run_id: str, data: bytes, *, event_type: str = "?", event_id: str = ""
    ) -> int:
        """Append bytes as they are, unchecked and unfenced. For tests and repair tools only."""
        check_run_id(run_id)
        with self._translate():
            self._client.sadd(RUNS_KEY, run_id)
            return int(_RAW(self._client, [events_key(run_id)], [event_type, event_id, data]))

    def save_snapshot(self, run_id: str, position: int, data: bytes) -> bool:
        check_snapshot_position(run_id, position, self.last_position(run_id))
        with self._translate():
            keys = [snapshot_key(run_id), events_key(run_id)]
            return bool(_SNAPSHOT(self._client, keys, [position, data]))

    # -- reads ---------------------------------------------------------------------

    def read_raw(
        self, run_id: str, start: int = 1, end: int | None = None, count: int | None = None
    ) -> list[RawEntry]:
        check_range(start, end, count)
        self._require_run(run_id)
        out: list[RawEntry] = []
        lo, hi = start, "+" if end is None else f"0-{end}"
        with self._translate():
            while count is None or len(out) < count:
                page = READ_PAGE_SIZE if count is None else min(READ_PAGE_SIZE, count - len(out))
                if page == 0:
                    break
                batch = self._client.xrange(events_key(run_id), f"0-{lo}", hi, count=page)
                out += (_raw_entry(entry_id, fields) for entry_id, fields in batch)
                if len(batch) < page:
                    break
                lo = out[-1].position + 1
        return out

    def read(
        self, run_id: str, start: int = 1, end: int | None = None, count: int | None = None
    ) -> list[StoredEvent]:
        return decode_entries(self.read_raw(run_id, start, end, count))

    def last_position(self, run_id: str) -> int:
        self._require_run(run_id)
        with self._translate():
            return int(self._client.xlen(events_key(run_id)))

    def current_epoch(self, run_id: str) -> int:
        check_run_id(run_id)
        with self._translate():  # the controller asks before side effects: one round trip
            epoch = self._hot.execute_command("HGET", meta_key(run_id), "epoch")
        if epoch is None:
            self._require_run(run_id)
            return 0
        return int(epoch)

    def run_exists(self, run_id: str) -> bool:
        check_run_id(run_id)
        with self._translate():
            return bool(self._client.sismember(RUNS_KEY, run_id))

    def list_runs(self) -> list[RunInfo]:
        run_ids = self._run_ids()
        with self._translate():
            pipe = self._client.pipeline(transaction=False)
            for run_id in run_ids:
                pipe.xlen(events_key(run_id))
                pipe.hget(meta_key(run_id), "epoch")
                pipe.hget(snapshot_key(run_id), "position")
            replies = pipe.execute()
        infos = []
        for i, run_id in enumerate(run_ids):
            length, epoch, snap = replies[3 * i : 3 * i + 3]
            infos.append(
                RunInfo(
                    run_id=run_id,
                    last_position=int(length),
                    epoch=int(epoch or 0),
                    snapshot_position=None if snap is None else int(snap),
                )
            )
        return infos

    def load_snapshot(self, run_id: str) -> tuple[int, bytes] | None:
        self._require_run(run_id)
        with self._translate():
            position, data, link = self._client.hmget(
                snapshot_key(run_id), ["position", "data", "chain"]
            )
        if position is None or data is None:
            return None
        if link:  # the snapshot vouches for the log up to its position: check it still does
            check_snapshot_link(
                run_id, int(position), _text(link), lambda p: self._hash_at(run_id, p)
            )
        return int(position), bytes(data)

    async def follow(
        self, run_id: str, from_position: int = 0, *, block_ms: int = 1000
    ) -> AsyncIterator[StoredEvent]:
        """XREAD BLOCK on the run's stream, on a connection of its own."""
        if from_position < 0:
            raise ValueError(f"from_position must be >= 0, got {from_position}")
        self._require_run(run_id)
        key = events_key(run_id)
        client = self._async_factory()
        try:
            last = from_position
            while True:
                try:
                    reply = await client.xread(
                        {key: f"0-{last}"}, count=READ_PAGE_SIZE, block=block_ms
                    )
                except (rex.ConnectionError, rex.TimeoutError) as err:
                    raise self._unavailable(err) from err
                for _stream, entries in reply or ():
                    for stored in decode_entries([_raw_entry(i, f) for i, f in entries]):
                        last = stored.position
                        yield stored
        finally:
            await client.aclose()

    def close(self) -> None:
        with contextlib.suppress(rex.RedisError):
            if isinstance(self._hot, _PinnedConnection):
                self._hot.close()
            self._client.close()


def _raw_entry(entry_id: bytes | str, fields: dict[Any, Any]) -> RawEntry:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    if ms != "0" or not seq.isdigit():
        raise EventDecodeError(None, f"stream entry id {text!r} is not a log position (0-N)")
    fields = {_text(k): v for k, v in fields.items()}
    data = fields.get("data", b"")
    return RawEntry(
        position=int(seq),
        event_type=_text(fields.get("type", b"")),
        event_id=_text(fields.get("id", b"")),
        data=data.encode() if isinstance(data, str) else bytes(data),
        chain=_text(fields.get(HASH_FIELD, b"")),
    )


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _append_error(run_id: str, epoch: int, expected: int, message: str) -> EventStoreError:
    """Turn the script's ``RLC_<KIND> <n> ...`` error reply into a typed error."""
    words = message.split()
    kind = words[0] if words else ""
    number = int(words[1]) if len(words) > 1 and words[1].isdigit() else -1
    if kind == "RLC_FENCED":
        return FencedError(run_id, epoch, number)
    if kind == "RLC_UNCLAIMED":
        return EpochNotClaimedError(run_id, epoch, number)
    if kind == "RLC_BEHIND":
        return ConcurrencyError(run_id, expected, number, "log is behind")
    if kind == "RLC_PARTIAL":
        return ConcurrencyError(
            run_id, expected, number, "log moved by fewer entries than the batch (partial overlap)"
        )
    if kind == "RLC_CHAIN":
        return ChainError(run_id, expected + 1, CHAIN_REFUSED)
    if kind == "RLC_MISMATCH":
        where = words[2] if len(words) > 2 else "?"
        return ConcurrencyError(
            run_id, expected, number, f"position {where} holds a different event id"
        )
    return EventStoreError(f"run {run_id!r}: append failed: {message}")
