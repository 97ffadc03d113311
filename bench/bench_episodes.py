"""What durable episodes cost the controller, in virtual time: CPU per group and per turn.

For each fleet size (default 8 and 1024 simulated generators, groups of 16 samples,
steps of 64-512 groups as ``bench_scale``), the real ``Controller`` runs on the virtual
clock twice, side by side on the same timings and the same real redis-server:

  (a) single-turn -- partial rollouts on, one flush per group (``sim.partial``);
  (b) episodes    -- ``--turns``-turn episodes (``sim.episodes``): per turn the model
                     segments and the calls' intent, then the results and observations,
                     each appended before the episode goes on (4 events per turn).

Printed per fleet size and mode: the controller's real CPU per group (loop thread,
simulated workers excluded) and per episode turn, events per group, and the fold time
of the log. The target: with 1024 generators running 10-turn episodes the controller
stays <= 1 ms CPU per group.

    python bench/bench_episodes.py                    # 8 and 1024 generators, 10 turns
    python bench/bench_episodes.py --generators 64 --turns 20 --groups 1024
"""

from __future__ import annotations

import argparse
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
from tests.redis_server import RedisServer  # noqa: E402


def with_partial(cfg: Config) -> Config:
    partial = msgspec.structs.replace(cfg.rollout.partial, enabled=True)
    return msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, partial=partial))


def one(server: RedisServer, args: argparse.Namespace, generators: int, turns: int) -> dict[str, float]:
    cfg = with_partial(config_for(generators, args.groups, window=2, selection="oldest_first"))
    timings = timings_for(cfg, args.median_s, 0.5, 1.05)
    store = RedisEventStore(server.url)
    run_id = f"ep-{generators}-{turns}"
    try:
        out = simulate(store, SimSpec(config=cfg, timings=timings, run_id=run_id,
                                      charge_real_time=True, episode_turns=turns))
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
    return {"generators": generators, "turns": turns, "groups": groups, "cpu_ms": cpu_ms,
            "cpu_us_per_turn": 1e3 * cpu_ms / max(1, turns), "events_per_group": out.events / groups,
            "fold_s": fold_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generators", default="8,1024", help="fleet sizes, comma separated")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--groups", type=int, default=2048, help="groups per run (at least 4 steps)")
    p.add_argument("--median-s", type=float, default=30.0, help="median generation time of a group")
    args = p.parse_args(argv)
    if args.turns < 1:
        p.error(f"--turns must be >= 1, got {args.turns}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp), appendfsync="always") as server:
        for n in (int(x) for x in args.generators.split(",")):
            single, episodes = one(server, args, n, 0), one(server, args, n, args.turns)
            rows.append((single, episodes))
            print(f"{n:>5} generators, {episodes['groups']} groups: controller CPU per group "
                  f"single-turn {single['cpu_ms']:.3f} ms, {args.turns}-turn episodes "
                  f"{episodes['cpu_ms']:.3f} ms (x{episodes['cpu_ms'] / single['cpu_ms']:.2f}; "
                  f"{episodes['cpu_us_per_turn']:.1f} us per turn); events per group "
                  f"{single['events_per_group']:.1f} vs {episodes['events_per_group']:.1f}; "
                  f"fold {single['fold_s']:.2f} s vs {episodes['fold_s']:.2f} s", flush=True)
    worst = max(e["cpu_ms"] for _, e in rows)
    print(f"target: <= 1 ms controller CPU per group with episodes: worst {worst:.3f} ms -> "
          + ("met" if worst <= 1.0 else "MISSED"))
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
