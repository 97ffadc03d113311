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

Only ``events.redis_store`` calls this module; its setting, ``StoreConfig`` (the
``[store]`` table), lives in ``events.store_config``, which imports no redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from redis import exceptions as rex

from events.errors import ReplicationTimeoutError
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


def check_confirmed(reply: Any, cfg: StoreConfig, where: str) -> None:
    """Raise unless the ``WAIT`` reply counts at least ``cfg.replicas`` replicas."""
    confirmed = int(reply)
    if confirmed < cfg.replicas:
        raise ReplicationTimeoutError(where, confirmed, cfg.replicas, cfg.wait_timeout_s)


def confirm_replayed(conn: Pipelined, run_id: str, position: int, cfg: StoreConfig, where: str) -> None:
    """After a replayed append: write the barrier, then WAIT for it, in one round trip."""
    _, waited = conn.execute_many(("SET", barrier_key(run_id), position), wait_command(cfg))
    check_confirmed(waited, cfg, where)


def replicated_append(
    conn: Pipelined,
    script: Script,
    keys: Sequence[str],
    args: Sequence[Any],
    cfg: StoreConfig,
    *,
    run_id: str,
    where: str,
) -> tuple[int, int]:
    """The append script and ``WAIT`` in one round trip; returns the script's reply."""
    wait = wait_command(cfg)
    try:
        reply, waited = conn.execute_many(("EVALSHA", script.sha, len(keys), *keys, *args), wait)
    except rex.NoScriptError:
        reply, waited = conn.execute_many(("EVAL", script.source, len(keys), *keys, *args), wait)
    appended, first = int(reply[0]), int(reply[1])
    if appended:
        check_confirmed(waited, cfg, where)
    else:  # replayed: nothing written on this connection, so WAIT proved nothing yet
        confirm_replayed(conn, run_id, first + int(args[2]) - 1, cfg, where)
    return appended, first
