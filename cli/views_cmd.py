"""``rl-controller trace`` and ``rl-controller dashboard``: the views of a run (``views/``).

Both only read the log: they work on a live run and under the reader ACL user.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cli.common import CliError, add_run_arg, open_store, output_file, require_run, subcommand

DASHBOARD_PORT = 8460


def register(subparsers: Any) -> None:
    p = subcommand(subparsers, "trace", "write a run as a Chrome/Perfetto trace (JSON)",
                   "  rl-controller trace --run r1 -o r1.json      # open in ui.perfetto.dev\n"
                   "  rl-controller trace --run r1 --steps 10:20 -o steps.json")
    add_run_arg(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="trace file to write")
    p.add_argument("--steps", default="", metavar="A:B",
                   help="only steps A..B (either end may be left out: 10: or :20)")
    p.set_defaults(func=cmd_trace)
    p = subcommand(subparsers, "dashboard", "a live read-only web page of the runs",
                   "  rl-controller dashboard                 # http://127.0.0.1:8460/\n"
                   "  rl-controller dashboard --run r1 --port 9000\n"
                   "  RLC_REDIS_URL=redis://rlc-reader:PW@host:6379/0 rl-controller dashboard")
    p.add_argument("--port", type=int, default=DASHBOARD_PORT,
                   help="port to serve on (default: %(default)s; 0 = any free port)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: %(default)s, this machine only)")
    p.add_argument("--run", default=None, metavar="RUN_ID", help="open this run's page first")
    p.set_defaults(func=cmd_dashboard)


def cmd_trace(args: argparse.Namespace) -> int:
    from views.trace_file import parse_steps, trace_to_file

    try:
        steps = parse_steps(args.steps)
    except ValueError as err:
        raise CliError(f"--{err}") from None
    target = output_file("-o", args.output, create_parents=False)
    with open_store(args) as store:
        require_run(store, args.run)
        summary = trace_to_file(store, args.run, target, steps)
    if not summary["drawn"]:  # the window starts past the run's newest step
        newest = summary["newest_step"]
        has = f"its newest step is {newest}" if newest >= 0 else "it has begun no step yet"
        raise CliError(f"--steps {args.steps!r}: run {args.run} has no step in that range "
                       f"({has}); nothing written")
    print(f"wrote {target}: {summary['entries']} trace entries from {summary['events']} events "
          f"(positions {summary['first']}..{summary['last']})")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from views.dashboard.server import bind, serve

    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in 0..65535, got {args.port}")
    if not args.host.strip():
        # "" is every interface to the socket API: refused, not taken as loopback, so that
        # neither reading serves the unauthenticated page somewhere the user did not say
        raise CliError(f"--host {args.host!r} names no address: pass 127.0.0.1 (the default, "
                       "this machine only) or 0.0.0.0 (every interface, no authentication)")
    with open_store(args) as store:
        if args.run:
            require_run(store, args.run)
        try:
            sock = bind(args.host, args.port)
        except OSError as err:
            raise CliError(f"cannot serve on {args.host}:{args.port}: {err.strerror or err}") from None
        host, port = sock.getsockname()[:2]
        page = f"run/{args.run}" if args.run else ""
        print(f"dashboard at http://{host}:{port}/{page}  (Ctrl-C to stop)", flush=True)
        if host not in ("127.0.0.1", "::1"):
            print(f"rl-controller: note: serving on {host}: anyone who reaches it sees the runs "
                  "(no authentication)", file=sys.stderr)
        serve(store, sock, args.run)
    return 0
