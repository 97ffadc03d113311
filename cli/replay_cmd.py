"""The read-only subcommands: ``runs``, ``tail``, ``replay``, ``staleness``, ``audit``.

None of them appends to a log; all work on a live run (they read what is there now)
and on the embedded default with no flags (``./rlc-data``, see ``cli.common``).
Exit status: 0 ok, 1 the log has a problem (malformed entry or invariant violation,
named by position), 2 a usage or store error (one line on stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from cli import followup, render
from cli.common import (
    CliError,
    add_run_arg,
    open_store,
    orphan_run_dirs,
    output_file,
    require_run,
    subcommand,
)
from cli.tail_cmd import register_tail

def register(subparsers: Any) -> None:
    """Add the read-only subcommands to the ``rl-controller`` parser."""
    _register_runs(subparsers)
    register_tail(subparsers)
    add_replay_arguments(
        subcommand(subparsers, "replay", "the folded state at any point of a run",
             "  rl-controller replay --run r1 --at 1200\n"
             "  rl-controller replay --run r1 --step 7 --json\n"
             "  rl-controller replay --run r1 --episode g000003/1      # one episode, turn by turn\n"
             "  rl-controller replay --run r1 --retrain --verify        # rebuild the weights\n"
             "  rl-controller replay --run r1 --retrain --from-checkpoint 20 --verify"),
    ).set_defaults(func=cmd_replay)
    _register_staleness(subparsers)
    _register_audit(subparsers)


# -- runs --------------------------------------------------------------------------------


def _register_runs(subparsers: Any) -> None:
    p = subcommand(subparsers, "runs", "list the runs in the store",
             "  rl-controller runs\n  rl-controller runs --redis-url redis://host:6379/0 --json")
    p.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    p.set_defaults(func=cmd_runs)


def cmd_runs(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        rows = [_run_row(store, info) for info in store.list_runs()]
    if args.json:
        render.write_json(rows)
        return 0
    render.console().print(render.runs_table(rows))
    orphans = orphan_run_dirs(args, {row["run_id"] for row in rows})
    if orphans:
        print(f"run directories without a log in this store: {', '.join(orphans)} "
              f"(remove one with: {followup.command(args, 'delete', '--run', orphans[0])})")
    return 0


def _run_row(store: Any, info: Any) -> dict[str, Any]:
    """Cheap facts: last event type says finished; the newest StepFinished (or RunRewound)
    says the trainer_version, 0 when the log has none. Read back a page at a time: a
    tail of 200 without a step (a run that stopped on failed generations, a long
    multi-turn step) showed '?' for a version the log states."""
    finished, version = None, None
    if info.last_position:
        last = store.read_raw(info.run_id, info.last_position, info.last_position)
        finished = bool(last) and last[-1].event_type == "RunFinished"
        version = _newest_version(store, info.run_id, info.last_position)
    return {
        "run_id": info.run_id,
        "events": info.last_position,
        "epoch": info.epoch,
        "finished": finished,
        "trainer_version": version,
        "snapshot_position": info.snapshot_position,
    }


def _newest_version(store: Any, run_id: str, last: int, page: int = 200) -> int | None:
    """trainer_version after the newest StepFinished/RunRewound at or before ``last``;
    0 when there is none; None when that event does not decode."""
    from events.codec import decode
    from events.errors import EventDecodeError

    while last >= 1:
        for entry in reversed(store.read_raw(run_id, max(1, last - page + 1), last)):
            if entry.event_type in ("StepFinished", "RunRewound"):
                try:
                    event = decode(entry.data, entry.position)
                except EventDecodeError:
                    return None
                version = getattr(event, "trainer_version", None)
                return event.to_trainer_version if version is None else version  # type: ignore[union-attr]
        last -= page
    return 0


# -- replay ------------------------------------------------------------------------------


def add_replay_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``replay``; extend the command by adding more to ``parser``."""
    add_run_arg(parser)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--at", type=int, metavar="POSITION",
                       help="the state right after the event at POSITION (default: the end)")
    where.add_argument("--until", type=int, metavar="POSITION", dest="until",
                       help="older spelling of --at")
    where.add_argument("--step", type=int, metavar="K",
                       help="the state right after step K's StepFinished or StepAborted")
    where.add_argument("--episode", metavar="GROUP/SAMPLE",
                       help="print one multi-turn episode turn by turn: tokens, observations, "
                            "weight versions, env calls and rewards")
    parser.add_argument("--json", action="store_true", help="JSON instead of tables")
    parser.add_argument("--no-snapshot", action="store_true",
                        help="fold from the first event even when a snapshot would do")
    retrain = parser.add_argument_group(
        "deterministic replay",
        "rebuild the weights by re-running the log's finished steps (up to --at/--step) "
        "and compare each step's weights digest with its StepFinished",
    )
    retrain.add_argument("--retrain", action="store_true",
                         help="re-train the logged steps from the spilled payloads")
    retrain.add_argument("--from-checkpoint", type=int, metavar="V", dest="from_checkpoint",
                         help="start from the run's checkpoint of trainer_version V "
                              "(default: the initial weights)")
    retrain.add_argument("--verify", action="store_true",
                         help="stop at the first digest mismatch and exit 1")
    return parser


