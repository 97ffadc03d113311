"""The views' subcommands, registered by the ``rl-controller`` entry point."""

from __future__ import annotations

from typing import Any


def register(subparsers: Any) -> None:
    from views import trace_cmd

    trace_cmd.add_parser(subparsers)
