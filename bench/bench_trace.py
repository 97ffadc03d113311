"""``rl-controller trace`` over a long log: wall time, against reading the log alone.

Generates ~``--events`` events with bench_fold's realistic run (``stream_random_run``
with its ``RUN_OPTIONS``, chunk by chunk: the log is never held whole), writes them to a
real redis-server (appendfsync everysec), then times, side by side in one run
(interleaved, best of ``--repeat``), each as a subprocess through the real CLI entry:

  (a) read   -- every event read and decoded the way trace reads them (``views.source``)
  (b) trace  -- ``rl-controller trace --run bench -o FILE``

and prints wall seconds, events/s, (b)/(a), the trace file's size and each process's
peak RSS by GNU time (the trace streams: its memory must not grow with the log; a log
4x shorter is traced too, so the two peaks can be compared). The CPU column is the
process's own (the forked page readers' time is not in it).
Target: (b) < 10 s for 1M events.

    python bench/bench_trace.py --events 1000000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_fold import EVENTS_PER_STEP, RUN_OPTIONS  # noqa: E402
from events.codec import encode  # noqa: E402
from tests.unit.random_log import stream_random_run  # noqa: E402

TARGET_S = 10.0
READ_ONLY = (
    "import sys\nfrom events.redis_store import RedisEventStore\nfrom views import source\n"
    "store = RedisEventStore(sys.argv[1])\nn = sum(1 for _ in source.events(store, sys.argv[2]))\n"
    "print(n)\n"
)


def load_log(url: str, run_id: str, events: int, seed: int) -> int:
    """The generated run's events appended raw to the real server, 5000 per pipeline."""
    from events.redis_store import RedisEventStore, events_key, meta_key

    store = RedisEventStore(url)
    client = store.client
    client.sadd("rlc:runs", run_id)
    client.hset(meta_key(run_id), "epoch", 99)
    n = 0
    pipe = client.pipeline(transaction=False)
    for chunk in stream_random_run(seed, max(1, events // EVENTS_PER_STEP), **RUN_OPTIONS):
        for stored in chunk:
            n += 1
            pipe.xadd(events_key(run_id), {"type": type(stored.event).__name__,
                                           "id": stored.event.event_id,
                                           "data": encode(stored.event)}, id=f"0-{n}")
            if n % 5000 == 0:
                pipe.execute()
    pipe.execute()
    store.close()
    return n


def measured(argv: list[str]) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS MB) of one subprocess, by GNU time (it must succeed)."""
    proc = subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", *argv], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed: {proc.stderr[-2000:]}")
    wall, user, system, rss_kb = proc.stderr.strip().splitlines()[-1].split()
    return float(wall), float(user) + float(system), int(rss_kb) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from events.embedded import ensure_embedded_redis, stop_embedded_redis

    with tempfile.TemporaryDirectory(prefix="rlc-bench-trace-") as tmp_name:
        tmp = Path(tmp_name)
        server = ensure_embedded_redis(tmp / "redis", appendfsync="everysec")
        try:
            t0 = time.perf_counter()
            n = load_log(server.url, "bench", args.events, args.seed)
            small = load_log(server.url, "bench-quarter", args.events // 4, args.seed)
            print(f"log: {n:,} events (+ {small:,} in a quarter-size run), written to "
                  f"redis in {time.perf_counter() - t0:.0f}s", flush=True)
            out = tmp / "trace.json"
            py = sys.executable
            read = [py, "-c", READ_ONLY, server.url, "bench"]
            trace = [py, "-m", "cli.main", "trace", "--redis-url", server.url,
                     "--run", "bench", "-o", str(out)]
            best: list[tuple[float, float, float]] = [(float("inf"),) * 3] * 2
            for _ in range(args.repeat):
                for i, argv in enumerate((read, trace)):
                    best[i] = min(best[i], measured(argv))
            quarter = [*trace[:-4], "--run", "bench-quarter", "-o", str(tmp / "quarter.json")]
            rss_quarter = measured(quarter)[2]
            size_mb = out.stat().st_size / 1e6
        finally:
            stop_embedded_redis(tmp / "redis")
    (t_read, cpu_read, rss_read), (t_trace, cpu_trace, rss_trace) = best
    print(f"{'measure':<12}{'wall s':>9}{'CPU s':>8}{'events/s':>12}{'peak RSS MB':>13}")
    for name, wall, cpu, rss in (("(a) read", t_read, cpu_read, rss_read),
                                 ("(b) trace", t_trace, cpu_trace, rss_trace)):
        print(f"{name:<12}{wall:>9.2f}{cpu:>8.2f}{n / wall:>12,.0f}{rss:>13.0f}")
    print(f"(b)/(a) wall: {t_trace / t_read:.2f}x; trace file {size_mb:.0f} MB; peak RSS of "
          f"the trace over a 4x shorter log: {rss_quarter:.0f} MB (the full log's: {rss_trace:.0f})")
    verdict = "met" if t_trace < TARGET_S * n / 1_000_000 else "MISSED"
    print(f"trace of {n / 1e6:.2f}M events: {t_trace:.1f}s (target < {TARGET_S:.0f}s per 1M: {verdict})")
    print("load average (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
