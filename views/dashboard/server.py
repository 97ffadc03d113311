"""Serving the dashboard: a socket bound first (so port 0 can be told), then uvicorn."""

from __future__ import annotations

import socket
from events.store import EventStore


def bind(host: str, port: int) -> socket.socket:
    """A listening address for ``host:port`` (0 = any free port); OSError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        # Listening now: a browser that connects once the address is printed waits in
        # the backlog while uvicorn starts, instead of being refused.
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def serve(store: EventStore, sock: socket.socket, default_run: str | None) -> None:
    """Serve until interrupted (Ctrl-C): uvicorn stops, open streams are cut after 1 s."""
    import uvicorn

    from views.dashboard.app import create_app

    config = uvicorn.Config(create_app(store, default_run), log_level="warning",
                            timeout_graceful_shutdown=1, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])
