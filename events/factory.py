"""The one place a store is built: ``open_store(address, config)``.

Every command, tool and benchmark that opens a run's log by its address comes here,
so which implementation serves an address, how the embedded server is found or
started, and what the Sentinel connection needs is decided once:

    address.sentinels   RedisEventStore on the primary the sentinels name (follows a failover)
    address.url         RedisEventStore on that server
    neither             RedisEventStore on the embedded redis-server of address.data_dir

Every store it returns is a :class:`events.store.ServerEventStore` (the tier that adds
a server's capabilities to the log). The in-memory twin is built directly
(``MemoryEventStore()``): it has no address.
"""

from __future__ import annotations

from pathlib import Path

from events.errors import StoreUnavailableError
from events.store import ServerEventStore
from events.store_config import StoreAddress, StoreConfig


class NoEmbeddedStoreError(StoreUnavailableError):
    """``data_dir`` holds no embedded log and the caller may not start one."""

    def __init__(self, data_dir: str) -> None:
        super().__init__(f"no embedded log in {data_dir!r}")
        self.data_dir = data_dir


def open_store(
    address: StoreAddress, config: StoreConfig | None = None, *, chain_key: bytes | None = None
) -> ServerEventStore:
    """The store at ``address``, appending as ``config`` says (the caller closes it).

    Raises ``ValueError`` for an address that cannot name a server (a malformed
    Sentinel list, sentinels without a master, both url and sentinels),
    :class:`NoEmbeddedStoreError`, or the store's own ``StoreUnavailableError``.
    """
    if address.sentinels:
        if address.url:
            raise ValueError("a store address names either a URL or Sentinels, not both")
        from events.redis_store.sentinel import open_sentinel_store

        return open_sentinel_store(
            address.sentinels, address.master,
            password=address.password, username=address.username,
            sentinel_password=address.sentinel_password,
            replication=config, chain_key=chain_key,
        )
    from events.redis_store import RedisEventStore

    return RedisEventStore(embedded_url(address), replication=config, chain_key=chain_key)


def embedded_url(address: StoreAddress) -> str:
    """``address.url``, else the URL of ``address.data_dir``'s embedded server (started
    only when ``address.start_embedded``)."""
    if address.url:
        return address.url
    from events.embedded import ensure_embedded_redis

    if not address.start_embedded and not (Path(address.data_dir) / "redis").exists():
        raise NoEmbeddedStoreError(address.data_dir)
    return ensure_embedded_redis(address.data_dir).url
