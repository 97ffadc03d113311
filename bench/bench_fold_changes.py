"""The fold's cost changes for episode groups, each against the code before it, in one run.

Each change of the fold's fifth pass (``docs/agents.md``, "Cost") keeps its "before" in
the code, so both can run side by side here:

* ``pause``: a pause folded in one pass (``reducer_pauses.fold_pause``, the fold's
  path) against expanding it and folding its parts (``reducer.fold_parts``, what the
  fold did before and what observed folds still do), swapped into ``HANDLERS`` for the
  length of a run.
* ``advantages``: ``episodes.turn_advantages`` (per committed group, when a microbatch
  is built) against the same function as it was at ``--before-rev``, loaded from git
  and swapped in where it is called.
* ``all``: both together against both befores.

Tried and not kept (``docs/episode-cost.md``, "Fifth pass: the fold"): a cheaper
``summarize``, ``commit_problem`` and ``record_flush``; :func:`functions_from` swaps
any such function in from a git revision the same way.

Printed per change: (1) the fold of one recorded log (the in-memory store's "now" run
of ``bench_episodes`` at ``--generators``), best thread CPU of ``--reps`` per round;
(2) whole controller runs in virtual time (loop-thread CPU less the simulated workers,
as ``bench_episodes`` counts it) on the in-memory store, ``--rounds`` rounds with the
order alternated; (3) with ``--redis``, one round on a real redis-server with
``appendfsync always``. All per group.

    python bench/bench_fold_changes.py --generators 1024 --rounds 2 --redis
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_fold_stages import now_run, recorded_log  # noqa: E402
from controller.core import episodes, policies, reducer  # noqa: E402
from controller.core.reducer_pauses import fold_pause  # noqa: E402
from controller.core.state import initial_state  # noqa: E402
from events.memory_store import MemoryEventStore  # noqa: E402
from events.redis_store import RedisEventStore  # noqa: E402
from events.schema import AnyEvent, EpisodeTurnsRecorded, GroupCommitted  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


@contextmanager
def pause_handler(handler: Callable[..., None]) -> Iterator[None]:
    """``handler`` folds every pause for the length of the block."""
    old = reducer.HANDLERS[EpisodeTurnsRecorded]
    reducer.HANDLERS[EpisodeTurnsRecorded] = handler
    try:
        yield
    finally:
        reducer.HANDLERS[EpisodeTurnsRecorded] = old


#: the commit the fold's fifth pass started from
BEFORE_REV = "17dca2525acd7fdb92a00311bab0cc76245a318c"


def module_at(rev: str, path: str, name: str) -> ModuleType:
    """The module at ``path`` as it was at git revision ``rev`` (loaded beside today's)."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    module = ModuleType(name)
    exec(compile(source, f"{rev[:8]}:{path}", "exec"), module.__dict__)  # noqa: S102
    return module


@contextmanager
def functions_from(source: ModuleType, sites: list[tuple[ModuleType, str]]) -> Iterator[None]:
    """``source``'s function of each site's name is called there for the length of the
    block (a site: the module that calls it by that name)."""
    if hasattr(source, "EpisodeSummary"):
        source.EpisodeSummary = episodes.EpisodeSummary  # summaries of today's type
    old = [getattr(m, a) for m, a in sites]
    for m, a in sites:
        setattr(m, a, getattr(source, a))
    try:
        yield
    finally:
        for (m, a), f in zip(sites, old):
            setattr(m, a, f)


def changes(before_rev: str) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """change -> (before, after): what swaps each in."""
    old_episodes = lambda: module_at(before_rev, "controller/core/episodes.py", "episodes_before")  # noqa: E731
    advantages = [(policies, "turn_advantages")]
    out: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "pause": (lambda: pause_handler(reducer.fold_parts), lambda: pause_handler(fold_pause)),
        "advantages": (lambda: functions_from(old_episodes(), advantages),
                       lambda: functions_from(episodes, advantages)),
    }
    each = list(out.values())
    out["all"] = (lambda: _together([before for before, _ in each]),
                  lambda: _together([after for _, after in each]))
    return out


@contextmanager
def _together(swaps: list[Callable[[], object]]) -> Iterator[None]:
    with ExitStack() as stack:
        for swap in swaps:
            stack.enter_context(swap())  # type: ignore[arg-type]
        yield


CHANGES = ("pause", "advantages", "all")


