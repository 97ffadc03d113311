"""Plumbing shared by every CLI command: where the log is, and errors as one line.

Where the log is: ``--redis-sentinel`` + ``--redis-master`` (the primary the sentinels
name, followed across a failover; passwords from ``RLC_REDIS_PASSWORD`` and
``RLC_SENTINEL_PASSWORD``, an ACL user on the data nodes from ``RLC_REDIS_USERNAME``),
else ``--redis-url`` or ``RLC_REDIS_URL``; otherwise the embedded redis-server of
``--data-dir`` (default ``./rlc-data``), started if it is not running. The flags become
a ``StoreAddress``; ``events.factory.open_store`` builds the store.
Read-only commands never start a server for a directory that has none: they say so.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, NoReturn

from events.errors import EventStoreError, RunNotFoundError
from events.store import EventStore, ServerEventStore
from events.store_config import DEFAULT_DATA_DIR, StoreAddress, StoreConfig

ENV_REDIS_URL = "RLC_REDIS_URL"
ENV_SENTINEL = "RLC_REDIS_SENTINEL"
ENV_MASTER = "RLC_REDIS_MASTER"
ENV_PASSWORD = "RLC_REDIS_PASSWORD"
ENV_SENTINEL_PASSWORD = "RLC_SENTINEL_PASSWORD"
ENV_USERNAME = "RLC_REDIS_USERNAME"


class CliError(Exception):
    """A user-facing error: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def add_store_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-url",
        default=os.environ.get(ENV_REDIS_URL, ""),
        help=f"Redis holding the log (default: ${ENV_REDIS_URL}, else the embedded server)",
    )
    parser.add_argument(
        "--redis-sentinel",
        default=os.environ.get(ENV_SENTINEL, ""),
        metavar="HOST:PORT,...",
        help=f"Sentinels to ask for the primary (default: ${ENV_SENTINEL}); the store "
        f"follows a failover. Passwords: ${ENV_PASSWORD}, ${ENV_SENTINEL_PASSWORD}; "
        f"ACL user: ${ENV_USERNAME}",
    )
    parser.add_argument(
        "--redis-master",
        default=os.environ.get(ENV_MASTER, ""),
        metavar="NAME",
        help=f"with --redis-sentinel: the monitored master's name (default: ${ENV_MASTER})",
    )
    parser.add_argument(
        "--data-dir",
        default=DEFAULT_DATA_DIR,
        help="run directory of the embedded default (default: %(default)s)",
    )


def store_address(args: argparse.Namespace, *, start: bool = False) -> StoreAddress:
    """Where the command's log is, from its flags and the environment."""
    sentinels = getattr(args, "redis_sentinel", "")
    if sentinels and args.redis_url:
        raise CliError("pass either --redis-url or --redis-sentinel, not both")
    return StoreAddress(
        url=args.redis_url, sentinels=sentinels, master=getattr(args, "redis_master", ""),
        username=os.environ.get(ENV_USERNAME) or None,
        password=os.environ.get(ENV_PASSWORD) or None,
        sentinel_password=os.environ.get(ENV_SENTINEL_PASSWORD) or None,
        data_dir=args.data_dir, start_embedded=start,
    )


def load_chain_key(path: str) -> bytes | None:
    """The hash chain's HMAC key from ``path``; None when no file is configured."""
    if not path:
        return None
    from events.chain import ChainKeyError, load_key

    try:
        return load_key(path)
    except ChainKeyError as err:
        raise CliError(str(err)) from None


@contextmanager
def open_store(
    args: argparse.Namespace,
    *,
    start: bool = False,
    replication: StoreConfig | None = None,
    chain_key: bytes | None = None,
) -> Iterator[ServerEventStore]:
    """The store the command's flags name (``events.factory.open_store``), closed after.
    ``start``: start the embedded server of ``--data-dir`` if it is not running."""
    from events import factory

    try:
        store = factory.open_store(
            store_address(args, start=start), replication, chain_key=chain_key
        )
    except factory.NoEmbeddedStoreError as err:
        raise CliError(
            f"no runs in {str(Path(err.data_dir))!r} (no embedded log there); pass --data-dir or "
            f"--redis-url, or start one with 'rl-controller run'"
        ) from None
    except ValueError as err:  # a malformed --redis-sentinel list
        raise CliError(str(err)) from None
    try:
        yield store
    finally:
        store.close()


def require_run(store: EventStore, run_id: str) -> None:
    if not store.run_exists(run_id):
        raise RunNotFoundError(run_id, sorted(r.run_id for r in store.list_runs()))


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"rl-controller: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def run_command(func, args: argparse.Namespace) -> int:
    """Call a command; user errors become one line on stderr and a non-zero exit."""
    from controller.config import ConfigError
    from controller.core.errors import InvariantViolation
    from events.errors import ChainError, EventDecodeError

    try:
        return int(func(args) or 0)
    except CliError as err:
        fail(str(err), err.code)
    except (EventDecodeError, InvariantViolation, ChainError) as err:
        fail(str(err), 1)
    except (RunNotFoundError, ConfigError) as err:
        fail(str(err), 2)
    except EventStoreError as err:
        fail(str(err), 2)
    except KeyboardInterrupt:
        fail("interrupted", 130)


def subcommand(subparsers: Any, name: str, help_text: str, examples: str) -> argparse.ArgumentParser:
    """A subcommand with the store arguments and an examples epilog."""
    parser = subparsers.add_parser(
        name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".",
        epilog="examples:\n" + examples, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_store_args(parser)
    return parser


def add_run_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="RUN_ID", help="run id (see 'rl-controller runs')")
