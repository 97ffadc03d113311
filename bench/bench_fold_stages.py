"""Where an episode group's fold goes, stage by stage, timed by thread CPU (no profiler).

Runs the real controller in virtual time on the in-memory store (``bench_episodes``'s
"now" mode: 10-turn episodes, one pause per turn, the default linger), then folds the
log it wrote again with a thread-CPU timer around each event (the timer's own cost,
measured on empty pairs, taken off), per event type; and, at each commit, the
commit-time stages alone on the state just before it (the episodes' and segments'
commit checks, ``summarize``, the segment keys the recorder asks for a finished group,
``turn_advantages`` of the committed group). Best of ``--reps`` folds, per group, with
the collector off (as the projector folds).

    python bench/bench_fold_stages.py --generators 1024
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_episodes import with_partial  # noqa: E402
from bench.bench_scale import config_for, timings_for  # noqa: E402
from controller.core import episodes, segments  # noqa: E402
from controller.core.reducer import HANDLERS, apply_event  # noqa: E402
from controller.core.state import RunState, initial_state  # noqa: E402
from controller.core.turns import expand  # noqa: E402
from events.memory_store import MemoryEventStore  # noqa: E402
from events.schema import AnyEvent, EpisodeTurnsRecorded, GroupCommitted  # noqa: E402
from events.store import EventStore  # noqa: E402
from sim.harness import SimOutcome, SimSpec, simulate  # noqa: E402

_clock = time.thread_time


def now_run(store: EventStore, generators: int, groups: int, run_id: str) -> SimOutcome:
    """One "now" run (``bench_episodes``: 10-turn episodes, the default linger) on ``store``."""
    cfg = with_partial(config_for(generators, groups, window=2, selection="oldest_first"))
    return simulate(store, SimSpec(config=cfg, timings=timings_for(cfg, 30.0, 0.5, 1.05),
                                   run_id=run_id, charge_real_time=True, episode_turns=10))


def recorded_log(generators: int, groups: int, run_id: str = "stages") -> tuple[list[AnyEvent], float]:
    """The events of one "now" run on the in-memory store, and its controller CPU per group."""
    store = MemoryEventStore()
    out = now_run(store, generators, groups, run_id)
    events = [s.event for s in store.read(run_id)]
    committed = sum(1 for e in events if type(e) is GroupCommitted)
    return events, out.controller_cpu_s / committed


def timer_cost_s(n: int = 100_000) -> float:
    """One thread-CPU timer pair's own cost."""
    t0 = _clock()
    for _ in range(n):
        _clock()
        _clock()
    return (_clock() - t0) / n


def _commit_stages(state: RunState, ev: GroupCommitted) -> dict[str, Callable[[], object]]:
    rec, segs = state.episodes.get(ev.group_id), state.inflight.get(ev.group_id)
    s, e = ev.weight_version_start, ev.weight_version_end
    out: dict[str, Callable[[], object]] = {}
    if rec is not None:
        out["commit: episodes.commit_problem"] = lambda: episodes.commit_problem(rec, ev.rewards)
        out["commit: episodes.summarize"] = lambda: episodes.summarize(rec, segs)
    if segs is not None:
        out["commit: segments.commit_problem"] = lambda: segments.commit_problem(segs, ev.lengths, s, e)
        out["commit: segments.commit_summary"] = lambda: segments.commit_summary(segs, ev.lengths, s, e)
        out["segment_keys of a finished group"] = lambda: segments.segment_keys(state.inflight, [ev.group_id])
    return out


def _timed_parts(state: RunState, event: EpisodeTurnsRecorded, position: int,
                 spent: dict[str, float], overhead: float) -> None:
    """A pause folded part by part (as the observed fold does), each part timed."""
    clock = _clock
    t0 = clock()
    parts = expand(event)
    spent["pause, split: expand"] += clock() - t0 - overhead
    for part in parts:
        t0 = clock()
        HANDLERS[type(part)](state, part, position)
        spent[f"pause, split: {type(part).__name__}"] += clock() - t0 - overhead
    state.position = position


def timed_fold(events: list[AnyEvent], overhead: float, split_pauses: bool = False) -> dict[str, float]:
    """CPU seconds per stage over one fold of ``events`` (``split_pauses``: each pause's
    expansion and parts timed apart instead of the pause as a whole)."""
    spent: dict[str, float] = defaultdict(float)
    state = initial_state()
    clock = _clock
    for position, event in enumerate(events, start=1):
        if type(event) is GroupCommitted:
            for name, stage in _commit_stages(state, event).items():
                t0 = clock()
                stage()
                spent[name] += clock() - t0 - overhead
        if split_pauses and type(event) is EpisodeTurnsRecorded:
            _timed_parts(state, event, position, spent, overhead)
            continue
        t0 = clock()
        apply_event(state, event, position)
        spent[type(event).__name__] += clock() - t0 - overhead
        if type(event) is GroupCommitted and state.groups[event.group_id].episode is not None:
            summary = state.groups[event.group_id].episode
            t0 = clock()
            episodes.turn_advantages(summary)
            spent["turn_advantages (at training)"] += clock() - t0 - overhead
    return spent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generators", type=int, default=1024)
    p.add_argument("--groups", type=int, default=1024, help="groups per step budget (bench_scale)")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    if args.generators < 1 or args.reps < 1:
        p.error("--generators and --reps must be >= 1")
    events, cpu_s = recorded_log(args.generators, args.groups)
    groups = sum(1 for e in events if type(e) is GroupCommitted)
    overhead = timer_cost_s()
    best: dict[str, float] = {}
    for _ in range(args.reps):
        for split in (False, True):
            # the collector off, as the projector's fold runs (its full passes over the
            # recorded log held here would be noise in every stage)
            gc.collect()
            gc.disable()
            try:
                spent = timed_fold(events, overhead, split)
            finally:
                gc.enable()
            for name, s in spent.items():
                best[name] = min(best.get(name, s), s)
    counts: dict[str, int] = defaultdict(int)
    for e in events:
        counts[type(e).__name__] += 1
    print(f"{args.generators} generators: {groups} groups, controller CPU {1e3 * cpu_s:.3f} ms per group "
          f"(this run); timer pair {1e9 * overhead:.0f} ns, taken off")
    fold_s = sum(s for name, s in best.items() if name in counts)
    print(f"  {'the fold, every event':40s} {1e3 * fold_s / groups:7.3f} ms per group")
    for name, s in sorted(best.items(), key=lambda kv: -kv[1]):
        each = f"{1e6 * s / counts[name]:7.2f} us each, {counts[name] / groups:5.2f} per group" if name in counts else ""
        print(f"  {name:40s} {1e3 * s / groups:7.3f} ms per group  {each}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
