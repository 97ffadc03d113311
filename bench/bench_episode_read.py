"""How ``replay --episode`` reads the log: its group filter against the projector's fold.

``replay --episode`` decodes the log page by page (``views.source.events``, the
projector's page reader) and keeps one group's events, which ``replay.episode`` folds
into the episode. The alternative is the projector every other view uses
(``Projector.get`` with an observer that keeps the group's events): the same pages and
decoding, plus the reducer over every event and the whole run's state in memory (an
observer rules out the snapshot). This times both over a generated log
(``tests.unit.random_log.random_run``, in the in-memory store), side by side in one
run, alternating their order over ``--rounds`` rounds (best CPU seconds of this process
each), checks that both keep the same events, then measures each one's peak of
Python-allocated memory (``tracemalloc``, in a pass of its own: it slows the code).

    python bench/bench_episode_read.py --steps 12000
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.projector import Projector  # noqa: E402
from events import schema as ev  # noqa: E402
from tests.unit.random_log import random_run  # noqa: E402
from tests.unit.test_audit import store_of  # noqa: E402
from views import source  # noqa: E402

#: the event types ``replay.episode.episode_view`` reads
EPISODE_EVENTS = (ev.RolloutAdmitted, ev.SegmentsRecorded, ev.EnvStepsRequested,
                  ev.EnvStepsCompleted, ev.EpisodesRestarted, ev.GroupCommitted)


class GroupEvents:
    """An observer of the projector's fold that keeps one group's events."""

    def __init__(self, group_id: str) -> None:
        self.group_id, self.events = group_id, []

    def watches(self) -> dict[type, Any]:
        def keep(event: Any, position: int, state: Any) -> None:
            if event.group_id == self.group_id:
                self.events.append(event)
        return {cls: keep for cls in EPISODE_EVENTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12000)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    b = random_run(3, args.steps, window=2)
    store, run = store_of(b), b.run_id
    group = next(e.event.group_id for e in b.events if isinstance(e.event, ev.GroupCommitted))

    def filtered() -> list:  # what cli.replay_cmd does
        return [e for _, e in source.events(store, run) if getattr(e, "group_id", None) == group]

    def projected() -> list:
        keep = GroupEvents(group)
        if Projector(store, fork_readers=False).get(run, observers=[keep]).problem is not None:
            sys.exit("the generated log does not fold")
        return keep.events

    reads: dict[str, Callable[[], list]] = {"filter": filtered, "projector": projected}
    wanted = [e for e in filtered() if isinstance(e, EPISODE_EVENTS)]
    if projected() != wanted:
        sys.exit("the two reads kept different events")
    best: dict[str, float] = {}
    for r in range(args.rounds):
        for name in (list(reads) if r % 2 == 0 else list(reversed(reads))):
            cpu = time.process_time()
            reads[name]()
            best[name] = min(best.get(name, float("inf")), time.process_time() - cpu)
    print(f"{len(b):,} events, one group's {len(wanted)} kept")
    for name, fn in reads.items():
        tracemalloc.start()
        fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"  {name:<9} cpu {best[name] * 1000:8.1f} ms   peak {peak / 2**20:8.1f} MiB")
    print(f"  projector / filter: cpu x{best['projector'] / best['filter']:.2f}")


if __name__ == "__main__":
    main()
