"""The store's configuration: where the log is, and how durable an append must be.

Two types, because they come from two places and only one is recorded:

* :class:`StoreConfig` is the ``[store]`` table of a run's config. It travels in the
  run's ``RunStarted`` event, so a resumed run keeps its durability and chain key file.
* :class:`StoreAddress` says where the log is: a Redis URL, Sentinels, or the embedded
  server of a data directory. It comes from the command line and its environment and is
  never written into a log (a URL can carry a password, and a log is read from wherever
  it is now, not from where it was written).

``events.factory.open_store`` takes both. Pure: no redis, no I/O (loading a config must
stay cheap and side-effect free).
"""

from __future__ import annotations

import msgspec

from events.config_checks import positive, require

#: the embedded server's default run directory
DEFAULT_DATA_DIR = "./rlc-data"


class StoreConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[store]``: how durable an append must be before the store acknowledges it."""

    replicas: int = 0
    """Replicas that must confirm each append (``WAIT N``). 0: the primary's own AOF only."""
    wait_timeout_s: float = 5.0
    """How long an append waits for its replicas; past it the append fails as in doubt."""
    require_fsync_always: bool = False
    """Refuse an external Redis whose AOF is off or whose appendfsync is not "always"
    (by default such a server is used with a warning saying what a crash can lose)."""
    chain_key_file: str = ""
    """File with the HMAC key of the log's hash chain (>= 16 bytes; never sent to Redis).
    Empty = plain SHA-256 chain (``events.chain``)."""

    def __post_init__(self) -> None:
        require(self.replicas >= 0, "store.replicas", ">= 0", self.replicas)
        positive("store", self, "wait_timeout_s")


class StoreAddress(msgspec.Struct, frozen=True, kw_only=True):
    """Where the log is. Exactly one of: ``sentinels`` (+ ``master``), ``url``, or the
    embedded redis-server of ``data_dir`` (the default)."""

    url: str = ""
    """``redis://[user:password@]host:port[/db]`` or ``rediss://`` for TLS."""
    sentinels: str = ""
    """``host:port,...`` of Redis Sentinels; the store follows the primary they name."""
    master: str = ""
    """With ``sentinels``: the monitored master's name."""
    username: str | None = None
    """With ``sentinels``: the data nodes' ACL user."""
    password: str | None = None
    """With ``sentinels``: the data nodes' password (that ACL user's, with ``username``)."""
    sentinel_password: str | None = None
    """With ``sentinels``: the sentinels' own password (default: ``password``)."""
    data_dir: str = DEFAULT_DATA_DIR
    """Run directory of the embedded server (used when neither url nor sentinels is set)."""
    start_embedded: bool = False
    """Start the embedded server when ``data_dir`` has none; otherwise a directory without
    a log is an error (read-only commands never create one)."""

    @property
    def embedded(self) -> bool:
        return not (self.url or self.sentinels)
