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
import socket
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NoReturn

from events.errors import EventStoreError, RunNotFoundError, StorePermissionError
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


def check_redis_url(args: argparse.Namespace) -> None:
    """A malformed ``--redis-url`` (or ``$RLC_REDIS_URL``) is one line, before anything runs."""
    url = getattr(args, "redis_url", "")
    if not url:
        return
    from events.errors import StoreUrlError
    from events.redis_store.url import check_url

    source = ENV_REDIS_URL if url == os.environ.get(ENV_REDIS_URL) else "--redis-url"
    try:
        check_url(url)
    except StoreUrlError as err:
        raise CliError(f"{source}: {err}") from None


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


def load_chain_key(path: str, name: str = "store.chain_key_file") -> bytes | None:
    """The hash chain's HMAC key from ``path`` (given by ``name``: a config key or a
    flag); None when no file is configured."""
    if not path:
        return None
    from events.chain import ChainKeyError, load_key

    try:
        return load_key(path, name)
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

    check_redis_url(args)
    if start and not args.redis_url and not getattr(args, "redis_sentinel", ""):
        writable_dir("--data-dir", args.data_dir)  # the embedded server's home
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


def output_file(flag: str, path: str, *, formats: list[str] | None = None,
                create_parents: bool = True) -> Path:
    """``path`` checked before any work is done, so a bad output name is one line and
    nothing is written: not a directory, a suffix in ``formats`` (when given), and a
    directory that exists (or, with ``create_parents``, can be made) and is writable."""
    target = Path(path)
    if target.is_dir():
        raise CliError(f"{flag} {path!r} is a directory; name a file")
    if formats is not None and target.suffix.lower().lstrip(".") not in formats:
        raise CliError(f"{flag} {path!r}: the file name must end in one of "
                       + ", ".join(f".{f}" for f in sorted(formats)))
    if not create_parents and not target.parent.is_dir():
        raise CliError(f"{flag} {path!r}: directory {str(target.parent)!r} does not exist")
    writable_dir(flag, target.parent, named=path)
    return target


def writable_dir(flag: str, directory: str | Path, *, named: str | None = None) -> None:
    """``directory`` exists as a writable directory, or its nearest existing ancestor
    is one (so it can be made); else one line naming what is in the way (and the
    flag's value, ``named`` where that is a file in ``directory``)."""
    shown = f"{flag} {named or str(directory)!r}"
    here = Path(directory).absolute()
    while not here.exists():
        here = here.parent
    if not here.is_dir():
        raise CliError(f"{shown}: {str(here)!r} is a file, not a directory")
    # A probe, not os.access: for root access() says yes to a read-only mount or a
    # pseudo-filesystem (/proc), and the later mkdir/open then failed with a traceback.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rlc-write-probe-", dir=here))
    except OSError as err:
        raise CliError(f"{shown}: directory {str(here)!r} is not writable "
                       f"({err.strerror or err})") from None


def require_run(store: EventStore, run_id: str) -> None:
    if not store.run_exists(run_id):
        raise RunNotFoundError(run_id, sorted(r.run_id for r in store.list_runs()))


def orphan_run_dirs(args: argparse.Namespace, known: set[str]) -> list[str]:
    """Run directories under ``--data-dir`` with no log in the store (a start that
    failed before its first event, in versions that left them)."""
    runs = Path(getattr(args, "data_dir", DEFAULT_DATA_DIR)) / "runs"
    if not runs.is_dir():
        return []
    return sorted(d.name for d in runs.iterdir() if d.is_dir() and d.name not in known)


@dataclass(frozen=True)
class LastController:
    """Who last held a run, from its log's tail: the newest ControllerStarted."""

    finished: bool
    host: str | None
    pid: int | None

    def running_here(self) -> bool:
        """An unfinished run whose controller is alive on this host (not this process)."""
        from events.embedded import pid_alive

        return (not self.finished and self.host == socket.gethostname()
                and self.pid is not None and self.pid != os.getpid() and pid_alive(self.pid))

    def elsewhere(self) -> bool:
        """An unfinished run whose controller ran on another host (alive or not: unknown)."""
        return not self.finished and self.host not in (None, socket.gethostname())


def last_controller(store: EventStore, run_id: str, last: int) -> LastController:
    from events.codec import decode

    tail = store.read_raw(run_id, max(1, last - 499), last) if last else []
    finished = bool(tail) and tail[-1].event_type == "RunFinished"
    for entry in reversed(tail):
        if entry.event_type == "ControllerStarted":
            event = decode(entry.data, entry.position)
            return LastController(finished, event.host, event.pid)  # type: ignore[union-attr]
    return LastController(finished, None, None)


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"rl-controller: error: {message}", file=sys.stderr)
    raise SystemExit(code)


#: what a command needs of its Redis user when the server refused one of its commands
#: (the roles of events/redis_store/acl.py); a command not named here only reads
_USER_NEEDED = {
    "run": "the controller user",
    "delete": "a user that may delete the rlc:* keys (neither role may: an admin user)",
}
_READER_NEEDED = "a user that may read the rlc:* keys (the reader or the controller user)"


def user_needed(command: str) -> str:
    """The hint for a refused command: what ``command`` needs, where it is written."""
    need = _USER_NEEDED.get(command, _READER_NEEDED)
    return f"'{command}' needs {need}, see docs/security.md"


def run_command(func, args: argparse.Namespace) -> int:
    """Call a command; user errors become one line on stderr and a non-zero exit."""
    from controller.config import ConfigError
    from controller.core.errors import InvariantViolation
    from events.errors import ChainError, EventDecodeError, StoreDataError

    try:
        return int(func(args) or 0)
    except CliError as err:
        fail(str(err), err.code)
    except (EventDecodeError, InvariantViolation, ChainError, StoreDataError) as err:
        fail(str(err), 1)
    except (RunNotFoundError, ConfigError) as err:
        fail(str(err), 2)
    except StorePermissionError as err:
        fail(str(err.with_hint(user_needed(args.command))), 2)
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
