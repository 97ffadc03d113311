"""Recovery time and replay-retrain speed, measured side by side in one run.

(1) Recovery of a long log: a simulated run of ~``--events`` events (admissions,
    commits, microbatches, finishes, publishes, checkpoints, releases, failures,
    evictions, aborts, restarts) is written to a real redis-server (AOF, appendfsync
    always) with a snapshot ``--snapshot-lag`` events before the end (the log writer
    snapshots every 5000 events, so this is the worst case). Timed: ``resume_run``
    -- claim a new epoch, load the snapshot, fold the tail, append ControllerStarted
    (the first new event) and repair the log -- best of ``--repeat``; and the same
    without a snapshot (fold from position 1). Target: < 2 s, plus checkpoint load.
(2) Checkpoint load of the trainer the run uses (verify every file hash + load).
(3) Replay-retrain vs original training: a real tiny run (in-process workers, memory
    data plane + spill, payloads retained) trains ``--steps`` steps; then
    ``replay --retrain`` re-trains all of them from the initial weights, checking every
    digest. Reported: the seconds each took per step (original: StepBegun ->
    StepFinished, which includes waiting for data) and the ratio.

    python bench/bench_recovery.py --events 100000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.core.fold import fold  # noqa: E402
from controller.startup import resume_run  # noqa: E402
from controller.core.state import encode_state  # noqa: E402
from events.redis_store import RedisEventStore  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from tests.unit.random_log import random_run  # noqa: E402

EVENTS_PER_STEP = 30


def write_log(store: RedisEventStore, events, batch: int = 2000) -> str:
    run_id = events[0].event.run_id
    claimed = 0
    i = 0
    while i < len(events):
        epoch = events[i].event.epoch
        while claimed < epoch:
            claimed = store.claim_epoch(run_id)
        j = i
        while j < len(events) and j - i < batch and events[j].event.epoch == epoch:
            j += 1
        store.append(run_id, [e.event for e in events[i:j]], expected_position=i, epoch=epoch)
        i = j
    return run_id


def bench_resume(args: argparse.Namespace, tmp: Path) -> None:
    t0 = time.perf_counter()
    builder = random_run(
        args.seed, max(1, args.events // EVENTS_PER_STEP), window=2, groups_per_step=8,
        samples_per_group=8, microbatch_groups=2, p_fail=0.01, p_abort=0.005,
        p_restart=0.001, checkpoint_every=20, finish=False,
    )
    events = builder.build()
    with RedisServer(tmp / "redis") as server:
        store = RedisEventStore(server.url)
        run_id = write_log(store, events)
        snap_at = max(1, len(events) - args.snapshot_lag)
        state = fold(events[:snap_at])
        print(f"log: {len(events)} events written in {time.perf_counter() - t0:.1f}s; "
              f"snapshot at position {snap_at} ({len(events) - snap_at} events of tail)")
        timings = []
        for _ in range(args.repeat):
            store.save_snapshot(run_id, snap_at, encode_state(state))
            started = time.perf_counter()
            writer = resume_run(store, run_id)
            timings.append(time.perf_counter() - started)
            snap_at = writer.position  # later repeats: the tail since the last resume
            state = writer.state
        print(f"resume with snapshot   : best {min(timings):.3f}s  median "
              f"{statistics.median(timings):.3f}s  (claim, snapshot, tail fold, "
              f"ControllerStarted, repair)")
        # without a snapshot: a fresh run id holding the same log
        store.close()
    with RedisServer(tmp / "redis2") as server:
        store = RedisEventStore(server.url)
        run_id = write_log(store, events)
        started = time.perf_counter()
        resume_run(store, run_id)
        print(f"resume without snapshot: {time.perf_counter() - started:.3f}s (fold from position 1)")
        store.close()


def bench_retrain(args: argparse.Namespace, tmp: Path) -> None:
    from cli.main import main as cli_main
    from controller.config import config_from_dict
    from controller.wiring import worker_spec
    from events.redis_store import RedisEventStore
    from controller.projector import Projector
    from replay.retrain import run_retrain
    from tests.chaos.harness import TINY
    from workers.service import TrainerWorker

    with RedisServer(tmp / "redis3") as server:
        data = tmp / "data"
        started = time.perf_counter()
        rc = cli_main(["run", "--run-id", "b", "--steps", str(args.steps), "--redis-url", server.url,
                       "--data-dir", str(data), *TINY])
        wall = time.perf_counter() - started
        assert rc == 0, rc
        store = RedisEventStore(server.url)
        state = Projector(store).get("b").state
        store.close()
        ck = state.latest_checkpoint()
        worker = TrainerWorker(worker_spec(config_from_dict(state.config), "b", data / "runs" / "b"))
        t = time.perf_counter()
        worker.load_checkpoint(ck.uri, ck.sha256)
        print(f"checkpoint load        : {time.perf_counter() - t:.3f}s (tiny model, verify + load)")
        t = time.perf_counter()
        report = run_retrain(state, data / "runs" / "b", from_version=None, stop_on_mismatch=True)
        replay_wall = time.perf_counter() - t
    replay_s = sum(c.replay_s for c in report.checks)
    original_s = sum(c.original_s for c in report.checks)
    n = len(report.checks)
    print(f"original training      : {args.steps} steps, run wall {wall:.2f}s, "
          f"StepBegun->StepFinished {original_s / n * 1000:.1f} ms/step")
    print(f"replay --retrain       : {n} steps, {'all digests match' if report.ok else 'MISMATCH'}, "
          f"{replay_s / n * 1000:.1f} ms/step (wall incl. trainer build + spill reload "
          f"{replay_wall:.2f}s)")
    print(f"replay speed vs original: {original_s / max(replay_s, 1e-9):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--snapshot-lag", type=int, default=4999,
                        help="events between the newest snapshot and the end of the log")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="steps of the retrain benchmark")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bench_resume(args, Path(tmp))
        bench_retrain(args, Path(tmp))


if __name__ == "__main__":
    main()
