"""Open the log's store through Redis Sentinel, so it follows a failover.

    --redis-sentinel 10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379 --redis-master rlc

The sentinels are asked for the current primary of ``master`` on every (re)connect;
a connection that finds its server demoted to a replica (``READONLY``) is dropped and
the next attempt asks the sentinels again. The store's hot-path connection retries for
``failover_window_s``, which must cover Sentinel's ``down-after-milliseconds`` plus
the election (see docs/deploy.md). Passwords: ``password`` is the data nodes'
``requirepass`` (or, with ``username``, that ACL user's password: create the user on
every data node, since ACLs are not replicated, see docs/security.md);
``sentinel_password`` the sentinels' own (defaults to ``password``).
"""

from __future__ import annotations

import time
from typing import Any

import redis
import redis.exceptions as rex
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from events.errors import StoreUnavailableError
from events.redis_store.connection import one_line
from events.redis_store.store import RedisEventStore
from events.store_config import StoreConfig

DEFAULT_PORT = 26379


def parse_sentinels(spec: str) -> list[tuple[str, int]]:
    """``host:port,host:port`` (port defaults to 26379) -> address list; one-line errors."""
    out: list[tuple[str, int]] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(DEFAULT_PORT)
        if not host or not port.isdigit():
            raise ValueError(f"--redis-sentinel {spec!r}: {item!r} is not host:port")
        out.append((host, int(port)))
    if not out:
        raise ValueError("--redis-sentinel: no sentinel address given")
    return out


def sentinel_url(addresses: list[tuple[str, int]], master: str) -> str:
    """A name for the store in messages (no password)."""
    hosts = ",".join(f"{h}:{p}" for h, p in addresses)
    return f"redis+sentinel://{hosts}/{master}"


def open_sentinel_store(
    spec: str,
    master: str,
    *,
    password: str | None = None,
    username: str | None = None,
    sentinel_password: str | None = None,
    replication: StoreConfig | None = None,
    chain_key: bytes | None = None,
    failover_window_s: float = 30.0,
    connect_timeout_s: float = 2.0,
    command_timeout_s: float = 30.0,
) -> RedisEventStore:
    """A RedisEventStore on the primary that the sentinels name for ``master``."""
    addresses = parse_sentinels(spec)
    if not master:
        raise ValueError("--redis-sentinel needs --redis-master NAME (the monitored master)")
    sentinel_kwargs = {"socket_timeout": connect_timeout_s}
    if sentinel_password or password:
        sentinel_kwargs["password"] = sentinel_password or password  # the default user
    node_auth = {"username": username} if username else {}
    node_kwargs: dict[str, Any] = {
        "socket_connect_timeout": connect_timeout_s,
        "socket_timeout": command_timeout_s,
        "password": password,
        **node_auth,
    }

    def async_client() -> Any:
        sentinel = AsyncSentinel(addresses, sentinel_kwargs=sentinel_kwargs, **node_kwargs)
        return sentinel.master_for(master)

    _check_some_sentinel_answers(addresses, master, sentinel_kwargs, connect_timeout_s)
    client = Sentinel(
        addresses, sentinel_kwargs=sentinel_kwargs, retry=FailoverRetry(failover_window_s),
        **node_kwargs,
    ).master_for(master)
    _await_master(client, failover_window_s)
    return RedisEventStore(
        sentinel_url(addresses, master),
        client=client,
        async_client_factory=async_client,
        replication=replication,
        pin_client=True,
        retry_window_s=failover_window_s,
        chain_key=chain_key,
    )


class FailoverRetry(Retry):
    """The sync client's connection retry: redis-py's (three tries with backoff on a
    connection error or timeout), and besides, for up to ``window_s``, again while the
    sentinels name no healthy primary. Right after a failover, or while a loaded machine
    makes every sentinel flag the primary down for a moment, discovery finds none; a
    command then waits for one instead of failing. Wrong credentials are not retried
    (an ``AuthenticationError`` is not a missing primary)."""

    def __init__(self, window_s: float, retries: int = 3) -> None:
        super().__init__(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries)
        self.window_s = window_s

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):  # type: ignore[override]
        deadline = time.monotonic() + self.window_s
        while True:
            try:
                return super().call_with_retry(do, fail, is_retryable, with_failure_count)
            except MasterNotFoundError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)


def _check_some_sentinel_answers(
    addresses: list[tuple[str, int]], master: str, sentinel_kwargs: dict[str, Any],
    connect_timeout_s: float,
) -> None:
    """Fail at once when no sentinel takes a connection, or none monitors ``master``: a
    wrong address or name, or sentinels that are not running, not a failover (the
    sentinels stay up and keep the name through one). Waiting out the failover window
    for a primary would only delay the same error by a minute."""
    unreachable: list[str] = []
    not_sentinels: list[str] = []
    monitored: set[str] = set()
    for host, port in addresses:
        probe = redis.Redis(host=host, port=port, socket_connect_timeout=connect_timeout_s,
                            retry=Retry(NoBackoff(), 1), **sentinel_kwargs)
        try:
            names = {str(k.decode() if isinstance(k, bytes) else k) for k in probe.sentinel_masters()}
        except (rex.ConnectionError, rex.TimeoutError) as err:
            unreachable.append(f"{host}:{port}: {one_line(err)}")
            continue
        except rex.ResponseError as err:
            if "unknown command" not in str(err).lower():
                return  # it answered (e.g. refused the password): the store's PING says how
            not_sentinels.append(f"{host}:{port}")  # a Redis server, say
            continue
        except rex.RedisError:
            return
        finally:
            probe.close()
        if master in names:
            return
        monitored |= names
    where = f"Redis at {sentinel_url(addresses, master)} is unavailable"
    if not_sentinels and len(unreachable) + len(not_sentinels) == len(addresses):
        also = f"; no answer from {'; '.join(unreachable)}" if unreachable else ""
        raise StoreUnavailableError(
            f"{where}: {', '.join(not_sentinels)} does not know the SENTINEL command, so it "
            "is not a sentinel (a Redis server? that takes --redis-url; --redis-sentinel "
            f"takes the sentinels' addresses, port 26379 by default){also}")
    if len(unreachable) == len(addresses):
        raise StoreUnavailableError(f"{where}: no sentinel answers ({'; '.join(unreachable)})")
    raise StoreUnavailableError(
        f"{where}: the sentinels monitor no master named {master!r} (they monitor: "
        f"{', '.join(sorted(monitored)) or 'none'}); check --redis-master"
    )


def _await_master(client: Any, window_s: float) -> None:
    """Wait up to ``window_s`` for the sentinels to name a healthy primary: right after a
    failover they may briefly name none, which the store's commands already ride out.
    Any other error, or none named by then, is left to the store's own first PING."""
    deadline = time.monotonic() + window_s
    while True:
        try:
            client.ping()
            return
        except MasterNotFoundError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.2)
        except Exception:  # noqa: BLE001 - the store's PING reports it, translated
            return