def replay_point(args: argparse.Namespace, store: Any) -> Any:
    """Fold to the point ``args`` names; raises CliError / the log's problem."""
    from controller.projector import Projector

    require_run(store, args.run)
    at = args.at if args.at is not None else args.until
    flag = "--at" if args.at is not None else "--until"  # the spelling the user typed
    if at is not None and at < 1:
        raise CliError(f"{flag} must be >= 1, got {at}")
    end = store.last_position(args.run)
    if at is not None and at > end:
        raise CliError(f"{flag} {at} is past the end of run {args.run!r} (last position {end})")
    result = Projector(store).get(args.run, until=at, stop_step=args.step,
                                  snapshot=not args.no_snapshot,
                                  progress=render.progress("replay"))
    if result.problem is not None:
        raise CliError(result.problem.describe(), 1)
    if args.step is not None and not result.reached:
        ended = sorted(result.state.steps)
        raise CliError(
            f"step {args.step} has not ended in run {args.run!r} "
            f"(ended steps: {_ranges(ended) or 'none'})"
        )
    return result


def _ranges(values: list[int]) -> str:
    if not values:
        return ""
    return f"{values[0]}..{values[-1]}" if len(values) > 3 else ", ".join(map(str, values))


def cmd_replay(args: argparse.Namespace) -> int:
    from replay.point import state_at

    if (args.from_checkpoint is not None or args.verify) and not args.retrain:
        raise CliError("--from-checkpoint and --verify go with --retrain")
    if args.episode is not None:
        if args.retrain:
            raise CliError("--episode and --retrain do not go together")
        return _cmd_episode(args)
    with open_store(args) as store:
        result = replay_point(args, store)
    if args.retrain:
        return _cmd_retrain(args, result.state)
    point = state_at(result.state, result.last_ts, log_end=result.log_end)
    if args.step is not None:
        point["at_step"] = render.step_summary(result.state.steps[args.step])
    if args.json:
        render.write_json(point)
    else:
        con = render.console()
        for table in render.point_tables(point):
            con.print(table)
    return 0


def _parse_episode(text: str) -> tuple[str, int]:
    group, _, sample = text.partition("/")
    sample = sample.removeprefix("s")
    if not group or not sample.isdigit():
        raise CliError(f"--episode {text!r}: expected GROUP/SAMPLE, e.g. g000003/1")
    return group, int(sample)


def _cmd_episode(args: argparse.Namespace) -> int:
    from pathlib import Path

    from events import schema as ev
    from replay.episode import EpisodeNotFound, episode_view, fill_ids, render_episode
    from views import source

    group, sample = _parse_episode(args.episode)
    with open_store(args) as store:
        require_run(store, args.run)
        # read page by page, only this group's events kept: a long log is never held whole
        events = [e for _, e in source.events(store, args.run)
                  if getattr(e, "group_id", None) == group]
    try:
        view = episode_view(args.run, events, group, sample)
    except EpisodeNotFound as err:
        raise CliError(str(err)) from None
    spill = Path(args.data_dir) / "runs" / args.run / "spill"
    if spill.is_dir():  # token ids: only the data plane has them
        from workers.dataplane import DataPlaneError, SpillReader

        # only this group's puts are opened, and nothing is removed: the run may be live
        keys = [e.payload_keys[sample] for e in events
                if isinstance(e, ev.GroupCommitted) and e.group_id == group]
        try:
            fill_ids(view, SpillReader(spill), keys[-1] if keys else None)
        except DataPlaneError as err:  # a spill of an earlier release, or one being cleared
            raise CliError(str(err)) from None
    if args.json:
        render.write_json(view.to_dict())
    else:
        print("\n".join(render_episode(view)))
    return 0


def _cmd_retrain(args: argparse.Namespace, state: Any) -> int:
    from pathlib import Path

    from replay.retrain import RetrainError, run_retrain

    run_dir = Path(args.data_dir) / "runs" / args.run

    def show(check: Any) -> None:
        if not args.json:
            mark = "match" if check.match else "MISMATCH"
            print(f"step {check.step:>5}  v{check.trainer_version:<5} {mark:<8} "
                  f"recorded {check.recorded[:16]}  replayed {check.replayed[:16]}  "
                  f"{check.replay_s * 1000:7.1f} ms (original {check.original_s * 1000:.1f} ms)",
                  flush=True)

    try:
        report = run_retrain(state, run_dir, from_version=args.from_checkpoint,
                             stop_on_mismatch=args.verify, on_step=show)
    except RetrainError as err:
        raise CliError(str(err)) from None
    if args.json:
        render.write_json(report.to_dict())
    else:
        bad = [c for c in report.checks if not c.match]
        print(f"replayed {len(report.checks)} steps from trainer_version {report.from_version}: "
              + ("all digests match" if not bad else f"{len(bad)} mismatch(es), first at step "
                 f"{bad[0].step}") + f"; final weights {report.final_digest}")
    return 1 if args.verify and not report.ok else 0


