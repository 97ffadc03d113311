"""``rl-controller dashboard``: serve the dashboard (uvicorn) until Ctrl-C."""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

from controller.cli_common import CliError, open_store, require_run, subcommand

DEFAULT_PORT = 8460


def add_parser(subparsers: Any) -> None:
    p = subcommand(subparsers, "dashboard", "a live read-only web page of the runs",
                   "  rl-controller dashboard                 # http://127.0.0.1:8460/\n"
                   "  rl-controller dashboard --run r1 --port 9000\n"
                   "  RLC_REDIS_URL=redis://rlc-reader:PW@host:6379/0 rl-controller dashboard")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="port to serve on (default: %(default)s; 0 = any free port)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: %(default)s, this machine only)")
    p.add_argument("--run", default=None, metavar="RUN_ID", help="open this run's page first")
    p.set_defaults(func=cmd_dashboard)


def cmd_dashboard(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in 0..65535, got {args.port}")
    import uvicorn

    from views.dashboard.app import create_app

    with open_store(args) as store:
        if args.run:
            require_run(store, args.run)
        sock = _bind(args.host, args.port)
        host, port = sock.getsockname()[:2]
        page = f"run/{args.run}" if args.run else ""
        print(f"dashboard at http://{host}:{port}/{page}  (Ctrl-C to stop)", flush=True)
        if host not in ("127.0.0.1", "::1"):
            print(f"rl-controller: note: serving on {host}: anyone who reaches it sees the runs "
                  "(no authentication)", file=sys.stderr)
        config = uvicorn.Config(create_app(store, args.run), log_level="warning",
                                timeout_graceful_shutdown=1, lifespan="off")
        uvicorn.Server(config).run(sockets=[sock])
    return 0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise CliError(f"cannot serve on {host}:{port}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    return sock
