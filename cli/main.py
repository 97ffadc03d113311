"""The ``rl-controller`` command line.

    rl-controller run        train (embedded default with no flags)
    rl-controller runs       list the runs in the store
    rl-controller tail       print a run's events (--follow for new ones)
    rl-controller replay     the folded state at any point of a run
    rl-controller staleness  lag analysis, plots and policy what-if
    rl-controller audit      trainer_version history and invariant check
    rl-controller simulate   a recorded run re-run in virtual time (timing what-if)
    rl-controller trace      a run as a Chrome/Perfetto trace (JSON)
    rl-controller dashboard  a live read-only web page of the runs
    rl-controller delete     delete a run (log and run directory)
    rl-controller stop-server  stop the embedded redis-server

Everything but ``run`` and ``delete`` only reads the log; nothing but ``run`` appends.
"""

from __future__ import annotations

import argparse
import sys

from cli.common import run_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rl-controller",
        description="Event-sourced controller for asynchronous RL post-training.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'rl-controller COMMAND --help' for a command's options and an example.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from cli import manage_cmd, replay_cmd, run_cmd, simulate_cmd, views_cmd

    run_cmd.register(sub)
    replay_cmd.register(sub)
    simulate_cmd.register(sub)
    manage_cmd.register(sub)
    views_cmd.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # a typo'd flag: show the usage of the subcommand it was given to
        subparsers = next(
            a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
        )
        subparsers.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