# -- staleness ---------------------------------------------------------------------------


def _register_staleness(subparsers: Any) -> None:
    p = subcommand(subparsers, "staleness", "lag analysis, plots and policy what-if",
             "  rl-controller staleness --run r1\n"
             "  rl-controller staleness --run r1 --json --plot staleness.png\n"
             "  rl-controller staleness --run r1 --what-if window=0 --what-if policy=oldest_first")
    add_run_arg(p)
    p.add_argument("--json", action="store_true", help="JSON instead of tables")
    p.add_argument("--plot", metavar="FILE.png", help="write lag/occupancy/reward plots")
    p.add_argument("--what-if", action="append", default=[], metavar="KEY=VALUE",
                   help="re-run the policies with window=N, policy=in_order|oldest_first|"
                        "ready_first or microbatch=N (repeatable)")
    p.add_argument("--last", type=int, default=30, metavar="N",
                   help="steps shown in the table (0 = all; JSON has all)")
    p.set_defaults(func=cmd_staleness)


def _check_last(args: argparse.Namespace) -> None:
    """``--last N`` shows the newest N rows; a negative N showed all but the oldest |N|."""
    if args.last < 0:
        raise CliError(f"--last must be >= 0 (0 = all), got {args.last}")


def cmd_staleness(args: argparse.Namespace) -> int:
    from controller.projector import Projector
    from replay import staleness, whatif
    from replay.plots import plot_formats

    _check_last(args)
    if args.plot:
        output_file("--plot", args.plot, formats=plot_formats())
    with open_store(args) as store:
        require_run(store, args.run)
        trace = staleness.Trace()
        what_if = whatif.WhatIf(args.what_if) if args.what_if else None  # checks the keys
        result = Projector(store).get(args.run, observers=[trace] + ([what_if] if what_if else []),
                                      progress=render.progress("staleness"))
        if result.problem is not None:
            raise CliError(result.problem.describe(), 1)
        report = staleness.analyze(result.state, trace)
        comparison = None if what_if is None else whatif.compare(result.state, what_if.result())
    data = report.to_dict()
    if comparison is not None:
        data["what_if"] = comparison
    if args.plot:
        from replay.plots import write_plot

        write_plot(report, args.plot)
    if args.json:
        render.write_json(data)
    else:
        con = render.console()
        for table in render.staleness_tables(data, args.last):
            con.print(table)
        if comparison is not None:
            for table in render.whatif_tables(comparison):
                con.print(table)
        if args.plot:
            con.print(f"plot written to {args.plot}")
    return 0


# -- audit -------------------------------------------------------------------------------


def _register_audit(subparsers: Any) -> None:
    p = subcommand(subparsers, "audit", "trainer_version history and invariant check",
             "  rl-controller audit --run r1            # exit 1 names the first bad position\n"
             "  rl-controller audit --run r1 --csv history.csv")
    add_run_arg(p)
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="the whole report as JSON")
    out.add_argument("--csv", metavar="FILE", help="write one row per trainer_version to FILE")
    p.add_argument("--last", type=int, default=50, metavar="N",
                   help="rows shown per table (0 = all; JSON/CSV have all)")
    p.add_argument("--chain-key-file", metavar="FILE", default=None,
                   help="HMAC key of the run's hash chain (default: $RLC_CHAIN_KEY_FILE)")
    p.set_defaults(func=cmd_audit)


def cmd_audit(args: argparse.Namespace) -> int:
    from cli.common import load_chain_key
    from replay.audit import build_report, write_csv
    from replay.chain_audit import audit_log

    _check_last(args)
    if args.chain_key_file is None:  # a bad key file is named as where it came from
        key = load_chain_key(os.environ.get("RLC_CHAIN_KEY_FILE", ""), "RLC_CHAIN_KEY_FILE")
    else:
        key = load_chain_key(args.chain_key_file, "--chain-key-file")
    if args.csv:
        output_file("--csv", args.csv, create_parents=False)
    with open_store(args) as store:
        require_run(store, args.run)
        result, chain = audit_log(store, args.run, key, render.progress("audit"))
        report = build_report(result)
    if args.json:
        render.write_json({**report.to_dict(), "chain": chain.to_dict()})
    else:
        if args.csv:
            with open(args.csv, "w", newline="") as fh:
                write_csv(report, fh)
        con = render.console()
        for table in render.audit_tables(report.to_dict(), args.last):
            con.print(table)
        con.print(chain.describe(), markup=False, highlight=False)
    if chain.status == "broken" and (
        report.problem is None or (chain.position or 0) <= report.problem["position"]
    ):
        print(f"rl-controller: audit failed: chain at position {chain.position}: "
              f"{chain.reason}", file=sys.stderr)
        return 1
    if report.problem is not None:
        p = report.problem
        print(f"rl-controller: audit failed: {p['kind']} at position {p['position']}: {p['reason']}",
              file=sys.stderr)
        return 1
    return 0