def fold_cpu_s(events: list[AnyEvent], reps: int) -> tuple[float, float]:
    """(the fold of ``events``, ``turn_advantages`` of every committed group): best thread
    CPU seconds of ``reps``."""
    best_fold = best_adv = float("inf")
    for _ in range(reps):
        # the collector off, as the projector's fold runs: its full passes over the
        # recorded log's objects held here would be most of the time, and noise
        gc.collect()
        gc.disable()
        try:
            state = initial_state()
            t0 = time.thread_time()
            for position, event in enumerate(events, start=1):
                reducer.apply_event(state, event, position)
            t1 = time.thread_time()
            for group in state.groups.values():
                if group.episode is not None:
                    policies.turn_advantages(group.episode)
            t2 = time.thread_time()
        finally:
            gc.enable()
        best_fold, best_adv = min(best_fold, t1 - t0), min(best_adv, t2 - t1)
    return best_fold, best_adv


def run_cpu_ms(store_for: Callable[[str], object], generators: int, groups: int, run_id: str) -> tuple[float, float]:
    """(controller CPU ms, appends) per group of one "now" run."""
    store = store_for(run_id)
    try:
        out = now_run(store, generators, groups, run_id)  # type: ignore[arg-type]
        committed = sum(1 for s in store.read(run_id) if type(s.event) is GroupCommitted)  # type: ignore[attr-defined]
    finally:
        getattr(store, "close", lambda: None)()
    return 1e3 * out.controller_cpu_s / committed, out.appends / committed


def compare(name: str, args: argparse.Namespace, events: list[AnyEvent], redis_url: str | None) -> None:
    before, after = changes(args.before_rev)[name]
    groups = sum(1 for e in events if type(e) is GroupCommitted)
    sides = {"before": before, "after": after}
    fold_ms: dict[str, list[float]] = {"before": [], "after": []}
    adv_ms: dict[str, list[float]] = {"before": [], "after": []}
    run_ms: dict[str, list[float]] = {"before": [], "after": []}
    appends: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for side in order:
            with sides[side]():  # type: ignore[attr-defined]
                fold_s, adv_s = fold_cpu_s(events, args.reps)
                fold_ms[side].append(1e3 * fold_s / groups)
                adv_ms[side].append(1e3 * adv_s / groups)
                if args.fold_only:
                    continue
                cpu, n = run_cpu_ms(lambda _: MemoryEventStore(), args.generators, args.groups,
                                    f"{name}-{side}-{r}")
                run_ms[side].append(cpu)
                appends[side].append(n)
    line = lambda d: " / ".join(f"{x:.3f}" for x in d)  # noqa: E731
    mean = lambda d: sum(d) / len(d)  # noqa: E731
    print(f"{name}: fold of the log, ms per group: before {line(fold_ms['before'])}, after "
          f"{line(fold_ms['after'])} (x{mean(fold_ms['before']) / mean(fold_ms['after']):.2f}); turn_advantages "
          f"{line(adv_ms['before'])} -> {line(adv_ms['after'])}", flush=True)
    if args.fold_only:
        return
    print(f"{name}: whole runs, in-memory store, controller ms per group: before {line(run_ms['before'])}, "
          f"after {line(run_ms['after'])} (means {mean(run_ms['before']):.3f} -> {mean(run_ms['after']):.3f}); "
          f"appends per group {line(appends['before'])} / {line(appends['after'])}",
          flush=True)
    if redis_url is not None:
        red = {}
        for side in ("after", "before"):
            with sides[side]():  # type: ignore[attr-defined]
                red[side], _ = run_cpu_ms(lambda _: RedisEventStore(redis_url), args.generators, args.groups,
                                       f"{name}-{side}-redis")
        print(f"{name}: one run each on redis-server (appendfsync always): before {red['before']:.3f}, "
              f"after {red['after']:.3f} ms per group", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generators", type=int, default=1024)
    p.add_argument("--groups", type=int, default=1024, help="groups per step budget (bench_scale)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="folds of the log per round (best taken)")
    p.add_argument("--changes", default=",".join(CHANGES), help="which changes, comma separated")
    p.add_argument("--redis", action="store_true", help="one more round on a real redis-server")
    p.add_argument("--fold-only", action="store_true", help="only the fold of the recorded log")
    p.add_argument("--before-rev", default=BEFORE_REV, help="git revision of the code before (commit)")
    args = p.parse_args(argv)
    names = args.changes.split(",")
    unknown = [n for n in names if n not in CHANGES]
    if unknown or args.rounds < 1 or args.reps < 1 or args.generators < 1:
        p.error(f"unknown change {unknown[0]!r} (known: {', '.join(CHANGES)})" if unknown
                else "--rounds, --reps and --generators must be >= 1")
    events, _ = recorded_log(args.generators, args.groups)
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp), appendfsync="always") if args.redis else None
        with server if server is not None else _nothing():
            for name in names:
                compare(name, args, events, server.url if server is not None else None)
    return 0


@contextmanager
def _nothing() -> Iterator[None]:
    yield


if __name__ == "__main__":
    sys.exit(main())
