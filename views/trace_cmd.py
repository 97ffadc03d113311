"""``rl-controller trace``: write a run's log as a Chrome trace-event JSON file.

Read-only (works under the reader ACL user, on a live run: what is there now). The
file appears complete or not at all: it is written beside the target and renamed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from controller.cli_common import CliError, add_run_arg, open_store, require_run, subcommand


def add_parser(subparsers: Any) -> None:
    p = subcommand(subparsers, "trace", "write a run as a Chrome/Perfetto trace (JSON)",
                   "  rl-controller trace --run r1 -o r1.json      # open in ui.perfetto.dev\n"
                   "  rl-controller trace --run r1 --steps 10:20 -o steps.json")
    add_run_arg(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="trace file to write")
    p.add_argument("--steps", default="", metavar="A:B",
                   help="only steps A..B (either end may be left out: 10: or :20)")
    p.set_defaults(func=cmd_trace)


def parse_steps(text: str) -> tuple[int | None, int | None]:
    if not text:
        return None, None
    first, sep, last = text.partition(":")
    try:
        a = int(first) if first.strip() else None
        b = int(last) if last.strip() else None
    except ValueError:
        raise CliError(f"--steps {text!r}: expected A:B with step numbers (e.g. 10:20)") from None
    if not sep:
        b = a  # one step: "7" means 7:7
    if (a is not None and a < 0) or (b is not None and b < 0) or (
            a is not None and b is not None and b < a):
        raise CliError(f"--steps {text!r}: expected 0 <= A <= B")
    return a, b


def cmd_trace(args: argparse.Namespace) -> int:
    steps = parse_steps(args.steps)
    target = Path(args.output)
    if not target.parent.is_dir():
        raise CliError(f"-o {str(target)!r}: directory {str(target.parent)!r} does not exist")
    with open_store(args) as store:
        require_run(store, args.run)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                summary = write_trace(store, args.run, out, steps)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    if summary["events"] == 0:
        print(f"rl-controller: note: no events in the requested steps of {args.run}", file=sys.stderr)
    print(f"wrote {target}: {summary['entries']} trace entries from {summary['events']} events "
          f"(positions {summary['first']}..{summary['last']})")
    return 0


def write_trace(
    store: Any, run_id: str, out: Any, steps: tuple[int | None, int | None] = (None, None)
) -> dict[str, int]:
    """Stream the run's events into ``out`` as a trace; stops after the last step asked."""
    from views import source
    from views.trace import TraceBuilder
    from views.trace_writer import TraceWriter

    writer = TraceWriter(out)
    builder = TraceBuilder(writer, run_id, steps)
    events = source.events(store, run_id)
    try:
        for position, event in events:
            if not builder.feed(position, event):
                break
    finally:
        events.close()  # stops the read-ahead (forked readers) when we stop early
    builder.finish()
    return {"entries": writer.written, "events": builder.events,
            "first": builder.first_position, "last": builder.last_position}
