"""Synchronous replication for the log: an append counts only once N replicas hold it.

Redis replicates asynchronously, so a primary that dies can take its newest writes with
it even under ``appendfsync always``. With ``store.replicas = N > 0`` every append
(and every epoch claim) is followed by ``WAIT N timeout`` on the same connection, so
the store returns only after N replicas acknowledged the write's replication offset.
A timeout is an error (:class:`ReplicationTimeoutError`): the write may be on the
primary alone, so its outcome is in doubt, and the caller's idempotent retry (same
batch, same expected position) settles it, on the old primary or on a promoted replica.

``WAIT`` counts the writes of the connection it runs on. A retry that finds its batch
already in the log writes nothing, so a ``WAIT`` after it would confirm nothing about
that batch; :func:`confirm` then writes a tiny barrier key first, whose offset lies
after the batch, and waits for that.

A replica that drops away makes every later ``WAIT`` time out. The timeout's error
then says how many replicas the server still has (``INFO replication``), so the line a
run ends with names the cause; :func:`require_replicas` asks the same before a run
starts, so a server without the replicas wanted is refused before anything is written.

Only ``events.redis_store`` calls this module; its setting, ``StoreConfig`` (the
``[store]`` table), lives in ``events.store_config``, which imports no redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from redis import exceptions as rex

from events.errors import ReplicasMissingError, ReplicationTimeoutError
from events.store_config import StoreConfig


class Pipelined(Protocol):
    """A connection that sends several commands in one round trip, on one connection."""

    def execute_many(self, *commands: tuple[Any, ...]) -> list[Any]: ...


class Script(Protocol):
    sha: str
    source: str


def barrier_key(run_id: str) -> str:
    """A key written only so that a replayed append has an offset to WAIT for."""
    return f"rlc:{{{run_id}}}:sync"


def wait_command(cfg: StoreConfig) -> tuple[Any, ...]:
    return ("WAIT", cfg.replicas, max(1, round(cfg.wait_timeout_s * 1000)))


def connected_replicas(client: Any) -> int | None:
    """The server's connected replicas (``INFO replication``); None when it does not say
    (INFO refused to this user or unknown to the server). Connection errors propagate."""
    try:
        info = client.info("replication")
    except rex.ResponseError:  # NOPERM included
        return None
    return int(info.get("connected_slaves", 0))


def require_replicas(client: Any, wanted: int, where: str) -> None:
    """Raise :class:`ReplicasMissingError` when fewer than ``wanted`` replicas are
    connected; a server that does not say is not refused (each ``WAIT`` still is)."""
    if wanted <= 0:
        return
    connected = connected_replicas(client)
    if connected is not None and connected < wanted:
        raise ReplicasMissingError(f"Redis at {where}", wanted, connected)


def check_confirmed(reply: Any, cfg: StoreConfig, where: str, client: Any) -> None:
    """Raise unless the ``WAIT`` reply counts at least ``cfg.replicas`` replicas; the
    error says how many replicas ``client``'s server has now, which names the cause."""
    confirmed = int(reply)
    if confirmed < cfg.replicas:
        try:
            now = connected_replicas(client)
        except rex.RedisError:  # the server went too: the next call says so
            now = None
        raise ReplicationTimeoutError(where, confirmed, cfg.replicas, cfg.wait_timeout_s, now)


def confirm_replayed(
    conn: Pipelined, run_id: str, position: int, cfg: StoreConfig, where: str, client: Any
) -> None:
    """After a replayed append: write the barrier, then WAIT for it, in one round trip."""
    _, waited = conn.execute_many(("SET", barrier_key(run_id), position), wait_command(cfg))
    check_confirmed(waited, cfg, where, client)


def replicated_append(
    conn: Pipelined,
    script: Script,
    keys: Sequence[str],
    args: Sequence[Any],
    cfg: StoreConfig,
    *,
    run_id: str,
    where: str,
    client: Any,
) -> tuple[int, int]:
    """The append script and ``WAIT`` in one round trip; returns the script's reply."""
    wait = wait_command(cfg)
    try:
        reply, waited = conn.execute_many(("EVALSHA", script.sha, len(keys), *keys, *args), wait)
    except rex.NoScriptError:
        reply, waited = conn.execute_many(("EVAL", script.source, len(keys), *keys, *args), wait)
    appended, first = int(reply[0]), int(reply[1])
    if appended:
        check_confirmed(waited, cfg, where, client)
    else:  # replayed: nothing written on this connection, so WAIT proved nothing yet
        confirm_replayed(conn, run_id, first + int(args[2]) - 1, cfg, where, client)
    return appended, first
