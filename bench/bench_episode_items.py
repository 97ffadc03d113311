"""Where an episode group's per-item CPU goes: the recorded log's items, stage by stage.

Runs the real controller in virtual time on the in-memory store (``bench_episodes``'s
"now" mode: 10-turn episodes, one pause per turn, the default linger), then times, on
the log it wrote, each stage an item of a pause goes through on the controller's side
(encoding, hashing the bytes, expanding a pause into its parts, the fold), best of
``--reps`` by thread CPU, per group and per item (a pause's results, segments and
calls). What is left of the controller's CPU per group beyond these stages is per
append or per pause, not per item (``docs/agents.md``, "Cost").

    python bench/bench_episode_items.py --generators 1024
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_fold_stages import recorded_log  # noqa: E402
from controller.core.reducer import apply_event  # noqa: E402
from controller.core.state import initial_state  # noqa: E402
from controller.core.turns import expand, parts  # noqa: E402
from events.codec import encode  # noqa: E402
from events.schema import EpisodeTurnsRecorded, GroupCommitted  # noqa: E402


def best_cpu_s(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def items_of(event) -> int:  # type: ignore[no-untyped-def]
    return len(getattr(event, "calls", None) or getattr(event, "results", None)
               or getattr(event, "segments", None) or [])


def fold(events: list) -> None:  # type: ignore[type-arg]
    state = initial_state()
    for position, event in enumerate(events, start=1):
        apply_event(state, event, position)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generators", type=int, default=1024)
    p.add_argument("--groups", type=int, default=1024, help="groups per step budget (bench_scale)")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    if args.generators < 1 or args.reps < 1:
        p.error("--generators and --reps must be >= 1")
    events, cpu_s_per_group = recorded_log(args.generators, args.groups, "items")
    raw = [encode(e) for e in events]
    groups = sum(1 for e in events if type(e) is GroupCommitted)
    items = sum(items_of(part) for e in events for part in parts(e))
    print(f"{args.generators} generators: {groups} groups, controller CPU {1e3 * cpu_s_per_group:.3f} "
          f"ms per group; per group {len(events) / groups:.1f} events, {items / groups:.0f} items, "
          f"{sum(map(len, raw)) / groups / 1e3:.1f} kB")
    stages = [("encode (JSON)", lambda: [encode(e) for e in events]),
              ("hash the bytes (sha256)", lambda: [hashlib.sha256(b).digest() for b in raw]),
              ("expand pauses into parts", lambda: [expand(e) for e in events if type(e) is EpisodeTurnsRecorded]),
              ("fold (every check and record)", lambda: fold(events))]
    for name, fn in stages:
        s = best_cpu_s(fn, args.reps)
        print(f"  {name:30s} {1e3 * s / groups:6.3f} ms per group  {1e6 * s / max(1, items):6.3f} us per item")
    return 0


if __name__ == "__main__":
    sys.exit(main())
