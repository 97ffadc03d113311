"""``rl-controller tail``: print a run's events, one per line (``--follow`` for a live run).

``--follow`` ends, exit status 0, once it has printed a ``RunFinished``: a finished run
gets no more events until someone resumes it (then follow it again).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any

from cli.common import CliError, add_run_arg, open_store, require_run, subcommand
from cli import render


# -- tail --------------------------------------------------------------------------------


def register_tail(subparsers: Any) -> None:
    p = subcommand(subparsers, "tail", "print a run's events, one per line",
             "  rl-controller tail --run r1 --from 1000\n"
             "  rl-controller tail --run r1 --follow --json   # Ctrl-C to stop")
    add_run_arg(p)
    p.add_argument("--from", dest="start", type=int, default=1, metavar="POS",
                   help="first position to print (default: 1)")
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep waiting for new events, until the run finishes")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_tail)


def cmd_tail(args: argparse.Namespace) -> int:
    if args.start < 1:
        raise CliError(f"--from must be >= 1, got {args.start}")
    with open_store(args) as store:
        require_run(store, args.run)
        printer = _TailPrinter(args.json)
        try:
            last = printer.print_existing(store, args.run, args.start)
            if args.follow and not printer.finished:
                _run_until_interrupted(printer.follow(store, args.run, last))
        except KeyboardInterrupt:
            return 130
        except BrokenPipeError:
            sys.stderr.close()  # the reader went away (e.g. | head): not an error
            return 0
    return 1 if printer.malformed else 0


def _run_until_interrupted(coro: Any) -> None:
    """Run ``coro`` until it ends or Ctrl-C, which raises KeyboardInterrupt here, cleanly.

    Not ``asyncio.run``: Ctrl-C must neither leave a traceback from inside a task nor
    wait on a blocking stream read that does not end promptly when cancelled.
    """
    import logging
    import signal

    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    task = loop.create_task(coro)

    async def until_stopped() -> None:
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()

    previous = signal.signal(signal.SIGINT, lambda *_: loop.call_soon_threadsafe(stop.set))
    try:
        loop.run_until_complete(until_stopped())
        if task.done():
            task.result()  # the follow's own error, if any
            return
        task.cancel()
        with contextlib.suppress(BaseException):
            loop.run_until_complete(asyncio.wait([task], timeout=1.0))
        if task.done():
            with contextlib.suppress(BaseException):
                task.result()
        else:
            # We are exiting: do not let asyncio complain about the read we abandon.
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        raise KeyboardInterrupt
    finally:
        signal.signal(signal.SIGINT, previous)


class _TailPrinter:
    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.malformed = 0
        #: the last event printed was RunFinished: following would wait for nothing
        self.finished = False

    def emit(self, position: int, event: Any) -> None:
        from controller.core.turns import parts

        self.finished = type(event).__name__ == "RunFinished"
        for part in parts(event):  # a pause shows as the events it stands for
            if self.as_json:
                render.write_json(render.event_json(position, part))
            else:
                sys.stdout.write(render.event_line(position, part) + "\n")

    def bad(self, position: int, reason: str) -> None:
        self.malformed += 1
        sys.stdout.flush()
        print(f"rl-controller: malformed entry at position {position}: {reason}", file=sys.stderr)

    def print_existing(self, store: Any, run_id: str, start: int) -> int:
        from events.codec import decode
        from events.errors import EventDecodeError
        from controller.projector import iter_pages

        last = start - 1
        for page in iter_pages(store, run_id, start):
            for position, data in page:
                try:
                    self.emit(position, decode(data, position))
                except EventDecodeError as err:
                    self.finished = False
                    self.bad(position, err.reason)
                last = position
            sys.stdout.flush()
        return last

    async def follow(self, store: Any, run_id: str, last: int) -> None:
        from events.errors import EventDecodeError, StreamIdError

        while True:
            try:
                # closed here, in this task: a reader left to the garbage collector had
                # its close scheduled on a loop about to stop, and asyncio printed "Task
                # was destroyed but it is pending!" after the run's last line
                async with contextlib.aclosing(store.follow(run_id, last)) as events:
                    async for stored in events:
                        self.emit(stored.position, stored.event)
                        sys.stdout.flush()
                        last = stored.position
                        if self.finished:
                            return
                return
            except EventDecodeError as err:
                # Report it and go on after it (the store yields every event before it).
                position = err.position if err.position is not None else last + 1
                if isinstance(err, StreamIdError):  # re-read from any position: stop
                    self.bad(position, f"{err.reason}; nothing can be appended after it: "
                                       "following stopped")
                    return
                self.bad(position, err.reason)
                last = max(last, position)
