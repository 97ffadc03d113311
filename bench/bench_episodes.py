"""What durable episodes cost the controller, in virtual time: CPU per group and per turn.

For each fleet size (default 8 and 1024 simulated generators, groups of 16 samples,
steps of 64-512 groups as ``bench_scale``), the real ``Controller`` runs on the virtual
clock four times, side by side on the same timings and the same real redis-server, each
run in a fresh process (as a controller runs one run; a run made after others in the
same process paid for what they left behind, ~0.1 ms per group):

  (a) single-turn -- partial rollouts on, one flush per group (``sim.partial``);
  (b) before      -- ``--turns``-turn episodes as the controller recorded them before the
                     cost work (``docs/agents.md``, "Cost"): two pauses per turn (as for
                     an env that cannot deduplicate by key today) and snapshots every
                     ``snapshot_every_events`` whatever the state's size
                     (``controller.snapshot_events_per_mib = 0``), with the linger
                     (the cheaper fold applies to every mode: code cannot run side by
                     side with its older self);
  (c) linger 0    -- the episodes of (d) with ``rollout.partial.record_linger_s = 0``: a
                     pause shares its append only with calls that returned in the same
                     turn of the loop;
  (d) now         -- the same episodes with today's defaults (an env that deduplicates:
                     one pause per turn) and the configured linger
                     (``--linger-s``, the default 5 ms): the pauses of the fleet that come
                     within it share one append.

Printed per fleet size and mode: the controller's real CPU per group (loop thread,
simulated workers excluded) and per episode turn, events and appends per group, and the
fold time of the log.

What "the controller's CPU" counts: the loop thread's CPU time (``time.thread_time``)
over the run, less every section the simulated workers run in
(``VirtualTimeLoop.uncharged``: a generator call's bookkeeping, and every timer of the
simulated fleet, which runs from a heap of its own behind one loop timer). It includes
the controller's tasks and callbacks, the writer's store round trips (CPU, not the
fsync wait), snapshots, and the loop's own turns (selector poll, timer heap) -- one
turn per wake-up of the fleet, as a reply on a socket would cost. ``--owners`` runs
"now" once more per fleet size with every loop callback timed and named by owner
(``sim.owners``), to check that split. The target: with 1024 generators running 10-turn episodes the controller
stays <= 1 ms CPU per group.

    python bench/bench_episodes.py                    # 8 and 1024 generators, 10 turns
    python bench/bench_episodes.py --generators 64 --turns 20 --groups 1024
    python bench/bench_episodes.py --generators 1024 --linger-max 8   # + a longer linger
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_scale import config_for, timings_for  # noqa: E402
from controller.config import Config  # noqa: E402
from controller.projector import Projector  # noqa: E402
from events.redis_store import RedisEventStore  # noqa: E402
from sim.harness import SimSpec, simulate  # noqa: E402
from sim.owners import callbacks_by_owner, is_simulator  # noqa: E402
from workers.generator.config import PartialSection  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


def with_partial(cfg: Config) -> Config:
    partial = msgspec.structs.replace(cfg.rollout.partial, enabled=True)
    return msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, partial=partial))


def with_linger(cfg: Config, linger_s: float, linger_max: int | None = None) -> Config:
    partial = msgspec.structs.replace(cfg.rollout.partial, record_linger_s=linger_s)
    if linger_max is not None:
        partial = msgspec.structs.replace(partial, record_linger_max=linger_max)
    return msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, partial=partial))


def as_before(cfg: Config) -> Config:
    """The settings episodes ran with before the cost work (mode b)."""
    return msgspec.structs.replace(cfg, controller=msgspec.structs.replace(
        cfg.controller, snapshot_events_per_mib=0))


def one(url: str, args: argparse.Namespace, generators: int, turns: int,
        linger_s: float, before: bool = False, tag: str = "", owners: bool = False,
        linger_max: int | None = None) -> dict:
    """One run, in this process: its figures (and, with ``owners``, the loop's callbacks
    timed by owner)."""
    cfg = with_partial(config_for(generators, args.groups, window=2, selection="oldest_first"))
    cfg = with_linger(cfg, linger_s, linger_max)
    if before:
        cfg = as_before(cfg)
    timings = timings_for(cfg, args.median_s, 0.5, 1.05)
    store = RedisEventStore(url)
    run_id = f"ep-{generators}-{turns}-{linger_s}-{linger_max}-{'before' if before else 'now'}{tag}"
    spec = SimSpec(config=cfg, timings=timings, run_id=run_id, charge_real_time=True,
                   episode_turns=turns, episode_dedupes=not before)
    try:
        if owners:
            with callbacks_by_owner() as timed:
                out = simulate(store, spec)
        else:
            out = simulate(store, spec)
        t0 = time.perf_counter()
        folded = Projector(store).get(run_id)
        fold_s = time.perf_counter() - t0
    finally:
        store.close()
    assert folded.problem is None, folded.problem
    groups = sum(1 for g in folded.state.groups.values() if g.committed_position is not None)
    turns_played = sum(len(r) for g in folded.state.groups.values() if g.episode for r in g.episode.rewards)
    assert turns_played == groups * cfg.rollout.samples_per_group * turns or not turns, (
        turns_played, groups)
    cpu_ms = 1e3 * out.controller_cpu_s / groups
    row = {"generators": generators, "turns": turns, "groups": groups, "cpu_ms": cpu_ms,
           "cpu_us_per_turn": 1e3 * cpu_ms / max(1, turns), "events_per_group": out.events / groups,
           "appends_per_group": out.appends / groups, "fold_s": fold_s,
           "workers_ms": 1e3 * out.workers_cpu_s / groups, "groups_per_vs": groups / out.virtual_s}
    if owners:
        row["owners_total_s"] = timed.total_s
        row["owners_sim_s"] = sum(s for name, s in timed.cpu_s.items() if is_simulator(name))
        row["owners_top"] = timed.top(8)
    return row


def fresh(url: str, args: argparse.Namespace, generators: int, turns: int, linger_s: float,
          before: bool = False, tag: str = "", owners: bool = False, linger_max: int | None = None) -> dict:
    """:func:`one` in a process of its own: every run starts from the same interpreter
    state. Run after others in one process, a run paid for what they left behind (their
    objects in the collector's oldest generation, a grown heap): ~0.1 ms per group more
    for the last of four runs, whichever code ran."""
    spec = {"url": url, "groups": args.groups, "median_s": args.median_s, "generators": generators,
            "turns": turns, "linger_s": linger_s, "before": before, "tag": tag, "owners": owners,
            "linger_max": linger_max}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        sys.exit(f"bench_episodes: a run ({generators} generators, {turns} turns) failed: {tail[0]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(spec_json: str) -> None:
    spec = json.loads(spec_json)
    args = argparse.Namespace(groups=spec["groups"], median_s=spec["median_s"])
    row = one(spec["url"], args, spec["generators"], spec["turns"], spec["linger_s"],
              before=spec["before"], tag=spec["tag"], owners=spec["owners"], linger_max=spec["linger_max"])
    print(json.dumps(row), flush=True)


def print_owners(url: str, args: argparse.Namespace, generators: int) -> None:
    """One more "now" run with every loop callback timed by owner (``--owners``)."""
    run = fresh(url, args, generators, args.turns, args.linger_s, tag="-owners", owners=True)
    per = 1e3 / run["groups"]
    sim_ms = per * run["owners_sim_s"]
    total_ms = run["cpu_ms"] + run["workers_ms"]
    print(f"       owners (timed run, +~1 us per callback): loop thread {total_ms:.3f} ms per group = "
          f"controller {run['cpu_ms']:.3f} + simulated workers {run['workers_ms']:.3f}; callbacks: "
          f"the fleet's {sim_ms:.3f}, the controller's {per * run['owners_total_s'] - sim_ms:.3f}, "
          f"the loop's own turns {total_ms - per * run['owners_total_s']:.3f}", flush=True)
    for name, calls, cpu_s in run["owners_top"]:
        print(f"         {per * cpu_s:7.3f} ms {calls / run['groups']:6.2f} per group  {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generators", default="8,1024", help="fleet sizes, comma separated")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--groups", type=int, default=2048, help="groups per run (at least 4 steps)")
    p.add_argument("--median-s", type=float, default=30.0, help="median generation time of a group")
    p.add_argument("--linger-s", type=float, default=PartialSection().record_linger_s,
                   help="rollout.partial.record_linger_s of mode (c)")
    p.add_argument("--linger-max", type=int, default=None,
                   help="also run 'now' with this rollout.partial.record_linger_max, beside the default's")
    p.add_argument("--owners", action="store_true",
                   help="one more run per fleet size with the loop's callbacks timed by owner")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    if args.turns < 1:
        p.error(f"--turns must be >= 1, got {args.turns}")
    if args.linger_s < 0:
        p.error(f"--linger-s must be >= 0, got {args.linger_s}")
    if args.linger_max is not None and args.linger_max < 1:
        p.error(f"--linger-max must be >= 1, got {args.linger_max}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp), appendfsync="always") as server:
        for n in (int(x) for x in args.generators.split(",")):
            single = fresh(server.url, args, n, 0, args.linger_s)
            # the episode modes alternate their order from one fleet size to the next
            order = ["before", "apart", "now"] if len(rows) % 2 == 0 else ["now", "apart", "before"]
            runs = {m: fresh(server.url, args, n, args.turns, 0.0 if m == "apart" else args.linger_s,
                             before=m == "before") for m in order}
            before, apart, now = runs["before"], runs["apart"], runs["now"]
            rows.append((single, now))
            print(f"{n:>5} generators, {now['groups']} groups: controller CPU per group: "
                  f"single-turn {single['cpu_ms']:.3f} ms; {args.turns}-turn episodes: before "
                  f"{before['cpu_ms']:.3f} ms, linger 0 {apart['cpu_ms']:.3f} ms, now (linger "
                  f"{args.linger_s:g} s) {now['cpu_ms']:.3f} ms ({now['cpu_us_per_turn']:.1f} us "
                  f"per turn, x{before['cpu_ms'] / now['cpu_ms']:.2f} less than before)", flush=True)
            modes = (single, before, apart, now)
            print("       single / before / linger 0 / now: events per group "
                  + " / ".join(f"{m['events_per_group']:.1f}" for m in modes) + "; appends per group "
                  + " / ".join(f"{m['appends_per_group']:.1f}" for m in modes) + "; fold "
                  + " / ".join(f"{m['fold_s']:.2f} s" for m in modes), flush=True)
            if args.linger_max is not None:
                longer = fresh(server.url, args, n, args.turns, args.linger_s, linger_max=args.linger_max)
                print(f"       now, record_linger_max {args.linger_max} (default "
                      f"{PartialSection().record_linger_max}): {longer['cpu_ms']:.3f} / {now['cpu_ms']:.3f} ms "
                      f"per group, {longer['appends_per_group']:.2f} / {now['appends_per_group']:.2f} appends "
                      f"per group, {longer['groups_per_vs']:.4g} / {now['groups_per_vs']:.4g} groups per "
                      "virtual s", flush=True)
            if args.owners:
                print_owners(server.url, args, n)
    worst = max(e["cpu_ms"] for _, e in rows)
    print(f"target: <= 1 ms controller CPU per group with episodes: worst {worst:.3f} ms -> "
          + ("met" if worst <= 1.0 else "MISSED"))
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
