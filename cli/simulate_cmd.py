"""``rl-controller simulate``: a recorded run re-run in virtual time under other settings.

    rl-controller simulate --run R                              # reproduce the run
    rl-controller simulate --run R --what-if window=0 --what-if window=2
    rl-controller simulate --run R --what-if generators=16,policy=ready_first --plot sim.png

Reads the log only (like ``staleness``); the simulated runs live in memory. Prints, per
scenario next to the recorded run: wall time, groups/s, lag distribution, evictions and
trainer idle time, and whether the recorded settings reproduced the recorded order of
commits and batches. Exit status: 0 ok, 1 the recorded settings did not reproduce the
run (order differs or wall time outside the tolerance), 2 a usage or store error.
"""

from __future__ import annotations

import argparse
from typing import Any

from cli.common import CliError, add_store_args, open_store, output_file, require_run


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="re-run a recorded run in virtual time under another window/policy/fleet",
        description=__doc__.splitlines()[0].split(": ", 1)[1].capitalize(),
        epilog="examples:\n" + "\n".join(__doc__.splitlines()[2:5]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_store_args(p)
    p.add_argument("--run", required=True, metavar="RUN_ID", help="the recorded run")
    p.add_argument("--what-if", action="append", default=[], metavar="KEY=VALUE[,...]",
                   help="one scenario: window, policy, generators, groups_per_call, buffer, "
                        "or any dotted config key (repeatable: one scenario each)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    p.add_argument("--plot", metavar="PNG", help="write progress, lag and trainer-time plots")
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    from cli import render
    from sim.whatif import SimulateError, parse_scenario, run_whatif

    scenarios = [parse_scenario(text) for text in args.what_if]  # WhatIfError: one line
    if args.plot:
        from replay.plots import plot_formats

        output_file("--plot", args.plot, formats=plot_formats())
    with open_store(args) as store:
        require_run(store, args.run)
        try:
            result = run_whatif(store, args.run, scenarios)  # a bad log: one line, exit 1
        except SimulateError as err:
            raise CliError(str(err)) from None
    if args.plot:
        from replay.plots import write_timing_plot

        write_timing_plot(result, args.plot)
    if args.json:
        render.write_json(result.to_dict())
    else:
        _print(result, args.plot)
    repro = result.reproduction()
    ok = repro["commit_order_identical"] and repro["batches_identical"] and repro["within_tolerance"]
    return 0 if ok else 1


def _print(result: Any, plot: str | None) -> None:
    from rich.table import Table

    from cli import render

    con = render.console()
    table = Table(title=f"run {result.run_id}: recorded vs simulated (virtual time)")
    for col in ("", "wall", "groups/s", "lag mean", "p50", "p90", "max", "evicted", "trainer idle",
                "checkpoints"):
        table.add_column(col, justify="left" if not col else "right")
    rows = [("recorded", result.recorded.summary())]
    rows += [(s.name, s.timeline.summary()) for s in result.scenarios]
    for name, s in rows:
        table.add_row(
            name, _duration(s["wall_s"]), f"{s['groups_per_s']:.2f}", f"{s['lag_mean']:.2f}",
            str(s["lag_p50"]), str(s["lag_p90"]), str(s["lag_max"]), str(s["evicted"]),
            f"{_duration(s['trainer_idle_s'])} ({100 * s['trainer_idle_frac']:.0f}%)",
            # checkpoints and payload releases the trainer waited for (a save written
            # behind a step, checkpoint.async_save, is not counted)
            _duration(s["checkpoint_s"]),
        )
    con.print(table)
    r = result.reproduction()
    con.print(
        f"recorded settings reproduce the run: commit order "
        f"{'identical' if r['commit_order_identical'] else 'DIFFERENT'}, batches "
        f"{'identical' if r['batches_identical'] else 'DIFFERENT'}, wall time "
        f"{100 * r['wall_relative_error']:.2f}% off (tolerance {100 * r['wall_tolerance']:.0f}%)"
    )
    from sim.whatif import ASSUMPTIONS

    con.print("assumptions:")
    for a in ASSUMPTIONS:
        con.print(f"  - {a}")
    if plot:
        con.print(f"plot written to {plot}")


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    if seconds >= 60:
        return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"
    return f"{seconds:.2f}s"
