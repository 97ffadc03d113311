"""Episode cost of the code at a git revision against the working tree's, side by side.

A change to the pause and append path cannot run beside its older self in one process,
so each run here is a child process importing one of two copies of the code: the
working tree, or ``--base`` (a revision extracted with ``git archive``). The runs are
``bench_episodes``' "now" mode (10-turn episodes, today's defaults, virtual time,
``charge_real_time``), on the in-memory store or a real redis-server with
``appendfsync always`` (``--store``), the order alternating from round to round.
Printed: the controller's loop-thread CPU per group (simulated workers excluded, as
``bench_episodes`` counts it) of every run, the means, their ratio, and appends and
virtual groups per second (a change that saves CPU by waiting longer shows there).

The collector's full collections (0.2-0.3 s each over the simulated run's heap, ~16 per
run) land at random in the controller's callbacks or in the simulated workers' uncharged
sections, which moves a run's figure by ~0.08 ms per group each; ``--no-gc`` turns the
collector off in every run, to compare code without that noise (the controller's own
share of the collector, ~0.1 ms per group, is then left out of both sides). Every run
also prints its full collections, the collections' loop-thread CPU (all of it, and the
part charged to the controller), its peak RSS and the cyclic garbage a collection still
finds after it.

A run charges the loop's real time to the virtual clock (``charge_real_time``), so its
CPU moves which pauses share an append (2.57-2.63 appends per group from run to run)
and the work with it. ``--free-clock`` turns that off: every run of either side then
has the same schedule (the same appends, the same batches), so a change that only
makes code cheaper shows without the schedule's noise; the figure is then the CPU of
that schedule, not the one a charged run would settle into.

``--timers`` runs the working tree once more with thread-CPU timers around the parts
of the pause and append path (:data:`TIMED`; nested: a part's figure includes the parts
it calls) and the loop's callbacks by owner (``sim.owners``), to say where a group's CPU
goes without a profiler's distortion (each timer adds ~1 us).

    python bench/bench_episode_ab.py --base HEAD~1                     # in memory, 2 rounds
    python bench/bench_episode_ab.py --base main --store redis --rounds 2
    python bench/bench_episode_ab.py --base main --no-gc --free-clock --rounds 6
    python bench/bench_episode_ab.py --timers --rounds 0
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (module, attribute path) of the functions timed by ``--timers``, in print order
TIMED = [
    ("controller.partial", "PartialRecorder.hold"),
    ("controller.partial", "PartialRecorder._gather"),
    ("controller.partial", "PartialRecorder.join"),
    ("controller.partial", "PartialRecorder.recheck"),
    ("controller.episodes", "flush_events"),
    ("controller.partial", "next_requests"),
    ("controller.partial", "segment_keys"),
    ("controller.partial", "crash_point"),
    ("controller.partial", "PartialRecorder.drop"),
    ("controller.journal", "Journal.append"),
    ("controller.pausing", "PausingCall.resume"),
    ("controller.pausing", "PausingCall._returned"),
    ("controller.log_writer", "LogWriter.append"),
    ("controller.log_writer", "apply"),
    ("controller.log_writer", "LogWriter.snapshot"),
    ("controller.log_writer", "prefold"),
    ("controller.log_writer", "fold_after_write"),
    ("controller.core.prefold", "independent"),
    ("controller.core.prefold", "mark_pause"),
    ("controller.core.prefold", "handle"),
    ("controller.core.prefold", "check_committed"),
    ("controller.log_writer", "crashpoints.after_append"),
    ("events.memory_store", "MemoryEventStore.append"),
    ("events.memory_store", "encode"),
    ("events.memory_store", "ChainWriter.batch"),
    ("events.memory_store", "MemoryEventStore._append_locked"),
    ("events.redis_store.store", "RedisEventStore.append"),
    ("controller.admission", "AdmissionSide._admission_room"),
    ("controller.admission", "AdmissionSide._dispatch"),
    ("controller.admission", "AdmissionSide._free_count"),
    ("controller.admission", "AdmissionSide._take_free_calls"),
    ("controller.admission", "AdmissionSide._held_back"),
    ("controller.admission", "AdmissionSide._release_slot"),
    ("controller.admission", "AdmissionSide._record_flushes"),
    ("controller.admission", "commit_events"),
]


def _install_timers() -> tuple[dict[str, list[float]], float]:
    """Wrap every :data:`TIMED` function with a thread-CPU timer: name -> [calls, s,
    timed calls nested inside]; and what one timed call costs more than a plain one
    (each figure printed is less that much per timed call nested in it)."""
    import importlib
    import inspect
    import time

    clock, out, count = time.thread_time, {}, [0]

    def note(acc, start, nested):
        count[0] += 1
        acc[0] += 1
        acc[1] += clock() - start
        acc[2] += count[0] - nested - 1

    def wrap(fn, acc):
        if inspect.iscoroutinefunction(fn):  # only those that never suspend: a pause's
            async def timed_async(*a, **kw):  # append without a retry
                start, nested = clock(), count[0]
                try:
                    return await fn(*a, **kw)
                finally:
                    note(acc, start, nested)
            return timed_async

        def timed(*a, **kw):
            start, nested = clock(), count[0]
            try:
                return fn(*a, **kw)
            finally:
                note(acc, start, nested)
        return timed

    for module, path in TIMED:
        owner = importlib.import_module(module)
        *parents, name = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        out[path] = acc = [0, 0.0, 0]
        setattr(owner, name, wrap(getattr(owner, name), acc))
    return out, _overhead(wrap)


def _overhead(wrap) -> float:
    """Seconds one timed call of a no-op costs more than the plain call (best of 5)."""
    import time

    def noop():
        return None

    timed, n, best = wrap(noop, [0, 0.0, 0]), 100_000, float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(n):
            noop()
        t1 = time.thread_time()
        for _ in range(n):
            timed()
        best = min(best, (time.thread_time() - t1 - (t1 - t0)) / n)
    return best


def _time_collections() -> list:
    """[full collections, thread-CPU seconds in all collections, in the full ones, in the
    ones charged to the controller (outside the simulated workers' uncharged sections)],
    kept up to date by a collector callback over the whole run."""
    import asyncio
    import time

    out, started = [0, 0.0, 0.0, 0.0], [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.thread_time()
            return
        spent = time.thread_time() - started[0]
        out[0] += info["generation"] == 2
        out[1] += spent
        out[2] += spent if info["generation"] == 2 else 0.0
        loop = asyncio._get_running_loop()  # the virtual-time loop, when one runs
        out[3] += spent if loop is not None and not getattr(loop, "_uncharged_depth", 1) else 0.0

    gc.callbacks.insert(0, timed)
    return out


def child(args: argparse.Namespace) -> None:
    """One run of the code at ``args.code`` (first on ``sys.path``): a JSON line."""
    sys.path.insert(0, args.code)
    for name in [m for m in sys.modules if m.split(".")[0] in ("bench", "controller", "events", "sim", "workers")]:
        del sys.modules[name]
    from bench.bench_scale import config_for, timings_for
    from events.memory_store import MemoryEventStore
    from events.redis_store import RedisEventStore
    from sim.harness import SimSpec, simulate
    from sim.owners import callbacks_by_owner
    import msgspec

    timers, overhead = _install_timers() if args.timers else (None, 0.0)
    if args.no_gc:
        gc.disable()
    collections = _time_collections()
    cfg = config_for(args.generators, args.groups, window=2, selection="oldest_first")
    partial = msgspec.structs.replace(cfg.rollout.partial, enabled=True,
                                      **({} if args.linger_s is None else {"record_linger_s": args.linger_s}))
    cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, partial=partial))
    store = MemoryEventStore() if args.url is None else RedisEventStore(args.url)
    spec = SimSpec(config=cfg, timings=timings_for(cfg, 30.0, 0.5, 1.05), run_id=args.run_id,
                   charge_real_time=not args.free_clock, episode_turns=args.turns)
    if timers is not None:
        with callbacks_by_owner() as owners:
            out = simulate(store, spec)
    else:
        out = simulate(store, spec)
    groups = sum(1 for g in out.writer.state.groups.values() if g.committed_position is not None)
    row = {"cpu_ms": 1e3 * out.controller_cpu_s / groups, "groups": groups,
           "appends": out.appends / groups, "events": out.events / groups,
           "groups_per_vs": groups / out.virtual_s}
    # memory: the child's peak RSS, and the cyclic garbage a whole collection still finds
    # after the run (what a collector policy that freezes objects could leave behind)
    row["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row["garbage_at_end"] = gc.collect()
    row["collections"] = {"full": collections[0], "ms_per_group": 1e3 * collections[1] / groups,
                          "full_ms_per_group": 1e3 * collections[2] / groups,
                          "charged_ms_per_group": 1e3 * collections[3] / groups}
    if timers is not None:
        row["timers"] = {k: [n / groups, 1e3 * (s - overhead * inner) / groups]
                         for k, (n, s, inner) in timers.items() if n}
        row["overhead_us"] = 1e6 * overhead
        row["owners"] = [(name, calls / groups, 1e3 * s / groups) for name, calls, s in owners.top(12)]
        row["owners_charged"] = [(name, calls / groups, 1e3 * s / groups)
                                 for name, calls, s in owners.top_charged(12)]
    store.close()
    print(json.dumps(row), flush=True)


def run_child(code: Path, args: argparse.Namespace, run_id: str, url: str | None,
              timers: bool = False) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--code", str(code),
           "--run-id", run_id, "--generators", str(args.generators), "--groups", str(args.groups),
           "--turns", str(args.turns)]
    cmd += (["--url", url] if url else []) + (["--timers"] if timers else [])
    cmd += ["--no-gc"] if args.no_gc else []
    cmd += ["--free-clock"] if args.free_clock else []
    cmd += [] if args.linger_s is None else ["--linger-s", str(args.linger_s)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=code)
    if done.returncode != 0:
        sys.exit(f"bench_episode_ab: the run of {code} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def extract(rev: str, into: Path) -> Path:
    """The tree of ``rev`` under ``into`` (``git archive``)."""
    check = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT,
                           capture_output=True, text=True)
    if check.returncode != 0:
        sys.exit(f"bench_episode_ab: --base {rev!r} is not a revision of this repository")
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def compare(args: argparse.Namespace, url: str | None, tmp: Path) -> None:
    codes = {"base": extract(args.base, tmp / "base"), "this": ROOT} if args.base else {"this": ROOT}
    runs: dict[str, list[dict]] = {k: [] for k in codes}
    for r in range(args.rounds):
        for k in (list(codes) if r % 2 == 0 else list(codes)[::-1]):
            runs[k].append(run_child(codes[k], args, f"ab-{k}-{r}", url))
            x = runs[k][-1]
            print(f"  round {r} {k:>4}: {x['cpu_ms']:.3f} ms per group, {x['appends']:.2f} appends "
                  f"and {x['events']:.1f} events per group, {x['groups_per_vs']:.4g} groups per "
                  "virtual s", flush=True)
            c = x["collections"]
            print(f"             peak RSS {x['rss_mib']:.0f} MiB, {x['garbage_at_end']} objects of cyclic "
                  f"garbage found after the run; collector: {c['full']} full collections, all collections "
                  f"{c['ms_per_group']:.3f} ms per group of the loop thread ({c['full_ms_per_group']:.3f} "
                  f"in the full ones, {c['charged_ms_per_group']:.3f} charged to the controller)",
                  flush=True)
    means = {k: sum(x["cpu_ms"] for x in rs) / len(rs) for k, rs in runs.items() if rs}
    for k, m in means.items():
        print(f"{k:>4} ({args.base if k == 'base' else 'working tree'}): mean {m:.3f} ms per group "
              f"over {len(runs[k])} runs")
    if len(means) == 2:
        print(f"base / this = x{means['base'] / means['this']:.3f}")


def print_timers(args: argparse.Namespace, url: str | None) -> None:
    x = run_child(ROOT, args, "ab-timers", url, timers=True)
    print(f"timed run: {x['cpu_ms']:.3f} ms per group, {x['appends']:.2f} appends per group; each "
          f"part less {x['overhead_us']:.2f} us per timed call nested in it (what a timer costs)")
    for name, (calls, ms) in x["timers"].items():
        print(f"  {ms:7.3f} ms {calls:7.2f} per group  {name}")
    print("  loop callbacks by owner:")
    for name, calls, ms in x["owners"]:
        print(f"  {ms:7.3f} ms {calls:7.2f} per group  {name}")
    print("  the same, less the simulated workers' uncharged sections inside them (what the figure counts):")
    for name, calls, ms in x["owners_charged"]:
        print(f"  {ms:7.3f} ms {calls:7.2f} per group  {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default=None, help="the revision to compare with (none: this tree only)")
    p.add_argument("--store", choices=["memory", "redis"], default="memory")
    p.add_argument("--generators", type=int, default=1024)
    p.add_argument("--groups", type=int, default=2048)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--linger-s", type=float, default=None, help="record_linger_s (default: the config's)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timers", action="store_true", help="one more timed run of this tree")
    p.add_argument("--free-clock", action="store_true",
                   help="the loop charges no real time: every run the same schedule (see the module docstring)")
    p.add_argument("--no-gc", action="store_true",
                   help="the garbage collector off in every run (see the module docstring)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--code", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--run-id", default="ab", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.rounds < 0 or args.turns < 1 or args.generators < 1:
        p.error("--rounds must be >= 0, --turns and --generators >= 1")
    sys.path.insert(0, str(ROOT))
    from tests.redis_server import RedisServer

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "base").mkdir()
        if args.store == "redis":
            with RedisServer(tmp / "redis", appendfsync="always") as server:
                compare(args, server.url, tmp)
                if args.timers:
                    print_timers(args, server.url)
        else:
            compare(args, None, tmp)
            if args.timers:
                print_timers(args, None)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
