"""The Redis implementation of the EventStore: the only code that speaks the Redis
protocol (a test checks that nothing outside this package imports ``redis``).

    store.py        RedisEventStore (a ServerEventStore): appends, reads, snapshots, runs
    layout.py       the keys and the server-side Lua scripts
    replies.py      parsing stream replies (the fast paths of the bulk reads)
    connection.py   the pinned hot-path connection, error translation, PING
    url.py          checking and redacting Redis URLs
    replication.py  appends that WAIT for replicas (``store.replicas``)
    sentinel.py     opening the store through Redis Sentinel
    acl.py          least-privilege ACL roles (docs/security.md)
"""

from events.redis_store.connection import answers_ping
from events.redis_store.layout import events_key, meta_key, snapshot_key
from events.redis_store.store import RedisEventStore
from events.redis_store.url import check_url, redact_url

__all__ = [
    "RedisEventStore", "answers_ping", "check_url", "events_key", "meta_key", "redact_url",
    "snapshot_key",
]
