"""Output of the read-only commands: rich tables for people, JSON for programs."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, TextIO

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from events.codec import full_form
from events.schema import AnyEvent
from workers.api import CHECKPOINT_MANIFEST

_COMMON = {"type", "event_id", "epoch", "ts", "schema_version"}


def console(file: TextIO | None = None) -> Console:
    out = file or sys.stdout
    # Piped or captured output gets wide tables rather than 80 squeezed columns.
    width = None if out.isatty() else 160
    return Console(file=out, highlight=False, soft_wrap=False, width=width)


def write_json(obj: Any, file: TextIO | None = None) -> None:
    out = file or sys.stdout
    out.write(msgspec.json.encode(obj).decode())
    out.write("\n")


def progress(what: str, file: TextIO | None = None) -> Callable[[int, int], None]:
    """A fold's progress callback: one line on stderr per report (stdout stays the
    report's, JSON included)."""
    out = file or sys.stderr
    started = time.perf_counter()

    def report(done: int, total: int) -> None:
        share = f" ({done / total:.0%})" if total else ""
        print(f"{what}: {done:,} of {total:,} events{share} after "
              f"{time.perf_counter() - started:.0f}s", file=out, flush=True)

    return report


def iso(ts: float) -> str:
    if not ts:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


# -- tail --------------------------------------------------------------------------------


def _short(value: Any) -> str:
    if isinstance(value, list):
        if len(value) > 4:
            head = ",".join(_short(v) for v in value[:3])
            return f"[{head},...+{len(value) - 3}]"
        return "[" + ",".join(_short(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_short(v)}" for k, v in list(value.items())[:6]) + (
            ",..." if len(value) > 6 else ""
        ) + "}"
    if isinstance(value, str) and not value.isprintable():
        # a reason an older version recorded from Ray's coloured, multi-line traceback:
        # one event stays one line, without terminal codes
        return " ".join(_ANSI.sub("", value).split())
    return str(value)


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def _turn(key: str, v: dict[str, Any]) -> str:
    again = f".r{v['restart']}" if v.get("restart") else ""
    if key == "results":
        what = f"={_short(v['reward'])}" + ("!" if v["ended"] else "")
    else:
        what = f":{v['length']}" if key == "segments" else ""
    return f"s{v['sample']}{again}/t{v['turn']}{what}"


def _turns(key: str, value: Any) -> str | None:
    """An episode's records as turns (``s<sample>/t<turn>``), not as a dict each: what a
    reader of ``tail`` follows in a multi-turn run. None: not such a record."""
    if key not in ("calls", "results", "segments") or not value or "turn" not in value[0]:
        return None
    if key == "segments" and not any(v["turn"] for v in value):
        return None  # single-turn partial rollouts: the plain rendering
    items = [_turn(key, v) for v in value]
    return "[" + " ".join(items[:8]) + (f" ...+{len(items) - 8}" if len(items) > 8 else "") + "]"


def event_line(position: int, event: AnyEvent) -> str:
    """One line per event: position, time, epoch, type, its own fields (an episode's
    calls, results and segments as turns: ``s0/t2=0.5!`` is sample 0's turn 2, its
    reward, and ``!`` where the episode ended)."""
    fields = full_form(event)
    details = " ".join(f"{k}={_turns(k, v) or _short(v)}" for k, v in fields.items() if k not in _COMMON)
    return f"{position:>8}  {iso(event.ts)}  e{event.epoch}  {type(event).__name__:<18} {details}"


def event_json(position: int, event: AnyEvent) -> dict[str, Any]:
    return {"position": position, **full_form(event)}


# -- runs --------------------------------------------------------------------------------


