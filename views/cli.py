"""The views' subcommands, registered by the ``rl-controller`` entry point."""

from __future__ import annotations

from typing import Any


def register(subparsers: Any) -> None:
    from views import trace_cmd
    from views.dashboard import cmd as dashboard_cmd

    trace_cmd.add_parser(subparsers)
    dashboard_cmd.add_parser(subparsers)
