"""Append throughput: RedisEventStore vs raw pipelined XADD, side by side in one run.

Starts its own redis-server (the embedded one, loopback, AOF) once per fsync policy and
measures, for batch sizes 1, 10 and 100:

* store -- ``RedisEventStore.append``: encode + one EVALSHA per batch (fencing check,
  position check, XADDs with explicit ids);
* raw   -- the same encoded payloads as plain ``XADD *`` commands, one pipeline per batch.

Each cell runs for a fixed time slice, so the whole script takes about 30 seconds.
Target: store / raw >= 0.5 at batch >= 100.

    python bench/bench_append.py [--seconds-per-cell 2.0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from events.codec import encode  # noqa: E402
from events.embedded import ensure_embedded_redis, stop_embedded_redis  # noqa: E402
from events.redis_store import RedisEventStore  # noqa: E402
from events.schema import GroupCommitted  # noqa: E402

BATCH_SIZES = (1, 10, 100)
POLICIES = ("always", "everysec")


def make_events(n: int) -> list[GroupCommitted]:
    """Realistic GroupCommitted events (about 400 bytes of JSON each)."""
    return [
        GroupCommitted(
            event_id=f"group:g{i:06d}:committed:a0", epoch=1, ts=1_700_000_000.0 + i,
            group_id=f"g{i:06d}", attempt=0, weight_version_start=3, weight_version_end=4,
            payload_keys=[f"g{i:06d}/s{k}" for k in range(8)],
            rewards=[0.5 * k for k in range(8)], lengths=[128 + k for k in range(8)],
        )
        for i in range(n)
    ]


def timed(step: Callable[[], None], batch: int, seconds: float) -> float:
    """Events per second of ``step`` (one batch per call) over ``seconds``."""
    for _ in range(3):  # warm up: connection, script cache
        step()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        step()
        calls += 1
    return calls * batch / elapsed


Row = tuple[str, int, float, float]  # policy, batch, store ev/s, raw ev/s


def bench_policy(policy: str, data_dir: Path, seconds: float) -> list[Row]:
    server = ensure_embedded_redis(data_dir, appendfsync=policy)  # type: ignore[arg-type]
    store = RedisEventStore(server.url)
    rows = []
    try:
        for batch in BATCH_SIZES:
            events = make_events(batch)
            run_id = f"bench-{policy}-{batch}"
            epoch = store.claim_epoch(run_id)
            position = 0

            def store_step() -> None:
                nonlocal position
                position = store.append(run_id, events, expected_position=position, epoch=epoch)[-1]

            payloads = [(type(e).__name__, e.event_id, encode(e)) for e in events]
            raw_key = f"raw:{run_id}"

            def raw_step() -> None:
                pipe = store.client.pipeline(transaction=False)
                for type_name, event_id, data in payloads:
                    pipe.xadd(raw_key, {"type": type_name, "id": event_id, "data": data})
                pipe.execute()

            raw_rate = timed(raw_step, batch, seconds)
            store_rate = timed(store_step, batch, seconds)
            rows.append((policy, batch, store_rate, raw_rate))
    finally:
        store.close()
        stop_embedded_redis(data_dir)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds-per-cell", type=float, default=2.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlc-bench-") as tmp:
        for policy in POLICIES:
            rows += bench_policy(policy, Path(tmp) / policy, args.seconds_per_cell)
    print(f"{'appendfsync':<12}{'batch':>6}{'store ev/s':>14}{'raw ev/s':>14}{'store/raw':>11}")
    for policy, batch, store_rate, raw_rate in rows:
        ratio = store_rate / raw_rate
        print(f"{policy:<12}{batch:>6}{store_rate:>14,.0f}{raw_rate:>14,.0f}{ratio:>11.2f}")
    worst = min(s / r for _, b, s, r in rows if b >= 100)
    verdict = "met" if worst >= 0.5 else "MISSED"
    print(f"target store/raw >= 0.50 at batch >= 100: {verdict} ({worst:.2f})")


if __name__ == "__main__":
    main()