def runs_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="runs")
    for col in ("run", "events", "epoch", "finished", "trainer_version", "snapshot"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        table.add_row(
            r["run_id"], str(r["events"]), str(r["epoch"]),
            {True: "yes", False: "no", None: "?"}[r["finished"]],
            "?" if r["trainer_version"] is None else str(r["trainer_version"]),
            "-" if r["snapshot_position"] is None else str(r["snapshot_position"]),
        )
    return table


# -- replay ------------------------------------------------------------------------------


def step_summary(rec: Any) -> dict[str, Any]:
    """What ``--step K`` landed on, in words: steps count from 0, versions from 1."""
    if rec.trainer_version is not None:
        text = (f"after step {rec.step}, which finished: trainer_version "
                f"{rec.base_trainer_version} -> {rec.trainer_version} (steps count from 0, "
                f"trainer_version from 1, so step K makes version K + 1 when none aborted)")
    else:
        text = (f"after step {rec.step}, which was aborted ({rec.abort_reason}): "
                f"trainer_version stays {rec.base_trainer_version}")
    return {"step": rec.step, "status": rec.status.value,
            "base_trainer_version": rec.base_trainer_version,
            "trainer_version": rec.trainer_version, "text": text}


def point_tables(p: dict[str, Any]) -> list[Table]:
    at_step = p.get("at_step")
    head = Table(title=f"run {p['run_id']} at position {p['position']}"
                 + (f" of {p['log_end']}" if p.get("log_end") else "")
                 + (f"\n{at_step['text']}" if at_step else ""), show_header=False)
    head.add_column("field")
    head.add_column("value")
    for key in ("ts", "epoch", "trainer_version", "weight_version", "window_versions",
                "groups_per_step", "next_step", "step_status", "finished", "stopped"):
        value = iso(p[key]) if key == "ts" else p[key]
        head.add_row(key, "-" if value is None else str(value))
    ckpt = p["latest_checkpoint"]
    head.add_row("latest_checkpoint", "-" if ckpt is None else f"v{ckpt['trainer_version']} {ckpt['uri']}")
    missing = p.get("missing_checkpoints") or []
    if missing:
        head.add_row("missing_checkpoints", ", ".join(
            f"v{ck['trainer_version']} {ck['uri']} (no {CHECKPOINT_MANIFEST})" for ck in missing))
    tables = [head]
    if p["open_step"] is not None:
        o = p["open_step"]
        t = Table(title=f"open step {o['step']} (base v{o['base_trainer_version']}, "
                        f"open {o['age_s']:.1f}s)")
        for col in ("microbatch", "group", "weight_version_start", "lag"):
            t.add_column(col)
        for i, mb in enumerate(o["microbatches"]):
            for g in mb:
                t.add_row(str(i), g["group_id"], str(g["weight_version_start"]), str(g["lag"]))
        tables.append(t)
    buf = Table(title=f"buffer ({len(p['buffer'])} committed, unclaimed; commit order)")
    for col in ("group", "attempt", "age_s", "start", "end", "lag", "reward_mean"):
        buf.add_column(col, justify="left" if col == "group" else "right")
    for g in p["buffer"]:
        buf.add_row(g["group_id"], str(g["attempt"]), f"{g['age_s']:.2f}",
                    str(g["weight_version_start"]), str(g["weight_version_end"]), str(g["lag"]),
                    "-" if g["reward_mean"] is None else f"{g['reward_mean']:.3f}")
    tables.append(buf)
    fl = Table(title=f"in flight ({len(p['in_flight'])} admitted, not committed)")
    for col in ("group", "attempt", "age_s", "dispatch_weight_version"):
        fl.add_column(col, justify="left" if col == "group" else "right")
    for g in p["in_flight"]:
        fl.add_row(g["group_id"], str(g["attempt"]), f"{g['age_s']:.2f}", str(g["dispatch_weight_version"]))
    tables.append(fl)
    return tables


# -- staleness ---------------------------------------------------------------------------


def staleness_tables(report: dict[str, Any], last: int) -> list[Table | Text]:
    steps = report["steps"]
    shown = steps[-last:] if last else steps
    t = Table(title=f"staleness per step (window {report['window']}, capacity {report['capacity']})"
              + (f" -- last {len(shown)} of {len(steps)}" if len(shown) < len(steps) else ""))
    cols = ("step", "version", "groups", "lag mean", "lag max", "lag tok-w", "token lag",
            "span", "turns", "wait mean s", "wait max s", "evicted", "crossed", "reward")
    for c in cols:
        t.add_column(c, justify="right")
    for r in shown:
        t.add_row(str(r["step"]) + (" (lost)" if r["lost"] else ""), str(r["trainer_version"]),
                  str(r["groups"]), f"{r['lag_mean']:.2f}", str(r["lag_max"]),
                  f"{r['lag_token_weighted']:.2f}", f"{r.get('token_lag_mean', 0.0):.2f}",
                  str(r.get("max_partial_span", 0)), str(r.get("turns", 0)), f"{r['wait_mean_s']:.2f}",
                  f"{r['wait_max_s']:.2f}", str(r["evicted"]), str(r["crossed_update"]),
                  f"{r['reward_mean']:.3f}")
    # Values next to their names: the long explanation of the gate goes under the table
    # (as a row it widened the value column and pushed every number to the far right).
    s = Table(title="summary", show_header=False)
    s.add_column("metric")
    s.add_column("value", justify="left")
    for k, v in report["summary"].items():
        s.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    s.add_row("lag histogram", " ".join(f"{k}:{v}" for k, v in report["lag_histogram"].items()))
    return [t, s, Text(f"gate method: {report['gate_method']}")]


def whatif_tables(cmp: dict[str, Any]) -> list[Table]:
    t = Table(title=f"what-if {cmp['settings']} vs recorded")
    t.add_column("")
    t.add_column("recorded", justify="right")
    t.add_column("what-if", justify="right")
    rec, wi = cmp["recorded"], cmp["what_if"]
    t.add_row("steps finished", str(cmp["steps"]["recorded_finished"]), str(cmp["steps"]["what_if_finished"]))
    for key in ("groups", "lag_mean", "lag_max", "lag_token_weighted", "evicted"):
        fmt = (lambda v: f"{v:.3f}") if isinstance(rec[key], float) else str
        t.add_row(key, fmt(rec[key]), fmt(wi[key]))
    t.add_row("identical batches", "", f"{cmp['steps']['identical']} steps")
    t.add_row("different batches", "", f"{cmp['steps']['different']} steps")
    t.add_row("group overlap", "", f"{cmp['group_overlap_fraction']:.1%}")
    t.add_row("trainer delay", "", f"{cmp['trainer_delay_s']:.2f}s")
    t.add_row("stopped", "", cmp["stopped"])
    a = Table(title="what-if assumptions", show_header=False)
    a.add_column("#", justify="right")
    a.add_column("assumption")
    for i, text in enumerate(cmp["assumptions"], 1):
        a.add_row(str(i), text)
    return [t, a]


# -- audit -------------------------------------------------------------------------------


def _checkpoint_dir(history: list[dict[str, Any]]) -> str | None:
    """The one directory every checkpoint of the history is in (None: several, or none)."""
    dirs = {uri.rpartition("/")[0] for r in history for uri in r["checkpoints"]}
    return dirs.pop() if len(dirs) == 1 and "" not in dirs else None


def audit_tables(report: dict[str, Any], last: int) -> list[Table | Text]:
    hist = report["history"]
    shown = hist[-last:] if last else hist
    where = _checkpoint_dir(hist)
    h = Table(title=f"trainer_version history of {report['run_id']}"
              + (f" -- last {len(shown)} of {len(hist)} (--json/--csv for all)" if len(shown) < len(hist) else ""))
    for c in ("version", "step", "time", "groups (id@start:lag)", "lag max", "metrics"):
        h.add_column(c, justify="left" if c.startswith("groups") or c == "metrics" else "right")
    # a path is never cut: names under the caption's directory, else whole, folded
    h.add_column("checkpoint", overflow="fold")
    for r in shown:
        groups = " ".join(f"{g['group_id']}@{g['weight_version_start']}:{g['lag']}" for g in r["groups"][:6])
        if len(r["groups"]) > 6:
            groups += f" +{len(r['groups']) - 6}"
        metrics = " ".join(f"{k}={v:.4g}" for k, v in r["metrics"].items())
        if r["grad_norm"] is not None:
            metrics += f" grad_norm={r['grad_norm']:.4g}"
        h.add_row(str(r["trainer_version"]) + (" (lost)" if r["lost"] else ""), str(r["step"]),
                  iso(r["ended_ts"]), groups, str(r["lag_max"]), metrics,
                  " ".join(uri if where is None else uri[len(where) + 1:] for uri in r["checkpoints"]))
    tables: list[Table | Text] = [h]
    if where is not None:
        tables.append(Text(f"checkpoints in {where}/"))
    if (ep := report["summary"].get("episodes")) is not None:
        tables.append(Text(
            f"episodes: {ep['episodes']} committed in {ep['groups']} groups, {ep['turns']} turns "
            f"(at most {ep['turns_max']} in one), {ep['groups_in_flight']} groups in flight"
            + (f", {ep['groups_failed']} failed (calls kept for a retry)"
               if ep.get("groups_failed") else "")))
    for title, rows, cols in (
        ("aborted steps", report["aborts"], ("step", "base_trainer_version", "reason", "position")),
        ("controller epochs", report["epochs"], ("epoch", "host", "pid", "position")),
        ("rewinds", report["rewinds"], ("from_trainer_version", "to_trainer_version", "lost_steps", "lost_group_ids", "reason", "position")),
        ("rejected checkpoints", report["rejected_checkpoints"], ("trainer_version", "uri", "reason", "position")),
        ("workers lost", report["workers_lost"], ("worker", "role", "reason", "position")),
    ):
        t = Table(title=f"{title} ({len(rows)})")
        for c in cols:
            t.add_column(c)
        for r in rows[-last:] if last else rows:
            t.add_row(*(_short(r[c]) for c in cols))
        tables.append(t)
    s = Table(title="invariants", show_header=False)
    s.add_column("check")
    s.add_column("result")
    problem = report["problem"]
    verdict = "[green]all hold[/green]" if problem is None else "[red]VIOLATED[/red]"
    s.add_row(f"checked positions 1..{report['checked_through']} of {report['log_end']}", verdict)
    for inv in report["invariants"]:
        s.add_row(inv, "")
    if problem is not None:
        s.add_row("[red]first problem[/red]", f"position {problem['position']} ({problem['kind']}): {problem['reason']}")
    tables.append(s)
    return tables
