"""Append throughput: RedisEventStore vs raw pipelined XADD, side by side in one run.

Starts its own redis-server (the embedded one, loopback, AOF) once per fsync policy and
measures, for batch sizes 1, 10 and 100:

* store -- ``RedisEventStore.append``: encode + one EVALSHA per batch (fencing check,
  position check, XADDs with explicit ids);
* unchained -- the same, on a log without a hash chain (one that starts with an entry
  from before chains, so the writer neither hashes nor sends ``h``): the chain's cost
  is store / unchained;
* raw   -- the same encoded payloads as plain ``XADD *`` commands, one pipeline per batch.

Then the cost of ``store.replicas = 1``: a primary and one replica on loopback (both
AOF ``always``), the same store appending with and without ``WAIT 1`` at batch 1 and
100, under each fsync policy; every replicated append waits for the replica's acknowledgement.

Each cell runs for a fixed time slice, so the whole script takes about a minute.
Targets: store / raw >= 0.5 at batch >= 100; store / unchained >= 0.9 at every batch.

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
from events.store_config import StoreConfig  # noqa: E402
from events.schema import GroupCommitted  # noqa: E402
from tests.sentinel_cluster import SentinelCluster  # noqa: E402

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


Row = tuple[str, int, float, float, float]  # policy, batch, store, raw, unchained ev/s


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

            legacy_id = f"legacy-{policy}-{batch}"
            legacy_epoch = store.claim_epoch(legacy_id)
            legacy_position = store.append_raw(legacy_id, encode(events[0]), event_id="old")

            def unchained_step() -> None:
                nonlocal legacy_position
                legacy_position = store.append(
                    legacy_id, events, expected_position=legacy_position, epoch=legacy_epoch
                )[-1]

            raw_rate = timed(raw_step, batch, seconds)
            unchained_rate = timed(unchained_step, batch, seconds)
            store_rate = timed(store_step, batch, seconds)
            assert store.read_raw(run_id, 1, 1)[0].chain, "the store log should be chained"
            assert not store.read_raw(legacy_id, 2, 2)[0].chain
            rows.append((policy, batch, store_rate, raw_rate, unchained_rate))
    finally:
        store.close()
        stop_embedded_redis(data_dir)
    return rows


def bench_replicas(policy: str, data_dir: Path, seconds: float) -> list[tuple[str, int, float, float]]:
    """(policy, batch, ev/s without WAIT, ev/s with WAIT 1) on a primary + replica pair.

    The two variants alternate in four slices each, so a noisy neighbour's fsync burst
    lands on both rather than on one.
    """
    pair = SentinelCluster(data_dir, n_replicas=1, n_sentinels=0, relay=False,
                           appendfsync=policy).start()  # type: ignore[arg-type]
    stores = [RedisEventStore(pair.primary.url),
              RedisEventStore(pair.primary.url, replication=StoreConfig(replicas=1))]
    rows = []
    try:
        for batch in (1, 100):
            events = make_events(batch)
            steps = []
            for i, store in enumerate(stores):
                run_id = f"bench-replicas{i}-{batch}"
                cursor = {"epoch": store.claim_epoch(run_id), "position": 0}

                def step(store=store, run_id=run_id, cursor=cursor) -> None:
                    cursor["position"] = store.append(
                        run_id, events, expected_position=cursor["position"], epoch=cursor["epoch"]
                    )[-1]

                steps.append(step)
            totals = [0.0, 0.0]
            for _ in range(4):
                for i, step in enumerate(steps):
                    totals[i] += timed(step, batch, seconds / 4) / 4
            rows.append((policy, batch, totals[0], totals[1]))
    finally:
        for store in stores:
            store.close()
        pair.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds-per-cell", type=float, default=2.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlc-bench-") as tmp:
        for policy in POLICIES:
            rows += bench_policy(policy, Path(tmp) / policy, args.seconds_per_cell)
    print(f"{'appendfsync':<12}{'batch':>6}{'store ev/s':>14}{'unchained':>12}{'raw ev/s':>14}"
          f"{'store/raw':>11}{'chain cost':>12}")
    for policy, batch, store_rate, raw_rate, unchained in rows:
        print(f"{policy:<12}{batch:>6}{store_rate:>14,.0f}{unchained:>12,.0f}{raw_rate:>14,.0f}"
              f"{store_rate / raw_rate:>11.2f}{store_rate / unchained:>12.2f}")
    worst = min(r[2] / r[3] for r in rows if r[1] >= 100)
    verdict = "met" if worst >= 0.5 else "MISSED"
    print(f"target store/raw >= 0.50 at batch >= 100: {verdict} ({worst:.2f})")
    chain = min(r[2] / r[4] for r in rows)
    verdict = "met" if chain >= 0.9 else "MISSED"
    print(f"target store/unchained >= 0.90 (the hash chain's cost): {verdict} ({chain:.2f})")
    replicated = []
    with tempfile.TemporaryDirectory(prefix="rlc-bench-") as tmp:
        for policy in POLICIES:
            replicated += bench_replicas(policy, Path(tmp) / f"pair-{policy}", args.seconds_per_cell)
    print("\nprimary + 1 replica on loopback; store.replicas=1 waits for it (WAIT 1)")
    print(f"{'appendfsync':<12}{'batch':>6}{'replicas=0 ev/s':>17}{'replicas=1 ev/s':>17}{'ratio':>8}")
    for policy, batch, plain, waited in replicated:
        print(f"{policy:<12}{batch:>6}{plain:>17,.0f}{waited:>17,.0f}{waited / plain:>8.2f}")


if __name__ == "__main__":
    main()
