"""Fold throughput: how fast a log of encoded events becomes a ``RunState``.

Generates a realistic log (admissions ahead of the trainer, commits of N samples each,
microbatches, finishes, publishes, checkpoints and releases, occasional failures,
evictions, aborts and restarts) as the JSON bytes a store returns, then times, side
by side in one run (best of ``--repeat``):

  (a) raw decode   -- ``msgspec.json.decode`` of every entry into the typed event union
  (b) decode+fold  -- ``controller.core.fold.fold_raw`` (the codec's decode + the reducer)
  (c) reduce only  -- the reducer over already-decoded events (for attribution)
  (d) decode, kept -- (a) with every decoded event kept alive, as a fold keeps what it
                      reads in its state (for attribution: decoding into memory that
                      stays live costs about twice (a), whose memory is reused at once)

and prints events/s and the ratio (b)/(a), all by this process's CPU time (the machine
may be shared: CPU time moves much less with other work than wall time does). Targets: (b) >= 300k events/s and >= 0.5x (a).
Then (c) split by event type: what each handler costs per call, beside the average the
0.5x target leaves the reducer (as much again as decoding, per event).

Above ``--stream-above`` events (default 2M; e.g. ``--events 20000000``, a 10k-step run
of ~2000 events per step) the log is generated, encoded and folded chunk by chunk
(``stream_random_run``), one pass: (a) and (b) are timed per chunk and summed, and the
log is never held whole (only the folded state grows, ~``STATE_BYTES_PER_EVENT`` per
event: ~10 GB at 20M; the bench refuses to start when the machine's available memory is
below its estimate, ``--force`` to run anyway). The chain comparison is skipped.

Then the hash chain's cost on the read path: the first ``--redis-events`` entries are
written to a real redis-server twice, as a chained log (an ``h`` field per entry) and
an unchained one, and ``controller.projector.Projector.get`` (what replay and audit fold with)
reads and folds each, interleaved. Target: chained >= 0.9x unchained.
The three are timed in turn within each repeat (not all (a) first), so a load change on
a shared machine shows in all of them alike; the load average is printed too.

    python bench/bench_fold.py --events 400000
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402

from controller.core.fold import fold_raw  # noqa: E402
from controller.core.reducer import apply_event  # noqa: E402
from controller.core.state import initial_state  # noqa: E402
from events.schema import AnyEvent  # noqa: E402
from controller.core.fold import apply_raw  # noqa: E402
from events.codec import encode  # noqa: E402
from bench_memory import check_memory  # noqa: E402
from tests.unit.random_log import random_run, stream_random_run  # noqa: E402

#: the streamed fold prints a progress line (stderr) each time it passes a multiple of this
PROGRESS_EVERY = 1_000_000
EVENTS_PER_STEP = 30  # measured with the settings below (8 admits + 8 commits + 4 microbatches + releases ...)
RUN_OPTIONS = dict(
    window=2, groups_per_step=8, samples_per_group=8, microbatch_groups=2, p_fail=0.01,
    p_abort=0.005, p_restart=0.001, checkpoint_every=20,
)
FOLD_TARGET = 0.5
#: RSS growth of a fold per event with the settings above (every group stays in the state)
STATE_BYTES_PER_EVENT = 500


def _best_interleaved(
    fns: list[Callable[[], object]], repeat: int, clock: Callable[[], float] = time.perf_counter
) -> list[float]:
    """Best time of each function by ``clock``, running them in turn within each repeat."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            gc.collect()
            start = clock()
            fn()
            best[i] = min(best[i], clock() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=400_000, help="approximate log length")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redis-events", type=int, default=100_000,
                        help="entries of the chained/unchained comparison (0 = skip)")
    parser.add_argument("--stream-above", type=int, default=2_000_000,
                        help="fold logs longer than this chunk by chunk, in one pass")
    parser.add_argument("--force", action="store_true", help="run even if memory looks short")
    args = parser.parse_args()
    if args.events > args.stream_above:
        check_memory(args.events, STATE_BYTES_PER_EVENT, "folded state", args.force)
        stream_point(args.events, args.seed)
        print("load average (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        return

    t0 = time.perf_counter()
    builder = random_run(args.seed, max(1, args.events // EVENTS_PER_STEP), **RUN_OPTIONS)
    entries = builder.encoded()
    n = len(entries)
    size_mb = sum(len(data) for _, data in entries) / 1e6
    print(f"log: {n} events, {size_mb:.1f} MB JSON (generated in {time.perf_counter() - t0:.1f}s)")

    decoder = msgspec.json.Decoder(AnyEvent)

    def raw_decode() -> None:
        decode = decoder.decode
        for _, data in entries:
            decode(data)

    def decode_and_fold() -> None:
        fold_raw(entries)

    events = [(pos, decoder.decode(data)) for pos, data in entries]

    def reduce_only() -> None:
        gc.disable()  # as fold_raw does
        try:
            state = initial_state()
            for pos, event in events:
                apply_event(state, event, pos)
        finally:
            gc.enable()

    def decode_kept() -> None:
        decode = decoder.decode
        gc.disable()  # as fold_raw does
        try:
            kept = [decode(data) for _, data in entries]
            del kept
        finally:
            gc.enable()

    t_raw, t_fold, t_reduce, t_kept = _best_interleaved(
        [raw_decode, decode_and_fold, reduce_only, decode_kept], args.repeat, time.process_time
    )

    rows = [
        ("(a) raw decode", t_raw),
        ("(b) decode + fold", t_fold),
        ("(c) reduce only", t_reduce),
        ("(d) decode, kept", t_kept),
    ]
    print(f"{'measure':<20} {'CPU s':>9} {'events/s':>12}")
    for name, secs in rows:
        print(f"{name:<20} {secs:>9.3f} {n / secs:>12,.0f}")
    ratio = t_raw / t_fold
    verdict = "met" if ratio >= FOLD_TARGET and n / t_fold >= 300_000 else "MISSED"
    print(f"ratio (b)/(a) throughput: {ratio:.2f}x   (targets: (b) >= 300,000/s, "
          f"ratio >= {FOLD_TARGET:.2f}: {verdict})")
    by_type(events, t_raw / n, t_reduce / n)
    if args.redis_events:
        chain_cost(builder, entries[: args.redis_events], args.repeat)
    print("load average (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


def by_type(events: list, decode_s_per_event: float, reduce_s_per_event: float) -> None:
    """Reduce-only time per event type, against what the 0.5x target leaves the reducer.

    decode + reduce <= decode / FOLD_TARGET means the reducer may take at most
    (1 / FOLD_TARGET - 1) x the decode time per event, on average over the log.
    Each call is timed alone by the wall clock (a CPU clock costs a system call, about
    as much as a handler); the clock's own cost, measured, is taken off, and the
    average is printed beside (c)'s, timed whole by CPU, as a check.
    """
    clock = time.perf_counter
    spent: dict[str, float] = {}
    count: dict[str, int] = {}
    gc.disable()
    try:
        state = initial_state()
        for pos, event in events:
            t0 = clock()
            apply_event(state, event, pos)
            name = type(event).__name__
            spent[name] = spent.get(name, 0.0) + clock() - t0
            count[name] = count.get(name, 0) + 1
        t0 = clock()
        for _ in events:
            clock()
        overhead = (clock() - t0) / len(events)
    finally:
        gc.enable()
    per = {name: max(spent[name] / count[name] - overhead, 0.0) for name in spent}
    total = sum(per[name] * count[name] for name in per)
    budget = (1 / FOLD_TARGET - 1) * decode_s_per_event
    print(f"reducer by event type (each call timed alone; {overhead * 1e6:.2f} us of clock "
          f"overhead taken off):")
    print(f"  {'event':<20} {'events':>9} {'share':>6} {'us/event':>9} {'share of time':>14}")
    for name in sorted(per, key=lambda k: -per[k] * count[k]):
        print(f"  {name:<20} {count[name]:>9} {count[name] / len(events):>6.1%} "
              f"{per[name] * 1e6:>9.2f} {per[name] * count[name] / total:>14.1%}")
    print(f"  reducer average {total / len(events) * 1e6:.2f} us/event ((c): "
          f"{reduce_s_per_event * 1e6:.2f}); the {FOLD_TARGET}x "
          f"target leaves it {budget * 1e6:.2f} us/event (decode here: "
          f"{decode_s_per_event * 1e6:.2f} us/event)")


def stream_point(events: int, seed: int) -> None:
    """(a) and (b) over a generated log of ~``events`` entries, chunk by chunk."""
    import resource

    decode = msgspec.json.Decoder(AnyEvent).decode
    clock = time.process_time  # this process's CPU: the machine may be shared
    state = initial_state()
    n = 0
    t_raw = t_fold = t_gen = 0.0
    start = time.perf_counter()
    chunks = stream_random_run(seed, max(1, events // EVENTS_PER_STEP), **RUN_OPTIONS)
    for chunk in _batched(chunks, 50_000):
        t0 = clock()
        entries = [(s.position, encode(s.event)) for s in chunk]
        del chunk
        t1 = clock()
        for _, data in entries:
            decode(data)
        t2 = clock()
        apply_raw(state, entries)
        t3 = clock()
        t_gen, t_raw, t_fold = t_gen + t1 - t0, t_raw + t2 - t1, t_fold + t3 - t2
        before, n = n, n + len(entries)
        if n // PROGRESS_EVERY > before // PROGRESS_EVERY:  # minutes of work: say where it is
            print(f"  ... {n:,} of ~{events:,} events after {time.perf_counter() - start:.0f}s",
                  file=sys.stderr, flush=True)
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"streamed log: {n} events in {time.perf_counter() - start:.0f}s "
          f"(encoding {t_gen:.0f}s); {len(state.groups)} groups folded; peak RSS {rss_gb:.1f} GB")
    print(f"{'measure':<20} {'CPU s':>9} {'events/s':>12}")
    print(f"{'(a) raw decode':<20} {t_raw:>9.1f} {n / t_raw:>12,.0f}")
    print(f"{'(b) decode + fold':<20} {t_fold:>9.1f} {n / t_fold:>12,.0f}")
    ratio = t_raw / t_fold
    verdict = "met" if ratio >= FOLD_TARGET else "MISSED"
    print(f"ratio (b)/(a) throughput: {ratio:.2f}x (target >= {FOLD_TARGET:.2f}: {verdict}); "
          f"fold of {n / 1e6:.1f}M events: {t_fold:.0f}s (a minute or less wanted)")


def _batched(chunks, size: int):
    """The simulation's per-round chunks regrouped into lists of at least ``size``."""
    batch: list = []
    for chunk in chunks:
        batch += chunk
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def chain_cost(builder, entries, repeat: int) -> None:
    """Projector.get over a chained vs an unchained copy of ``entries`` in a real redis-server."""
    import tempfile

    from events.chain import Chain
    from events.embedded import ensure_embedded_redis, stop_embedded_redis
    from events.redis_store import RedisEventStore, events_key, meta_key
    from controller.projector import Projector

    types = [type(s.event).__name__ for s in builder.events[: len(entries)]]
    ids = [s.event.event_id for s in builder.events[: len(entries)]]
    with tempfile.TemporaryDirectory(prefix="rlc-bench-fold-") as tmp:
        server = ensure_embedded_redis(Path(tmp), appendfsync="everysec")
        store = RedisEventStore(server.url)
        try:
            for run_id, chained in (("unchained", False), ("chained", True)):
                chain = Chain(run_id)
                hashes = chain.links(chain.genesis, 1, zip(types, ids, (d for _, d in entries)))
                client = store.client
                client.sadd("rlc:runs", run_id)
                client.hset(meta_key(run_id), "epoch", 99)
                for lo in range(0, len(entries), 5000):
                    pipe = client.pipeline(transaction=False)
                    for i in range(lo, min(lo + 5000, len(entries))):
                        fields = {"type": types[i], "id": ids[i], "data": entries[i][1]}
                        if chained:
                            fields["h"] = hashes[i]
                        pipe.xadd(events_key(run_id), fields, id=f"0-{i + 1}")
                    pipe.execute()
            t_plain, t_chain = _best_interleaved(
                [lambda: Projector(store).get("unchained"), lambda: Projector(store).get("chained")],
                repeat,
            )
        finally:
            store.close()
            stop_embedded_redis(Path(tmp))
    n = len(entries)
    print(f"Projector.get from redis, {n} events: unchained {n / t_plain:,.0f}/s, "
          f"chained {n / t_chain:,.0f}/s")
    ratio = t_plain / t_chain
    verdict = "met" if ratio >= 0.9 else "MISSED"
    print(f"hash chain's cost on the fold: chained/unchained {ratio:.2f}x (target >= 0.90: {verdict})")


if __name__ == "__main__":
    main()
