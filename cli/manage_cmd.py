"""``rl-controller delete`` and ``rl-controller stop-server``: housekeeping.

    rl-controller delete --run exp1          # asks first; --yes to skip the question
    rl-controller stop-server                # the embedded redis-server of ./rlc-data

``delete`` removes everything a run left: its stream, meta and snapshot in Redis and
its run directory (metrics, TensorBoard, logs, checkpoints, payload spill). It refuses
while a controller may still hold the run: an unfinished run whose last controller is
alive on this host, or ran on another host (``--force`` once you know it is gone).
``stop-server`` stops only the embedded server of ``--data-dir``; it never touches an
external Redis.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from cli import followup
from cli.common import (
    DEFAULT_DATA_DIR,
    CliError,
    add_store_args,
    open_store,
    last_controller,
    require_run,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "delete", help="delete a run: its log in Redis and its run directory",
        description="Delete a run: its stream, meta and snapshot in Redis and its run "
        "directory (metrics, TensorBoard, logs, checkpoints, spill).",
        epilog="example:\n  rl-controller delete --run exp1 --yes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--run", required=True, help="run id (see 'rl-controller runs')")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--force", action="store_true",
                   help="delete an unfinished run whose last controller ran on another host")
    add_store_args(p)
    p.set_defaults(func=cmd_delete)

    s = sub.add_parser(
        "stop-server", help="stop the embedded redis-server of --data-dir",
        description="Stop the embedded redis-server of --data-dir (later commands start "
        "it again when they need it). An external Redis is never touched.",
    )
    s.add_argument("--data-dir", default=DEFAULT_DATA_DIR,
                   help="run directory of the embedded default (default: %(default)s)")
    s.set_defaults(func=cmd_stop_server)


def _check_not_held(args: argparse.Namespace, store, run_id: str) -> int:
    info = next(r for r in store.list_runs() if r.run_id == run_id)
    holder = last_controller(store, run_id, info.last_position)
    if holder.running_here():
        raise CliError(
            f"run {run_id} is held by a running controller (pid {holder.pid} on this host); "
            "stop it first (Ctrl-C in its terminal)"
        )
    if holder.elsewhere() and not args.force:
        raise CliError(
            f"run {run_id} is not finished and its last controller ran on host {holder.host} "
            f"(pid {holder.pid}); if that controller is gone, pass --force"
        )
    return info.last_position


def cmd_delete(args: argparse.Namespace) -> int:
    run_id = args.run
    run_dir = Path(args.data_dir) / "runs" / run_id
    with open_store(args) as store:
        if not store.run_exists(run_id) and run_dir.is_dir():
            return _delete_orphan_dir(args, run_id, run_dir)
        require_run(store, run_id)
        events = _check_not_held(args, store, run_id)
        where = f" and {run_dir}" if run_dir.exists() else ""
        if not _confirmed(args, run_id, f"delete run {run_id} ({events} events){where}?"):
            print("nothing deleted")
            return 1
        store.delete_run(run_id)
    removed = run_dir.exists()
    if removed:
        shutil.rmtree(run_dir)
    print(f"deleted run {run_id}: {events} events" + (f" and {run_dir}" if removed else ""))
    print(f"  runs left: {followup.command(args, 'runs')}")
    return 0


def _confirmed(args: argparse.Namespace, run_id: str, question: str) -> bool:
    if args.yes:
        return True
    if not sys.stdin.isatty():
        raise CliError(f"delete asks for confirmation: pass --yes to delete run {run_id}")
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def _delete_orphan_dir(args: argparse.Namespace, run_id: str, run_dir: Path) -> int:
    """A run directory the store has no log for: only the directory goes."""
    if not _confirmed(args, run_id, f"delete {run_dir} (no log of run {run_id} in the store)?"):
        print("nothing deleted")
        return 1
    shutil.rmtree(run_dir)
    print(f"deleted {run_dir} (the store has no log of run {run_id})")
    return 0


def _runs_held_here(data_dir: str) -> list[str]:
    """The embedded server's runs whose controller is alive on this host (none when no
    server runs: nothing is started to ask)."""
    from events.embedded import running_embedded_url
    from events.errors import EventStoreError

    url = running_embedded_url(data_dir)
    if url is None:
        return []
    plain = argparse.Namespace(redis_url=url, redis_sentinel="", redis_master="", data_dir=data_dir)
    try:
        with open_store(plain) as store:
            return [
                f"{info.run_id} (pid {holder.pid})" for info in store.list_runs()
                if (holder := last_controller(store, info.run_id, info.last_position)).running_here()
            ]
    except (CliError, EventStoreError):
        return []


def cmd_stop_server(args: argparse.Namespace) -> int:
    from events.embedded import stop_embedded_redis

    # A running controller's appends would fail: its run stops (exit status 4), seen
    # when stop-server was run beside a run that used the same --data-dir.
    held = _runs_held_here(args.data_dir)
    if held:
        raise CliError(f"the embedded redis-server of {args.data_dir} holds the log of a run "
                       f"whose controller is running on this host: {', '.join(held)}; stop "
                       "it first (Ctrl-C in its terminal)")
    if stop_embedded_redis(Path(args.data_dir)):
        print(f"stopped the embedded redis-server of {args.data_dir}")
    else:
        print(f"no embedded redis-server is running for {args.data_dir}")
    return 0
