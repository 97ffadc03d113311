"""Read-only tools over a 1M-event log in a real redis-server: audit and staleness speed.

Generates a realistic log (``tests.unit.random_log.random_run``: admissions ahead of the
trainer, out-of-order commits, failures, evictions, aborts, restarts, checkpoints,
releases), writes it into a fresh redis-server (temp dir, loopback) through
``RedisEventStore.append`` in batches, then times, side by side in one run (best of
``--repeat``), each exactly as the CLI runs it (store reads included):

  (a) fold only         -- ``controller.projector.Projector.get`` (read pages + decode + reducer)
  (b) audit             -- (a) + the audit report (history, cross-check) + ``to_dict()``
  (c) staleness         -- (a) with the staleness trace + the analysis + ``to_dict()``
  (d) read only         -- the pages alone, for attribution
  (e) audit with chain  -- what ``rl-controller audit`` runs (``replay.chain_audit.audit_log``):
                           (b) with the page reads checking the hash chain's links, so
                           the log is read once
  (f) audit, chain      -- (b), then the separate chain walk in this process (attribution)
  (g) audit + walk      -- (b) with the separate walk in a forked process meanwhile: how
                           audit ran before (the log read twice), for the ratio (g)/(e)

(client CPU is this process's; the page readers and (g)'s walk run in children,
counted apart, and so is redis-server's CPU: the three over the machine's cores are the
least wall time the work could take on it)
(the CLI renders both reports from ``to_dict()``, tables and JSON alike). The machine's
load average is printed with the results: on a shared machine, compare runs only at
similar loads.

and prints events/s for each. Target: audit (with the chain) and staleness < 3 s per 1M
events (a 10k-step x 512-group log of ~20M events audited within a minute). Next to the
wall time, the client CPU per 1M events: on a machine shared with other work the wall
time moves with the load, the CPU of this process much less.

    python bench/bench_replay_tools.py --events 1000000
    python bench/bench_replay_tools.py --events 20000000 --repeat 1 --measures e  # the 20M point

Logs are generated and appended page by page (``stream_random_run``), and every tool
folds page by page: the log itself is never held by this process. What does grow is
redis-server (the log) and the folded state (every group of the run), about
``STATE_BYTES_PER_EVENT`` + ``REDIS_BYTES_PER_EVENT`` per event (~18 GB at 20M): the
bench prints that estimate and refuses to start when the machine's available memory
is below it (``--force`` to run anyway). At 20M events it also prints the measured
audit time against the one-minute target.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fold import EVENTS_PER_STEP, RUN_OPTIONS, STATE_BYTES_PER_EVENT  # noqa: E402
from bench_memory import check_memory  # noqa: E402
from events.redis_store import RedisEventStore  # noqa: E402
from replay import staleness  # noqa: E402
from replay.audit import build_report  # noqa: E402
from replay.chain_audit import audit_chain, audit_log, start_audit_chain  # noqa: E402
from controller.projector import Projector, iter_pages  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from tests.unit.random_log import stream_random_run  # noqa: E402

TARGET_S_PER_1M = 3.0
#: the long-run point of the issue: a 10k-step x 512-group log, audited within a minute
LONG_RUN_EVENTS, LONG_RUN_TARGET_S = 20_000_000, 60.0
#: redis-server's used_memory per event, measured with bench_fold's RUN_OPTIONS (the log
#: is generated with them, so the fold's STATE_BYTES_PER_EVENT holds here too)
REDIS_BYTES_PER_EVENT = 450
ALL_MEASURES = "abcdegf"


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _best(fn: Callable[[], object], repeat: int, server_pid: int) -> tuple[float, float, float, float]:
    """Best wall time; and, from the same repeat, the CPU seconds of this process (the
    client: on a shared machine it moves less with the load than the wall time does), of
    its forked children (page readers, chain walk) and of redis-server. Their sum over
    the machine's cores is the least wall time the work could take here."""
    best = (float("inf"), 0.0, 0.0, 0.0)
    for _ in range(repeat):
        gc.collect()
        cpu0, kids0, server0 = time.process_time(), _children_cpu_s(), _process_cpu_s(server_pid)
        start = time.perf_counter()
        fn()
        wall = time.perf_counter() - start
        if wall < best[0]:
            best = (wall, time.process_time() - cpu0, _children_cpu_s() - kids0,
                    _process_cpu_s(server_pid) - server0)
    return best


