"""What the simulator's uncharged section itself charges to the controller, side by side.

A simulated run's controller CPU is the loop thread's CPU less every section the
simulated workers run in (``VirtualTimeLoop.uncharged``). The section subtracts the CPU
between its two clock reads; whatever its own machinery runs outside them is charged to
the controller although it is the simulator's. This bench runs empty sections of two
kinds in one process, alternated, best of ``--rounds``:

* "generator": a ``contextlib.contextmanager`` section, as the loop had it (a manager and
  a generator built per section, entered and left through ``StopIteration``);
* "loop": the loop's own section (``sim.clock``: one reusable manager per loop).

Printed per kind: the loop thread's CPU per section, the part the section subtracts, and
the part charged (what the controller's figure wrongly carried per section); then how
many outermost sections a 10-turn episode group enters in a ``bench_episodes``-shaped run
(``--generators``, ``--groups``; 0 groups: skipped) and what that makes per group.

    python bench/bench_uncharged.py
    python bench/bench_uncharged.py --groups 0
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.clock import VirtualTimeLoop  # noqa: E402


def generator_section(loop: VirtualTimeLoop) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """The section as the loop had it before (a reference, not used by the simulator)."""

    @contextlib.contextmanager
    def uncharged() -> Iterator[None]:
        if loop._uncharged_depth:
            yield
            return
        loop._uncharged_depth = 1
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            loop._uncharged_depth = 0
            spent = time.perf_counter() - start
            loop.uncharged_cpu_s += time.thread_time() - cpu
            loop.uncharged_s += spent
            loop._mark += spent

    return uncharged


def per_section(loop: VirtualTimeLoop, section, n: int) -> tuple[float, float]:
    """(loop-thread CPU, the part subtracted) per empty section, seconds."""
    loop.uncharged_cpu_s = 0.0
    t0 = time.thread_time()
    for _ in range(n):
        with section():
            pass
    total = time.thread_time() - t0
    return total / n, loop.uncharged_cpu_s / n


def sections_per_group(generators: int, groups: int) -> float:
    """Outermost uncharged sections per committed group of an episode run (memory store)."""
    import msgspec

    from bench.bench_scale import config_for, timings_for
    from events.memory_store import MemoryEventStore
    from sim.harness import SimSpec, simulate

    count = [0]
    plain = VirtualTimeLoop.uncharged

    def counted(self: VirtualTimeLoop):  # type: ignore[no-untyped-def]
        count[0] += not self._uncharged_depth
        return plain(self)

    cfg = config_for(generators, groups, window=2, selection="oldest_first")
    partial = msgspec.structs.replace(cfg.rollout.partial, enabled=True)
    cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, partial=partial))
    spec = SimSpec(config=cfg, timings=timings_for(cfg, 30.0, 0.5, 1.05), run_id="sections",
                   charge_real_time=False, episode_turns=10)
    VirtualTimeLoop.uncharged = counted  # type: ignore[method-assign]
    try:
        out = simulate(MemoryEventStore(), spec)
    finally:
        VirtualTimeLoop.uncharged = plain  # type: ignore[method-assign]
    done = sum(1 for g in out.writer.state.groups.values() if g.committed_position is not None)
    return count[0] / done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", type=int, default=200_000, help="empty sections per round and kind")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--generators", type=int, default=1024)
    p.add_argument("--groups", type=int, default=2048, help="0: do not count sections per group")
    args = p.parse_args(argv)
    if args.sections < 1 or args.rounds < 1 or args.groups < 0:
        p.error("--sections and --rounds must be >= 1, --groups >= 0")
    gc.disable()  # a collection inside a round would land on one kind only
    loop = VirtualTimeLoop(charge_real_time=True)
    kinds = {"generator": generator_section(loop), "loop": loop.uncharged}
    best = {k: (float("inf"), 0.0) for k in kinds}
    for r in range(args.rounds):
        for k in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
            total, inside = per_section(loop, kinds[k], args.sections)
            if total < best[k][0]:
                best[k] = (total, inside)
    charged = {k: total - inside for k, (total, inside) in best.items()}
    for k, (total, inside) in best.items():
        print(f"{k:>9}: {1e6 * total:.3f} us of loop-thread CPU per empty section, "
              f"{1e6 * inside:.3f} subtracted, {1e6 * charged[k]:.3f} charged to the controller")
    print(f"charged per section, generator / loop = x{charged['generator'] / charged['loop']:.2f}")
    if args.groups:
        n = sections_per_group(args.generators, args.groups)
        saved = n * (charged["generator"] - charged["loop"])
        print(f"{n:.1f} outermost sections per group ({args.generators} generators, 10-turn "
              f"episodes): {1e3 * n * charged['generator']:.4f} -> {1e3 * n * charged['loop']:.4f} "
              f"ms per group charged by the sections themselves ({1e3 * saved:.4f} ms less)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
