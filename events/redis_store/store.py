"""RedisEventStore: the run log as a Redis Stream.

The keys and the server-side scripts are in ``layout``; the parsing of read replies in
``replies``; the pinned hot-path connection and error translation in ``connection``;
``WAIT``-replica appends in ``replication`` (all in this package). This module holds
the store and its commands. ``data`` is the event's JSON
(``events.codec``), so ``redis-cli XRANGE`` shows the log. The stream is never trimmed:
it is the source of truth.

An append is ONE server-side Lua script (EVALSHA, EVAL when the server lost it), so a
batch is one round trip and one fsync under ``appendfsync always``, and the fencing
check, the position check, the idempotent-retry comparison and the XADDs are atomic.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

import redis
import redis.asyncio
from redis import exceptions as rex

from events.chain import ChainHead, ChainWriter, check_snapshot_link
from events.codec import encode
from events.errors import RunNotFoundError, StorePermissionError
from events.redis_store.connection import (
    PinnedConnection, Sequential, check_url_options, compiled_parser, redact_url, run_script,
    tls_bounded, translate_errors, unavailable,
)
from events.redis_store.layout import (
    APPEND, PAGE, RAW_APPEND, RUNS_KEY, SNAPSHOT, append_error, events_key, meta_key,
    snapshot_key,
)
from events.redis_store.replies import (
    as_text, raw_entries, scripted_page, stored_int, trusted_page, xrange_chain_page,
    xrange_page,
)
from events.redis_store.replication import (
    check_confirmed, replicated_append, require_replicas, wait_command,
)
from events.redis_store.url import check_url
from events.schema import Event, StoredEvent
from events.store_config import StoreConfig
from events.store import (
    BULK_PAGE_SIZE, READ_PAGE_SIZE, ChainEntry, EncodedPage, RawEntry, RunInfo, check_append_args,
    check_range, check_run_id, check_snapshot_position, decode_entries, page_of,
)

#: How :meth:`RedisEventStore.read_page` reads: plain XRANGE parsed in C (needs
#: ``hiredis``), one packed page from a read-only script, or ``read_raw``; "auto" picks
#: the first two by whether the client parses with ``hiredis``.
PageReads = Literal["auto", "xrange", "script", "raw"]


class RedisEventStore:
    """ServerEventStore over Redis Streams (build it with ``events.factory.open_store``). See the module docstring for keys and the script.

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
        page_reads: PageReads = "auto",
        chain_key: bytes | None = None,
    ) -> None:
        if client is None:
            # One line for a malformed URL, not redis-py's traceback. A client handed in
            # (Sentinel, fakeredis) was built elsewhere; ``url`` then only names it.
            check_url(url)
        self.url = url
        #: appends wait for this many replicas (``events.redis_store.replication``)
        self.replication = replication or StoreConfig()
        self._chain = ChainWriter(chain_key)
        self._safe_url = redact_url(url)
        self._connect_timeout_s = connect_timeout_s
        self._async_factory = async_client_factory or self._default_async_client
        with translate_errors(self._safe_url):
            if client is None:
                client = redis.Redis.from_url(
                    url,
                    socket_connect_timeout=connect_timeout_s,  # and a TLS handshake
                    socket_timeout=command_timeout_s,
                    decode_responses=False, **tls_bounded(url),
                )
                check_url_options(client, self._safe_url)
                self._hot: Any = PinnedConnection(client, retry_window_s=retry_window_s)
            elif pin_client:  # a real client set up elsewhere (Sentinel)
                self._hot = PinnedConnection(client, retry_window_s=retry_window_s)
            else:
                self._hot = Sequential(client)  # a client handed in (fakeredis)
            self._client = client
            self._client.ping()  # fail fast: bad host, password or TLS setup
        # How read_page fetches a page; None once the server refused the fast read.
        if page_reads == "auto":
            page_reads = "xrange" if compiled_parser(client) else "script"
        self._page_read: Callable[[str, int, int], Any] | None = {
            "xrange": self._xrange_page, "script": self._scripted_page, "raw": None
        }[page_reads]

    @property
    def client(self) -> Any:
        """The underlying redis client, for tools and benchmarks."""
        return self._client

    # -- errors --------------------------------------------------------------------

    def _default_async_client(self) -> Any:
        return redis.asyncio.Redis.from_url(
            self.url, socket_connect_timeout=self._connect_timeout_s, decode_responses=False
        )

    def _require_run(self, run_id: str) -> None:
        check_run_id(run_id)
        if not self.run_exists(run_id):
            raise RunNotFoundError(run_id, self._run_ids())

    def _run_ids(self) -> list[str]:
        with translate_errors(self._safe_url, RUNS_KEY):
            return sorted(as_text(m) for m in self._client.smembers(RUNS_KEY))

    # -- writes --------------------------------------------------------------------

    def claim_epoch(self, run_id: str) -> int:
        check_run_id(run_id)
        with translate_errors(self._safe_url, meta_key(run_id)):
            pipe = self._client.pipeline(transaction=False)
            pipe.hincrby(meta_key(run_id), "epoch", 1)
            pipe.sadd(RUNS_KEY, run_id)
            if self.replication.replicas:  # same connection, so WAIT covers the claim
                pipe.execute_command(*wait_command(self.replication))
            epoch, _, *waited = pipe.execute()
        if waited:
            check_confirmed(waited[0], self.replication, self._safe_url, self._client)
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
        args: list[Any] = [epoch, expected_position, len(events), prev, self._chain.algorithm]
        for entry, link in zip(entries, hashes):
            args += (*entry, link)
        keys = (events_key(run_id), meta_key(run_id))
        try:
            with translate_errors(self._safe_url):
                if self.replication.replicas:
                    _, first = replicated_append(
                        self._hot, APPEND, keys, args, self.replication,
                        run_id=run_id, where=self._safe_url, client=self._client,
                    )
                else:
                    _, first = run_script(self._hot, APPEND, keys, args)
        except rex.ResponseError as err:
            self._chain.forget(run_id)
            raise append_error(run_id, epoch, expected_position, str(err)) from None
        self._chain.appended(run_id, expected_position + len(events), hashes[-1])
        return list(range(int(first), int(first) + len(events)))

    def _hash_at(self, run_id: str, position: int) -> str:
        """The chain hash stored with the entry at ``position`` ("" when it has none)."""
        entries = self.read_raw(run_id, position, position, 1)
        return entries[0].chain if entries else ""

    def chain_head(self, run_id: str) -> ChainHead | None:
        """The chain head in the run's meta; None for a run without a chain."""
        self._require_run(run_id)
        key = meta_key(run_id)
        with translate_errors(self._safe_url, key):
            head, length, alg = self._client.hmget(key, ["chain_head", "chain_len", "chain_alg"])
        if head is None:
            return None
        return ChainHead(as_text(head), stored_int(length or 0, key, "chain_len"),
                         as_text(alg or b""))

    def append_raw(
        self, run_id: str, data: bytes, *, event_type: str = "?", event_id: str = ""
    ) -> int:
        """Append bytes as they are, unchecked and unfenced. For tests and repair tools only."""
        check_run_id(run_id)
        with translate_errors(self._safe_url):
            self._client.sadd(RUNS_KEY, run_id)
            keys = [events_key(run_id)]
            return int(run_script(self._client, RAW_APPEND, keys, [event_type, event_id, data]))

    def save_snapshot(self, run_id: str, position: int, data: bytes) -> bool:
        check_snapshot_position(run_id, position, self.last_position(run_id))
        with translate_errors(self._safe_url):
            keys = [snapshot_key(run_id), events_key(run_id)]
            return bool(run_script(self._client, SNAPSHOT, keys, [position, data]))

    # -- reads ---------------------------------------------------------------------

    def read_raw(
        self, run_id: str, start: int = 1, end: int | None = None, count: int | None = None
    ) -> list[RawEntry]:
        check_range(start, end, count)
        self._require_run(run_id)
        out: list[RawEntry] = []
        lo, hi = start, "+" if end is None else f"0-{end}"
        with translate_errors(self._safe_url, events_key(run_id)):
            while count is None or len(out) < count:
                page = READ_PAGE_SIZE if count is None else min(READ_PAGE_SIZE, count - len(out))
                if page == 0:
                    break
                batch = self._client.xrange(events_key(run_id), f"0-{lo}", hi, count=page)
                out += raw_entries(batch, out[-1].position if out else lo - 1)
                if len(batch) < page:
                    break
                lo = out[-1].position + 1
        return out

    def read(
        self, run_id: str, start: int = 1, end: int | None = None, count: int | None = None
    ) -> list[StoredEvent]:
        return decode_entries(self.read_raw(run_id, start, end, count))

    def read_page(self, run_id: str, start: int = 1, count: int = BULK_PAGE_SIZE) -> EncodedPage:
        """One round trip for up to ``count`` entries' data (a 1M-event log must fold in
        seconds). With the compiled RESP parser (``hiredis``), a plain XRANGE whose data
        fields are picked out in C; without it, parsing the nested reply in Python would
        cost more than the fold, so a read-only script packs the page's data fields into
        ONE msgpack string. A page these paths cannot vouch for (not the gapless ``0-N``
        ids) or a server that refuses scripts is read through :meth:`read_raw`, which
        names a malformed entry.
        """
        check_range(start, None, count)
        if count == 0:
            self._require_run(run_id)
            return EncodedPage(start, [])
        if self._page_read is not None:
            try:
                with translate_errors(self._safe_url, events_key(run_id)):
                    page = trusted_page(self._page_read(events_key(run_id), start, count), start)
            except rex.ResponseError:  # scripts disabled, an ACL, an old server
                self._page_read, page = None, None
            if page is not None:
                if not page.data:  # past the end, or no such run: only then ask which
                    self._require_run(run_id)
                return page
        return page_of(self.read_raw(run_id, start, None, count), start)

    def _xrange_page(self, key: str, start: int, count: int) -> Any:
        # A bytes command name skips redis-py's per-entry dict callback: the nested
        # reply comes straight from the C parser.
        return xrange_page(
            self._client.execute_command(b"XRANGE", key, f"0-{start}", "+", "COUNT", count)
        )

    def _scripted_page(self, key: str, start: int, count: int) -> Any:
        return scripted_page(self._client.execute_command("EVAL", PAGE.source, 1, key, start, count))

    def read_chain_page(self, run_id: str, start: int, count: int) -> list[ChainEntry] | None:
        """Chained entries from ``start`` for ``audit``'s chain walk, picked out of one
        XRANGE in C; None for a page only ``read_raw`` can vouch for (it names why)."""
        with translate_errors(self._safe_url, events_key(run_id)):
            reply = self._client.execute_command(
                b"XRANGE", events_key(run_id), f"0-{start}", "+", "COUNT", count)
        return xrange_chain_page(reply, start)

    def last_position(self, run_id: str) -> int:
        self._require_run(run_id)
        with translate_errors(self._safe_url, events_key(run_id)):
            return int(self._client.xlen(events_key(run_id)))

    def current_epoch(self, run_id: str) -> int:
        check_run_id(run_id)
        key = meta_key(run_id)
        with translate_errors(self._safe_url, key):  # asked before side effects: one round trip
            epoch = self._hot.execute_command("HGET", key, "epoch")
        if epoch is None:
            self._require_run(run_id)
            return 0
        return stored_int(epoch, key, "epoch")

    def run_exists(self, run_id: str) -> bool:
        check_run_id(run_id)
        with translate_errors(self._safe_url, RUNS_KEY):
            return bool(self._client.sismember(RUNS_KEY, run_id))

    def list_runs(self) -> list[RunInfo]:
        run_ids = self._run_ids()
        with translate_errors(self._safe_url):
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
                    epoch=stored_int(epoch or 0, meta_key(run_id), "epoch"),
                    snapshot_position=None if snap is None
                    else stored_int(snap, snapshot_key(run_id), "position"),
                )
            )
        return infos

    def require_writable(self) -> None:
        """Refuse now, before anything is started, when this Redis user may not write the
        log (a reader user, see ``events.redis_store.acl``): one expiring ``SET`` under the
        run keys' prefix, a command the controller role has."""
        with translate_errors(self._safe_url):
            self._client.set(f"{RUNS_KEY}:write-probe", b"1", px=1000)

    def require_replicas(self, wanted: int) -> None:
        """Refuse when fewer than ``wanted`` replicas are connected (``replication``)."""
        with translate_errors(self._safe_url):
            require_replicas(self._client, wanted, self._safe_url)

    def durability(self) -> tuple[str, str] | None:
        """The server's (appendonly, appendfsync); None when CONFIG is not allowed."""
        try:
            with translate_errors(self._safe_url):
                reply = self._client.config_get("append*")
        except (rex.ResponseError, StorePermissionError):  # managed Redis, ACL users
            return None
        values = {as_text(k): as_text(v) for k, v in reply.items()}
        return values.get("appendonly", "?"), values.get("appendfsync", "?")

    def delete_run(self, run_id: str) -> None:
        """Remove the run's stream, meta and snapshot and its entry in the run list."""
        self._require_run(run_id)
        with translate_errors(self._safe_url):
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(events_key(run_id), meta_key(run_id), snapshot_key(run_id))
            pipe.srem(RUNS_KEY, run_id)
            pipe.execute()

    def load_snapshot(self, run_id: str) -> tuple[int, bytes] | None:
        self._require_run(run_id)
        key = snapshot_key(run_id)
        with translate_errors(self._safe_url, key):
            position, data, link = self._client.hmget(key, ["position", "data", "chain"])
        if position is None or data is None:
            return None
        at = stored_int(position, key, "position")
        if link:  # the snapshot vouches for the log up to its position: check it still does
            check_snapshot_link(run_id, at, as_text(link), lambda p: self._hash_at(run_id, p))
        return at, bytes(data)

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
                    raise unavailable(self._safe_url, err) from err
                for entry in (e for _stream, entries in reply or () for e in entries):
                    # one at a time: the events before a malformed entry are yielded first
                    (stored,) = decode_entries(raw_entries([entry], last))
                    last = stored.position
                    yield stored
        finally:
            await client.aclose()

    def close(self) -> None:
        with contextlib.suppress(rex.RedisError):
            if isinstance(self._hot, PinnedConnection):
                self._hot.close()
            self._client.close()
