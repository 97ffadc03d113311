"""The log writer's fold of an episode log, at a git revision against the working tree's.

Whole controller runs cannot resolve a change of a few us per pause (their spread is
10-20 %), so this folds one recorded log the way ``LogWriter.append`` folds a live run's
batches: each pause and commit as a batch of its own, through ``core.prefold`` (a
pause marked, then applied before the write; a commit checked) and
``fold_after_write`` (a commit applied with what its checks found), any other event by
``apply_event``; before each commit, the recorder's ``segment_keys`` of its group (read
while the records still hold it). The log is one "now" run of ``bench_episodes`` on
the in-memory store (10-turn episodes, today's defaults), recorded once by the working
tree; each side folds it in a child process importing its own copy of the code (the
working tree or ``--this``, and ``--base``, each extracted with ``git archive``), the order alternating
from round to round, the collector off (best of ``--reps`` folds per round).

Printed per side and round, in ms per committed group: the whole fold untimed, then
one more timed fold's stages (thread CPU around each call, the timer pair's own cost
taken off): the pauses' marks and handlers, the commits' checks, the fold after the
write (the commits' apply and every position), ``segment_keys``, the other events.

    python bench/bench_fold_writer.py --base main --rounds 3
    python bench/bench_fold_writer.py --base main --rounds 0 --instructions

``--instructions`` also runs each side's child under cachegrind (valgrind) and prints the
instructions of one fold per group: a count the machine's load does not move, so a cut
of 1 % of the fold shows where thread CPU (10 % apart between two runs of one code on
the shared machine) cannot; an instruction is not a nanosecond, so a cut is kept on both.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def record(path: Path, generators: int, groups: int) -> None:
    """Write one "now" run's events, one encoded event a line."""
    sys.path.insert(0, str(ROOT))
    from bench.bench_fold_stages import now_run
    from events.codec import encode
    from events.memory_store import MemoryEventStore

    store = MemoryEventStore()
    now_run(store, generators, groups, "writer")
    with path.open("wb") as out:
        for stored in store.read("writer"):
            out.write(encode(stored.event) + b"\n")


def child(code: Path, log: Path, reps: int) -> dict:
    """The fold of ``log`` by the code under ``code``: per group, best untimed and stages."""
    sys.path.insert(0, str(code))
    from controller.core.prefold import fold_after_write, prefold
    from controller.core.reducer import apply_event
    from controller.core.segments import segment_keys
    from controller.core.state import initial_state
    from events.codec import decode
    from events.schema import EpisodeTurnsRecorded, GroupCommitted, SegmentsRecorded

    events = [decode(line) for line in log.read_bytes().splitlines() if line]
    pauses = (EpisodeTurnsRecorded, SegmentsRecorded)
    groups = sum(1 for e in events if type(e) is GroupCommitted)

    def fold(clock=None, spent=None):  # noqa: ANN001, ANN202
        state = initial_state()
        for pos, event in enumerate(events, start=1):
            kind = type(event)
            if kind is GroupCommitted:
                t0 = clock() if clock else 0.0
                segment_keys(state.inflight, [event.group_id])
                if clock:
                    spent["segment_keys"] += clock() - t0
            if kind is GroupCommitted or kind in pauses:
                t0 = clock() if clock else 0.0
                done = prefold(state, [event], pos)
                t1 = clock() if clock else 0.0
                fold_after_write(state, done, 0, event, pos)
                if clock:
                    t2 = clock()
                    spent["commit check" if kind is GroupCommitted else "pause prefold"] += t1 - t0
                    spent["fold after write" + (" (commit)" if kind is GroupCommitted else "")] += t2 - t1
            else:
                t0 = clock() if clock else 0.0
                apply_event(state, event, pos)
                if clock:
                    spent["other events"] += clock() - t0
        return state

    clock = time.thread_time
    gc.collect()
    gc.disable()
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        fold()
        best = min(best, clock() - t0)
    spent: dict[str, float] = defaultdict(float)
    fold(clock, spent)
    gc.enable()
    return {"fold_ms": 1e3 * best / groups, "groups": groups,
            "stages": {k: 1e3 * v / groups for k, v in sorted(spent.items())}}


def run_child(code: Path, log: Path, reps: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(code), "--log", str(log),
           "--reps", str(reps)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=code)
    if done.returncode != 0:
        sys.exit(f"bench_fold_writer: the fold of {code} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def instructions(code: Path, log: Path) -> int:
    """Instructions one untimed fold of ``log`` takes with the code under ``code``: the
    child under cachegrind with one more fold than a run of the same child (a count, not
    a time: the same on a loaded machine, to ~0.1 % of a fold)."""
    counts = []
    for reps in (0, 1):
        cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
               sys.executable, str(Path(__file__).resolve()), "--child", str(code), "--log", str(log),
               "--reps", str(reps)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=code, env={**os.environ, "PYTHONHASHSEED": "0"})
        refs = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
        if done.returncode != 0 or refs is None:
            sys.exit(f"bench_fold_writer: cachegrind on {code} failed: {done.stderr.strip().splitlines()[-1:]}")
        counts.append(int(refs.group(1).replace(",", "")))
    return counts[1] - counts[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default=None, help="the revision to compare with (none: this tree only)")
    p.add_argument("--this", default=None, help="a revision to stand for the working tree")
    p.add_argument("--generators", type=int, default=1024)
    p.add_argument("--groups", type=int, default=1024, help="groups per step budget (bench_scale)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="folds per round (best taken)")
    p.add_argument("--instructions", action="store_true",
                   help="also count each side's instructions per fold under cachegrind (valgrind)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.instructions and shutil.which("valgrind") is None:
        p.error("--instructions needs valgrind (cachegrind) on the PATH")
    if args.child:
        print(json.dumps(child(Path(args.child), Path(args.log), args.reps)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        record(log, args.generators, args.groups)
        sys.path.insert(0, str(ROOT))
        from bench.bench_episode_ab import extract  # git archive of the revision

        revs = {"base": args.base, "this": args.this}
        codes = {}
        for side, rev in revs.items():
            if rev is not None:
                (Path(tmp) / side).mkdir()
                codes[side] = extract(rev, Path(tmp) / side)
        codes.setdefault("this", ROOT)
        runs: dict[str, list[dict]] = {k: [] for k in codes}
        for r in range(args.rounds):
            for k in (list(codes) if r % 2 == 0 else list(codes)[::-1]):
                x = run_child(codes[k], log, args.reps)
                runs[k].append(x)
                stages = ", ".join(f"{name} {ms:.4f}" for name, ms in x["stages"].items())
                print(f"  round {r} {k:>4}: fold {x['fold_ms']:.4f} ms per group ({x['groups']} groups); "
                      f"timed: {stages}", flush=True)
        means = {k: sum(x["fold_ms"] for x in rs) / len(rs) for k, rs in runs.items() if rs}
        for k, m in means.items():
            best = min(x["fold_ms"] for x in runs[k])
            print(f"{k:>4} ({revs[k] or 'working tree'}): mean fold {m:.4f}, best {best:.4f} ms per group")
        if len(means) == 2:
            print(f"base / this = x{means['base'] / means['this']:.3f}")
        if args.instructions:
            groups = sum(1 for line in log.read_bytes().splitlines() if b'"type":"GroupCommitted"' in line)
            count = {k: instructions(code, log) for k, code in codes.items()}
            for k, n in count.items():
                print(f"{k:>4}: {n / groups / 1e6:.4f} M instructions per group in one fold")
            if len(count) == 2:
                print(f"instructions base / this = x{count['base'] / count['this']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
