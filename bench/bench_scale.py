"""The controller at cluster scale, in virtual time: does it keep up as the fleet grows?

For 8, 64, 256 and 1024 simulated generators (groups of 16 samples, steps of 64-512
groups, lognormal generation times, a trainer a little slower than the fleet so that any
delay of the controller shows as trainer idle time), the real ``Controller`` runs on the
virtual clock (``sim``) twice:

  (a) free     -- the controller takes no virtual time (memory log): the ideal schedule;
  (b) charged  -- on a real redis-server with ``appendfsync always``, and the real wall
                  time the loop spends (CPU, round trips, fsyncs) is added to the virtual
                  clock: a slow controller delays everything after it.

Printed per fleet size: the controller's real CPU per group (loop thread, simulated
workers' bookkeeping excluded), events appended per real second while busy and per
virtual second (the load a cluster of that size puts on the log), redis-server CPU per
group, trainer idle caused by the controller ((b)'s wall time - (a)'s, as a fraction of
(b)'s: the trainer's busy time is the same in both, so the difference is idle time), the fold time of the resulting log (``controller.projector.Projector.get``) and the
recovery time of a restart at the end (``controller.startup.resume_run``).

Targets: controller CPU per group <= 1 ms and trainer idle caused by the controller < 1%
up to 1024 generators; CPU per group at 1024 <= 1.5x that at 8.

``--saturate`` then shrinks the generation times at the largest fleet until the
controller is the bottleneck (idle caused > 1%): the group rate it sustains.

In-flight updates and partial rollouts at scale (sync / async / async with refits between
calls / in-flight, long-tailed lengths) are ``bench/bench_partial_scale.py``'s.

    python bench/bench_scale.py                       # the sweep (a few minutes)
    python bench/bench_scale.py --generators 8,64 --groups 1000
    python bench/bench_scale.py --saturate
    python bench/bench_scale.py --profile 1024        # cProfile of one charged run
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.config import Config, load_config  # noqa: E402
from controller.startup import resume_run  # noqa: E402
from events.redis_store import RedisEventStore  # noqa: E402
from events.memory_store import MemoryEventStore  # noqa: E402
from controller.projector import Projector  # noqa: E402
from sim.harness import SimOutcome, SimSpec, simulate  # noqa: E402
from sim.timeline import timeline_of  # noqa: E402
from sim.timings import Lognormal, SyntheticTimings  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

SAMPLES = 16
MICROBATCHES_PER_STEP = 4


def shape(generators: int) -> int:
    """Groups per step for a fleet: one step's worth per two generators, 64..512."""
    return max(64, min(512, generators // 2))


def config_for(generators: int, groups: int, window: int, selection: str) -> Config:
    gps = shape(generators)
    steps = max(4, groups // gps)
    return load_config(None, [
        f"run.steps={steps}",
        f"rollout.num_generators={generators}",
        f"rollout.samples_per_group={SAMPLES}",
        "rollout.groups_per_call=1",
        f"train.groups_per_step={gps}",
        f"train.groups_per_microbatch={gps // MICROBATCHES_PER_STEP}",
        f"staleness.window_versions={window}",
        f"staleness.selection={selection}",
        "checkpoint.every_steps=10",
        "checkpoint.retain_payloads=until_checkpoint",
        "task.num_prompts=1000000",
    ])


def timings_for(cfg: Config, median_s: float, sigma: float, trainer_ratio: float) -> SyntheticTimings:
    """Trainer time per step = trainer_ratio x the fleet's mean time to generate a step."""
    gen = Lognormal(median_s, sigma)
    gps, n = cfg.train.groups_per_step, cfg.rollout.num_generators
    step_s = trainer_ratio * gps * gen.mean_s / n
    refit_s = 0.05 * step_s
    return SyntheticTimings(
        generation=gen,
        train_per_sequence_s=0.0,
        microbatch_fixed_s=(step_s - refit_s) / MICROBATCHES_PER_STEP,
        publish=refit_s,
        checkpoint=0.0,
        seed=cfg.run.seed,
    )


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _idle(store, run_id: str) -> tuple[float, float, int]:
    tl, _ = timeline_of(store, run_id)
    return tl.trainer_idle_s, tl.wall_s, tl.groups_consumed




def one_point(args: argparse.Namespace, server: RedisServer, generators: int, median_s: float,
              tag: str) -> dict[str, float]:
    cfg = config_for(generators, args.groups, args.window, args.selection)
    timings = timings_for(cfg, median_s, args.sigma, args.trainer_ratio)
    free_store = MemoryEventStore()
    simulate(free_store, SimSpec(config=cfg, timings=timings, run_id="free"))
    free_idle, free_wall, _ = _idle(free_store, "free")

    store = RedisEventStore(server.url)
    run_id = f"scale-{tag}"
    pid = server.process.pid
    redis0 = _proc_cpu_s(pid)
    out: SimOutcome = simulate(store, SimSpec(config=cfg, timings=timings, run_id=run_id,
                                              charge_real_time=True))
    redis_cpu = _proc_cpu_s(pid) - redis0
    idle, wall, groups = _idle(store, run_id)
    t0 = time.perf_counter()
    folded = Projector(store).get(run_id)
    fold_s = time.perf_counter() - t0
    assert folded.problem is None, folded.problem
    t0 = time.perf_counter()
    resume_run(store, run_id)
    recovery_s = time.perf_counter() - t0
    store.close()
    busy_real = max(out.real_s - out.workers_real_s, 1e-9)
    return {
        "generators": generators,
        "groups_per_step": cfg.train.groups_per_step,
        "groups": groups,
        "median_s": median_s,
        "cpu_ms": 1e3 * out.controller_cpu_s / groups,
        "events": out.events,
        "events_per_real_s": out.events / busy_real,
        "events_per_virtual_s": out.events / out.virtual_s,
        "groups_per_virtual_s": groups / wall,
        "redis_cpu_ms": 1e3 * redis_cpu / groups,
        # the trainer's busy time is the same in both runs: extra wall time is extra idle
        "idle_caused": max(0.0, wall - free_wall) / wall if wall else 0.0,
        "idle_free": free_idle / free_wall if free_wall else 0.0,
        "wall_ratio": wall / free_wall if free_wall else 1.0,
        "fold_s": fold_s,
        "fold_events_per_s": out.events / fold_s,
        "recovery_s": recovery_s,
        "real_s": out.real_s,
    }


def overlap_point(args: argparse.Namespace, generators: int, sigma: float) -> dict[str, float]:
    """Sync (window 0) vs async (window 1) in free virtual time, on a shape where both do
    the same work: a step is one group per generator (the sync run uses the whole
    fleet), in_order selection (nothing evicted), the trainer as fast as the fleet on
    average. The achieved speedup next to the physical bound from the sync run's phases."""
    walls, sync_tl = {}, None
    for window in (0, 1):
        cfg = load_config(None, [
            f"run.steps={max(16, args.groups // generators)}",  # the pipeline's fill amortised
            f"rollout.num_generators={generators}", f"rollout.samples_per_group={SAMPLES}",
            "rollout.groups_per_call=1", f"train.groups_per_step={generators}",
            f"train.groups_per_microbatch={max(1, generators // MICROBATCHES_PER_STEP)}",
            f"staleness.window_versions={window}", "staleness.selection=in_order",
            "checkpoint.every_steps=1000", "task.num_prompts=1000000",
        ])
        timings = timings_for(cfg, args.median_s, sigma, 1.0)
        store = MemoryEventStore()
        simulate(store, SimSpec(config=cfg, timings=timings, run_id="overlap"))
        tl, _ = timeline_of(store, "overlap")
        walls[window] = tl.wall_s
        if window == 0:
            sync_tl = tl
    gen = sync_tl.trainer_idle_s  # the sync trainer waits exactly while the fleet generates
    train = sync_tl.trainer_busy_s + sync_tl.refit_s + sync_tl.checkpoint_s
    bound = (gen + train) / max(gen, train)
    ratio = walls[0] / walls[1]
    return {"generators": generators, "bound": bound, "ratio": ratio, "fraction": ratio / bound}


def print_table(rows: list[dict[str, float]]) -> None:
    header = (f"{'gens':>5} {'grp/step':>8} {'groups':>7} {'CPU ms/grp':>10} {'ev/s busy':>10} "
              f"{'ev/s virt':>9} {'redis ms/grp':>12} {'idle caused':>11} {'idle free':>9} "
              f"{'fold s':>7} {'recovery s':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['generators']:>5} {r['groups_per_step']:>8} {r['groups']:>7} {r['cpu_ms']:>10.3f} "
              f"{r['events_per_real_s']:>10,.0f} {r['events_per_virtual_s']:>9,.1f} "
              f"{r['redis_cpu_ms']:>12.3f} {100 * r['idle_caused']:>10.2f}% {100 * r['idle_free']:>8.1f}% "
              f"{r['fold_s']:>7.2f} {r['recovery_s']:>10.3f}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generators", default="8,64,256,1024")
    ap.add_argument("--groups", type=int, default=4096, help="groups trained per point (about)")
    ap.add_argument("--median-s", type=float, default=20.0, help="median generation time of a group")
    ap.add_argument("--sigma", type=float, default=0.6, help="lognormal sigma (the long tail)")
    ap.add_argument("--trainer-ratio", type=float, default=1.1,
                    help="trainer time per step / the fleet's mean time to generate a step")
    ap.add_argument("--window", type=int, default=2,
                    help="staleness.window_versions (2 with ready_first keeps the trainer busy, so "
                         "every delay of the controller shows)")
    ap.add_argument("--selection", default="ready_first")
    ap.add_argument("--saturate", action="store_true",
                    help="at the largest fleet, shrink generation times until the controller is late")
    ap.add_argument("--profile", type=int, metavar="GENERATORS",
                    help="cProfile one charged run at this fleet size and print the top entries")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    fleets = [int(x) for x in args.generators.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp, \
            RedisServer(Path(tmp), appendfsync="always") as server:
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            r = one_point(args, server, args.profile, args.median_s, "profile")
            prof.disable()
            print_table([r])
            pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            return
        one_point(argparse.Namespace(**{**vars(args), "groups": 256}), server, 8, args.median_s, "warmup")
        rows = []
        for n in fleets:
            rows.append(one_point(args, server, n, args.median_s, f"g{n}"))
            print(f"{n} generators done in {rows[-1]['real_s']:.1f}s real", flush=True)
        print(f"\nvirtual time; {SAMPLES} samples/group, generation lognormal(median "
              f"{args.median_s:g}s, sigma {args.sigma:g}), trainer {args.trainer_ratio:g}x the "
              f"fleet's step time, window {args.window}, {args.selection}; redis-server appendfsync always")
        print_table(rows)
        cpus = [r["cpu_ms"] for r in rows]
        growth = cpus[-1] / cpus[0] if cpus[0] else float("inf")
        print(f"\ncontroller CPU per group, worst: {max(cpus):.3f} ms (target <= 1 ms)")
        print(f"trainer idle caused by the controller, worst: "
              f"{100 * max(r['idle_caused'] for r in rows):.2f}% (target < 1%)")
        print(f"CPU per group growth {fleets[0]} -> {fleets[-1]} generators: {growth:.2f}x "
              f"(target <= 1.5x)")
        print("load average (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        print("\nasync (window 1) vs sync (window 0), free virtual time, a step = one group per "
              "generator, in_order: the physical bound (gen + train) / max(gen, train) from the "
              "sync run's phases")
        for n in fleets:
            for sigma in (0.0, args.sigma):
                o = overlap_point(args, n, sigma)
                print(f"  {n:>5} generators, sigma {sigma:g}: speedup {o['ratio']:.2f}x of a bound "
                      f"{o['bound']:.2f}x = {100 * o['fraction']:.0f}% (target >= 90%)", flush=True)
        if args.saturate:
            n = fleets[-1]
            print(f"\nsaturation at {n} generators: generation median shrunk until the "
                  f"controller is late")
            sat = []
            for median in (args.median_s, 10.0, 5.0, 2.0, 1.0, 0.5, 0.25, 0.1):
                if median > args.median_s:
                    continue
                sat.append(one_point(args, server, n, median, f"sat{median:g}"))
                r = sat[-1]
                print(f"  median {median:>5g}s: {r['groups_per_virtual_s']:>8,.0f} groups/s offered, "
                      f"idle caused {100 * r['idle_caused']:.2f}%, CPU {r['cpu_ms']:.3f} ms/group",
                      flush=True)
                if r["idle_caused"] > 0.05:
                    break


if __name__ == "__main__":
    main()
