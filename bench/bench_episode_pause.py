"""One event per episode pause against the four it replaced, side by side in one run.

A deduplicating env's pause used to append up to four events (``EnvStepsCompleted``,
the observation and model ``SegmentsRecorded``, ``EnvStepsRequested``); it now appends
one ``EpisodeTurnsRecorded`` standing for them (``controller.core.turns``). Both shapes
fold to the same state, so the older writer can run here next to the current one: the
"four" mode swaps ``controller.episodes.flush_events`` for the writer as it was
(:func:`four`), for the length of its runs. Everything else -- the virtual-time fleet, the timings, the real
redis-server with ``appendfsync always``, the linger -- is ``bench_episodes``' "now"
mode, so the ratio is the per-pause saving alone.

Printed per fleet size: the controller's thread CPU per group (simulated workers
excluded, as ``bench_episodes`` counts it) of each mode in each round (the order
alternates from round to round), the best of the rounds, events and appends per group,
and the ratio four / one.

    python bench/bench_episode_pause.py                       # 64 and 1024 generators
    python bench/bench_episode_pause.py --generators 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_episodes import one  # noqa: E402
from controller import episodes  # noqa: E402
from controller.journal import Journal  # noqa: E402
from events import schema as ev  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from workers.api import EpisodeFlush, GenerationRequest  # noqa: E402
from workers.generator.config import PartialSection  # noqa: E402


def four(journal: Journal, req: GenerationRequest, flush: EpisodeFlush) -> list[ev.Event]:
    """A pause as the writer appended it before: each part an event of its own, made by
    the journal (stamped, one by one), in the order the pause stands for them."""
    state, gid, attempt = journal.state, req.group_id, req.attempt
    seg, env = episodes.segment_index(state, gid), episodes.env_index(state, gid)
    out: list[ev.Event] = []
    if flush.completed:
        out.append(journal.make(
            ev.EnvStepsCompleted, event_id=ev.env_steps_event_id(gid, "completed", attempt, env),
            group_id=gid, attempt=attempt, index=env, results=list(flush.completed)))
        env += 1
    for k, f in enumerate(flush.segments, start=seg):
        out.append(journal.make(
            ev.SegmentsRecorded, event_id=ev.segments_event_id(gid, attempt, k), group_id=gid,
            attempt=attempt, index=k, kind=f.kind, weight_version=f.weight_version,
            segments=list(f.segments)))
    if flush.requested:
        out.append(journal.make(
            ev.EnvStepsRequested, event_id=ev.env_steps_event_id(gid, "requested", attempt, env),
            group_id=gid, attempt=attempt, index=env, env=flush.env,
            dedupes_by_key=flush.dedupes_by_key, calls=list(flush.requested)))
    return out


@contextmanager
def writer(mode: str) -> Iterator[None]:
    """``flush_events`` of ``mode``: "one" (the current writer) or "four" (as it was)."""
    current = episodes.flush_events
    if mode == "four":
        episodes.flush_events = four
    try:
        yield
    finally:
        episodes.flush_events = current


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generators", default="64,1024", help="fleet sizes, comma separated")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--groups", type=int, default=2048, help="groups per run (at least 4 steps)")
    p.add_argument("--median-s", type=float, default=30.0, help="median generation time of a group")
    p.add_argument("--linger-s", type=float, default=PartialSection().record_linger_s)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.turns < 1:
        p.error("--rounds and --turns must be >= 1")
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp), appendfsync="always") as server:
        for n in (int(x) for x in args.generators.split(",")):
            runs: dict[str, list[dict[str, float]]] = {"four": [], "one": []}
            for r in range(args.rounds):
                for mode in (("four", "one") if r % 2 == 0 else ("one", "four")):
                    with writer(mode):
                        runs[mode].append(one(server.url, args, n, args.turns, args.linger_s,
                                              tag=f"-{mode}-{r}"))
            best = {m: min(x["cpu_ms"] for x in rs) for m, rs in runs.items()}
            for m, rs in runs.items():
                print(f"{n:>5} generators, {m} event(s) per pause: controller CPU per group "
                      + " / ".join(f"{x['cpu_ms']:.3f}" for x in rs) + f" ms (best {best[m]:.3f}); "
                      f"events per group {rs[0]['events_per_group']:.1f}, appends per group "
                      f"{rs[0]['appends_per_group']:.1f}", flush=True)
            print(f"{n:>5} generators: four / one = x{best['four'] / best['one']:.2f} "
                  f"(best of {args.rounds} rounds each)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
