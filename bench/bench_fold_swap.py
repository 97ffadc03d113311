"""One fold function at a git revision against the working tree's, swapped in one process.

``bench_fold_writer`` runs each side in a process of its own, and the shared machine's
load drifts by more than a cut of a few us per pause between two processes a few
seconds apart. Here one process holds both: the base's version of each named function
is loaded from ``--base`` (its module's source at that revision, executed beside
today's, its own imports resolved to today's modules) and swapped into every module
that calls it by that name, then swapped back -- the two sides alternate fold by fold,
``--reps`` folds each, the collector off, and the best of each side is compared. A fold
is the log writer's fold of one recorded "now" run (``bench_fold_writer.child``'s:
prefold, the fold after the write, ``segment_keys`` before each commit).

    python bench/bench_fold_swap.py --base REV --swap controller/core/segments.py:record_flush
    python bench/bench_fold_swap.py --base REV --swap controller/core/reducer_pauses.py:fold_pause

A function of the reducer's handler table (``fold_pause``) is swapped there too. Only
functions whose callers look them up by module attribute at call time can be swapped.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_fold_changes import module_at  # noqa: E402
from bench.bench_fold_stages import recorded_log  # noqa: E402
from controller.core import reducer  # noqa: E402
from controller.core.prefold import fold_after_write, prefold  # noqa: E402
from controller.core.segments import segment_keys  # noqa: E402
from controller.core.state import initial_state  # noqa: E402
from events.schema import AnyEvent, EpisodeTurnsRecorded, GroupCommitted, SegmentsRecorded  # noqa: E402


@contextmanager
def swapped(base: ModuleType, name: str) -> Iterator[None]:
    """``base``'s ``name`` wherever today's is bound: a core module's attribute or a handler."""
    today = getattr(sys.modules[base.__name__.removesuffix("@base")], name)
    sites = [(m, name) for m in list(sys.modules.values())
             if isinstance(m, ModuleType) and getattr(m, name, None) is today]
    handlers = [k for k, v in reducer.HANDLERS.items() if v is today]
    old = getattr(base, name)
    for m, a in sites:
        setattr(m, a, old)
    for k in handlers:
        reducer.HANDLERS[k] = old
    try:
        yield
    finally:
        for m, a in sites:
            setattr(m, a, today)
        for k in handlers:
            reducer.HANDLERS[k] = today


def fold(events: list[AnyEvent]) -> float:
    """Thread CPU seconds of the writer's fold of ``events``."""
    pauses = (EpisodeTurnsRecorded, SegmentsRecorded)
    t0 = time.thread_time()
    state = initial_state()
    for pos, event in enumerate(events, start=1):
        kind = type(event)
        if kind is GroupCommitted:
            segment_keys(state.inflight, [event.group_id])
        if kind is GroupCommitted or kind in pauses:
            fold_after_write(state, prefold(state, [event], pos), 0, event, pos)
        else:
            reducer.apply_event(state, event, pos)
    return time.thread_time() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the revision whose functions are swapped in")
    p.add_argument("--swap", action="append", required=True, help="path/of/module.py:function (repeatable)")
    p.add_argument("--generators", type=int, default=1024)
    p.add_argument("--groups", type=int, default=1024, help="groups per step budget (bench_scale)")
    p.add_argument("--reps", type=int, default=10, help="folds per side, alternated")
    args = p.parse_args(argv)
    bases = []
    for spec in args.swap:
        path, _, name = spec.partition(":")
        module = path.removesuffix(".py").replace("/", ".")
        if not name or module not in sys.modules and not (ROOT / path).exists():
            p.error(f"--swap {spec!r}: expected path/of/module.py:function")
        __import__(module)
        bases.append((module_at(args.base, path, module + "@base"), name))
    events, _ = recorded_log(args.generators, args.groups)
    groups = sum(1 for e in events if type(e) is GroupCommitted)
    spent: dict[str, list[float]] = {"base": [], "this": []}
    gc.collect()
    gc.disable()
    try:
        for r in range(2 * args.reps):
            side = "base" if r % 2 == (r // 2) % 2 else "this"  # base, this, this, base, ...
            with ExitStack() as stack:
                if side == "base":
                    for module, name in bases:
                        stack.enter_context(swapped(module, name))
                spent[side].append(fold(events))
    finally:
        gc.enable()
    for side, xs in spent.items():
        ms = sorted(1e3 * x / groups for x in xs)
        print(f"{side:>4}: best {ms[0]:.4f}, median {ms[len(ms) // 2]:.4f} ms per group "
              f"({len(ms)} folds of {groups} groups)")
    best = {side: min(xs) for side, xs in spent.items()}
    print(f"base / this = x{best['base'] / best['this']:.3f} (best), "
          f"x{sorted(spent['base'])[args.reps // 2] / sorted(spent['this'])[args.reps // 2]:.3f} (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