def write_log(
    store: RedisEventStore, run_id: str, events: list, batch: int = 2000, position: int = 0
) -> int:
    """Append with fencing: claim each epoch the log moves to, batches within an epoch.
    ``events`` follow ``position``; returns the new last position."""
    i = 0
    while i < len(events):
        epoch = events[i].epoch
        while not store.run_exists(run_id) or store.current_epoch(run_id) < epoch:
            store.claim_epoch(run_id)
        j = i
        while j < len(events) and events[j].epoch == epoch and j - i < batch:
            j += 1
        store.append(run_id, events[i:j], expected_position=position, epoch=epoch)
        position += j - i
        i = j
    return position


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="approximate log length")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="run even if memory looks short")
    parser.add_argument("--measures", default=ALL_MEASURES,
                        help=f"which of {ALL_MEASURES} to time (e.g. 'e' for the 20M point)")
    args = parser.parse_args()
    unknown = set(args.measures) - set(ALL_MEASURES)
    if unknown or not args.measures:
        parser.error(f"--measures takes letters of {ALL_MEASURES}, got {args.measures!r}")
    check_memory(args.events, STATE_BYTES_PER_EVENT + REDIS_BYTES_PER_EVENT,
                 "folded state + redis-server", args.force)

    steps = max(1, args.events // EVENTS_PER_STEP)

    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp), appendfsync="everysec") as server:
        store = RedisEventStore(server.url)
        t0 = time.perf_counter()
        n, pending = 0, []
        for chunk in stream_random_run(args.seed, steps, **RUN_OPTIONS):
            pending += (s.event for s in chunk)
            if len(pending) >= 100_000:
                n = write_log(store, f"sim-{args.seed}", pending, position=n)
                pending = []
        n = write_log(store, f"sim-{args.seed}", pending, position=n)
        del pending
        print(f"log: {n} events, generated and written to redis-server in "
              f"{time.perf_counter() - t0:.1f}s")
        run_id = store.list_runs()[0].run_id
        redis_bytes = int(store.client.info("memory")["used_memory"])
        print(f"redis-server holds the log in {redis_bytes / 2**20:,.0f} MiB "
              f"({redis_bytes / n:.0f} bytes/event)")

        def read_only() -> None:
            for _ in iter_pages(store, run_id):
                pass

        def fold_only() -> None:
            assert Projector(store).get(run_id).problem is None

        def audit() -> None:
            report = build_report(Projector(store).get(run_id))
            assert report.ok, report.problem
            report.to_dict()

        def audit_with_chain() -> None:  # as ``rl-controller audit`` runs it
            result, chain = audit_log(store, run_id, None)
            report = build_report(result)
            assert report.ok and chain.status == "ok", (report.problem, chain)
            report.to_dict()

        def audit_and_walk() -> None:  # the two reads audit used to make
            verdict = start_audit_chain(store, run_id, None)
            audit()
            chain = verdict()
            assert chain.status == "ok", chain

        def audit_then_chain() -> None:
            audit()
            chain = audit_chain(store, run_id, None)
            assert chain.status == "ok", chain

        def stale() -> None:
            trace = staleness.Trace()
            result = Projector(store).get(run_id, observers=[trace])
            staleness.analyze(result.state, trace).to_dict()

        measures = [
            ("(a) fold only", fold_only), ("(b) audit", audit), ("(c) staleness", stale),
            ("(d) read only", read_only), ("(e) audit+chain", audit_with_chain),
            ("(g) audit + walk", audit_and_walk), ("(f) audit, chain", audit_then_chain),
        ]
        assert server.process is not None
        rows = [(name, _best(fn, args.repeat, server.process.pid))
                for name, fn in measures if name[1] in args.measures]
        store.close()
    cores = os.cpu_count() or 1
    print(f"{'measure':<16} {'seconds':>9} {'events/s':>12} {'client CPU s':>13} "
          f"{'readers CPU s':>14} {'server CPU s':>13} {f'CPU / {cores} cores':>15}")
    for name, (secs, cpu, kids, server_cpu) in rows:
        print(f"{name:<16} {secs:>9.2f} {n / secs:>12,.0f} {cpu:>13.2f} {kids:>14.2f} "
              f"{server_cpu:>13.2f} {(cpu + kids + server_cpu) / cores:>15.2f}")
    print("load average (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print(f"(CPU / {cores} cores: all three processes' CPU over this machine's cores, the "
          "least wall time the work could take here)")
    per_1m = {name: (secs * 1e6 / n, cpu * 1e6 / n) for name, (secs, cpu, _, _) in rows}
    for name in ("(e) audit+chain", "(b) audit", "(c) staleness"):
        if name not in per_1m:
            continue
        wall, cpu = per_1m[name]
        verdict = "met" if wall < TARGET_S_PER_1M else "MISSED"
        print(f"per 1M events: {name[4:]:<12} {wall:5.2f} s wall ({verdict}: target "
              f"< {TARGET_S_PER_1M:.0f} s), {cpu:5.2f} s client CPU")
    if "(g) audit + walk" in per_1m and "(e) audit+chain" in per_1m:
        print(f"audit with chain, one read vs two: (g)/(e) = "
              f"{per_1m['(g) audit + walk'][0] / per_1m['(e) audit+chain'][0]:.2f}x wall")
    if "(e) audit+chain" not in per_1m:
        return
    audit_s = per_1m["(e) audit+chain"][0]
    if n >= LONG_RUN_EVENTS * 0.95:
        total = audit_s * n / 1e6
        verdict = "met" if total < LONG_RUN_TARGET_S else "MISSED"
        print(f"{n / 1e6:.1f}M-event log: audit with chain {total:.0f} s "
              f"(target < {LONG_RUN_TARGET_S:.0f} s: {verdict})")
    else:
        print(f"a 20M-event log would audit in ~{audit_s * 20:.0f} s at this rate "
              f"(target < {LONG_RUN_TARGET_S:.0f} s; run --events {LONG_RUN_EVENTS} to measure it)")


if __name__ == "__main__":
    main()
