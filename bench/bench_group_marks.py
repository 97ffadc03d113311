"""What an undo mark costs next to the pause it guards, side by side in one run.

The log writer marks a group (``controller.core.group_marks``) before folding each of
its pauses ahead of the store write, and restores the mark when the pause breaks a rule
or the write fails. Here: one group of ``--samples`` samples with ``--turns`` recorded
turns (each a pause: results, an observation flush, a model flush, the next calls), and
its next pause. Printed, best of ``--rounds`` rounds of ``--n`` repetitions each, in
microseconds per repetition:

* mark: ``mark_group`` alone;
* mark + restore: ``mark_group`` then ``restore_group`` (the refused pause's extra cost);
* pause: ``mark_group``, the pause's fold (``apply_event``), ``restore_group`` -- a
  pause folded ahead of a write that failed;

and the ratio (mark + restore) / pause.

    python bench/bench_group_marks.py
    python bench/bench_group_marks.py --samples 16 --turns 10 --rounds 7
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.core.fold import fold  # noqa: E402
from controller.core.group_marks import mark_group, restore_group  # noqa: E402
from controller.core.reducer import apply_event  # noqa: E402
from controller.core.state import RunState  # noqa: E402
from events import schema as ev  # noqa: E402
from tests.unit.log_builder import LogBuilder  # noqa: E402

GID = "g1"


def pause(t: int, samples: int, recorded: list[int], seg_index: int, env_index: int) -> ev.EpisodeTurnsRecorded:
    """Turn ``t``'s pause: results of turn t - 1 (3 observation tokens each), its model
    tokens (4 each), calls of turn t; ``recorded`` is advanced."""
    results, obs, model = [], [], []
    for i in range(samples):
        if t > 1:
            results.append(ev.EnvResult(sample=i, turn=t - 1, reward=0.25, ended=False, observation_tokens=3))
            obs.append(ev.Segment(sample=i, start=recorded[i], length=3, key=f"{GID}/o{i}.{t}", turn=t - 1))
            recorded[i] += 3
        model.append(ev.Segment(sample=i, start=recorded[i], length=4, key=f"{GID}/m{i}.{t}", turn=t))
        recorded[i] += 4
    flushes = ([ev.SegmentFlush(kind="observation", weight_version=None, segments=obs)] if obs else []) + [
        ev.SegmentFlush(kind="model", weight_version=0, segments=model)]
    calls = [ev.EnvCall(sample=i, turn=t, request=f"r{i}.{t}") for i in range(samples)]
    return ev.EpisodeTurnsRecorded(
        event_id=ev.episode_turns_event_id(GID, 1, seg_index, env_index), epoch=1, ts=float(t),
        group_id=GID, attempt=1, segment_index=seg_index, env_index=env_index,
        results=results, flushes=flushes, env="calc", dedupes_by_key=True, calls=calls)


def setup(samples: int, turns: int) -> tuple[RunState, ev.EpisodeTurnsRecorded]:
    """The state after ``turns`` pauses of one group, and the group's next pause."""
    b = LogBuilder(run_id="bench", window=1, groups_per_step=1, samples_per_group=samples).start()
    b.admit(GID)
    recorded, seg_index, env_index = [0] * samples, 0, 0
    pauses = []
    for t in range(1, turns + 2):
        p = pause(t, samples, recorded, seg_index, env_index)
        seg_index += len(p.flushes)
        env_index += bool(p.results) + bool(p.calls)
        pauses.append(p)
    for p in pauses[:-1]:
        b.append(p)
    return fold(b.build()), pauses[-1]


def best_us(bodies: list[Callable[[], None]], n: int, rounds: int) -> list[float]:
    """Best microseconds per call of each body; every round runs each body in turn, so
    the machine's load falls alike on all of them."""
    best = [float("inf")] * len(bodies)
    for _ in range(rounds):
        for k, body in enumerate(bodies):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                body()
            best[k] = min(best[k], (time.perf_counter_ns() - t0) / n / 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--n", type=int, default=2000, help="repetitions per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if args.samples < 1 or args.turns < 1 or args.n < 1 or args.rounds < 1:
        p.error("--samples, --turns, --n and --rounds must be >= 1")
    state, nxt = setup(args.samples, args.turns)
    pos = state.position + 1

    def mark() -> None:
        mark_group(state, GID)

    def mark_restore() -> None:
        restore_group(state, mark_group(state, GID))

    def guarded_pause() -> None:
        m = mark_group(state, GID)
        apply_event(state, nxt, pos)
        restore_group(state, m)
        state.position = pos - 1

    t_mark, t_both, t_pause = best_us([mark, mark_restore, guarded_pause], args.n, args.rounds)
    print(f"group of {args.samples} samples, {args.turns} recorded turns; best of {args.rounds} x {args.n}")
    print(f"  mark             {t_mark:8.2f} us")
    print(f"  mark + restore   {t_both:8.2f} us")
    print(f"  pause (guarded)  {t_pause:8.2f} us   (mark + fold + restore)")
    print(f"  ratio (mark + restore) / guarded pause: {t_both / t_pause:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
