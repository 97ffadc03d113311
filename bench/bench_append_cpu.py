"""Client CPU of one append on a real redis-server: the old and the new path side by side.

An episode run appends ~5 pauses per append (2.5 appends and 13.6 events per group at
1024 generators); what the controller pays per append is thread CPU, not the fsync it
waits for. Measured here, alternating the variants slice by slice in one process (a
noisy neighbour lands on all of them), on a redis-server with ``appendfsync always``:

* **the append** (``RedisEventStore.append``: encode, chain, send, reply) with the
  pinned connection packing the command in one hiredis call (now) against redis-py's
  command layers (``send_command``: its packer wrapper, what the code before sent
  through) -- the same bytes on the wire;
* **the round trip alone** (the append script with ready arguments) both ways, and with
  the pauses' bytes as every log before the compact form wrote them (every field) against
  what is written now (``docs/segments.md``, "Fields that may be left out");
* **the hash chain** over those bytes, both forms.

    python bench/bench_append_cpu.py [--rounds 5] [--appends 200] [--pauses 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from events.chain import Chain  # noqa: E402
from events.codec import encode, full_form  # noqa: E402
from events.redis_store import RedisEventStore  # noqa: E402
from events.redis_store.connection import PinnedConnection, run_script  # noqa: E402
from events.redis_store.layout import APPEND, events_key, meta_key  # noqa: E402
from events.schema import EnvCall, EnvResult, EpisodeTurnsRecorded, Segment, SegmentFlush  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


class LayeredConnection(PinnedConnection):
    """The pinned connection as it sent before: through redis-py's ``send_command``."""

    def execute_command(self, *args: Any) -> Any:
        return self._call(lambda conn: (conn.send_command(*args), conn.read_response())[1])


def pause(group: int, turn: int, samples: int = 16) -> EpisodeTurnsRecorded:
    """One deduplicating env's pause of a 16-sample group, as the simulator makes them."""
    gid = f"g{group:06d}"
    seg = [Segment(sample=s, start=32 * turn, length=16, key=f"obs:{gid}/a1/s{s}/t{turn}", turn=turn)
           for s in range(samples)]
    model = [Segment(sample=s, start=32 * turn + 16, length=16, key=f"seg:{gid}/a1/s{s}/t{turn + 1}",
                     turn=turn + 1) for s in range(samples)]
    return EpisodeTurnsRecorded(
        event_id=f"group:{gid}:turns:a1:k{2 * turn}:e{turn}", epoch=1, ts=1_700_000_000.0 + turn,
        group_id=gid, attempt=1, segment_index=2 * turn, env_index=turn,
        results=[EnvResult(sample=s, turn=turn, reward=0.1 * (s % 2), ended=False,
                           observation_tokens=16) for s in range(samples)],
        flushes=[SegmentFlush(kind="observation", weight_version=None, segments=seg),
                 SegmentFlush(kind="model", weight_version=3, segments=model)],
        env="calculator", dedupes_by_key=True,
        calls=[EnvCall(sample=s, turn=turn + 1, request=f"{gid}/{s}/{turn + 1}") for s in range(samples)],
    )


def batches(count: int, per: int, tag: int) -> list[list[EpisodeTurnsRecorded]]:
    return [[pause(tag * 100_000 + i, k) for k in range(per)] for i in range(count)]


def cpu_per_call(calls: list[Callable[[], object]]) -> float:
    """Thread CPU (us) per call, over the calls in order."""
    start = time.thread_time()
    for call in calls:
        call()
    return 1e6 * (time.thread_time() - start) / len(calls)


def append_calls(store: RedisEventStore, run_id: str, count: int, per: int, tag: int) -> list[Callable[[], object]]:
    epoch = store.claim_epoch(run_id)
    return [lambda b=b, i=i: store.append(run_id, b, expected_position=i * per, epoch=epoch)
            for i, b in enumerate(batches(count, per, tag))]


def script_calls(conn: Any, run_id: str, epoch: int, groups: list[list[bytes]], ids: list[list[str]]
                 ) -> list[Callable[[], object]]:
    """The append script with ready arguments (chained from the genesis), one per batch."""
    chain, prev, calls = Chain(run_id), "", []
    keys = (events_key(run_id), meta_key(run_id))
    for i, (datas, names) in enumerate(zip(groups, ids)):
        entries = [("EpisodeTurnsRecorded", n, d) for n, d in zip(names, datas)]
        hashes = chain.links(prev or chain.genesis, i * len(entries) + 1, entries)
        args: list[Any] = [epoch, i * len(entries), len(entries), prev, chain.algorithm]
        for entry, link in zip(entries, hashes):
            args += (*entry, link)
        calls.append(lambda args=args: run_script(conn, APPEND, keys, args))
        prev = hashes[-1]
    return calls


def one_round(store: RedisEventStore, old: LayeredConnection, args: argparse.Namespace, r: int) -> dict[str, float]:
    n, per = args.appends, args.pauses
    out: dict[str, float] = {}
    # the whole append, old connection vs new (order alternates by round)
    variants = [("append, redis-py layers", old), ("append, packed", store._hot)]
    for name, conn in variants if r % 2 == 0 else variants[::-1]:
        hot, store._hot = store._hot, conn
        calls = append_calls(store, f"a-{name[8:11]}-{r}", n, per, r)
        out[name] = cpu_per_call(calls)
        store._hot = hot
    # the round trip alone and the chain: full form (before) vs compact (now), one batch set
    events = batches(n, per, 50 + r)
    ids = [[e.event_id for e in b] for b in events]
    forms = {"full": [[msgspec.json.encode(full_form(e)) for e in b] for b in events],
             "compact": [[encode(e) for e in b] for b in events]}
    for form, groups in forms.items():
        for name, conn in (("redis-py layers", old), ("packed", store._hot)):
            run_id = f"s-{form}-{name[:6]}-{r}"
            out[f"round trip, {name}, {form}"] = cpu_per_call(
                script_calls(conn, run_id, store.claim_epoch(run_id), groups, ids))
        chain = Chain("bench")
        out[f"chain, {form}"] = cpu_per_call([
            lambda g=g: chain.links(chain.genesis, 1, [("EpisodeTurnsRecorded", "x", d) for d in g])
            for g in groups])
        out[f"bytes per append, {form}"] = sum(map(len, groups[0])) / 1.0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--appends", type=int, default=200, help="appends per variant per round")
    p.add_argument("--pauses", type=int, default=5, help="episode pauses per append")
    p.add_argument("--appendfsync", default="always", choices=["always", "everysec", "no"])
    args = p.parse_args(argv)
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="rlc-bench-") as tmp, \
            RedisServer(Path(tmp), appendfsync=args.appendfsync) as server:
        store = RedisEventStore(server.url)
        old = LayeredConnection(store.client)
        try:
            one_round(store, old, argparse.Namespace(appends=20, pauses=args.pauses), 99)  # warm
            for r in range(args.rounds):
                rows.append(one_round(store, old, args, r))
                print(f"round {r}: " + "; ".join(f"{k} {v:.1f}" for k, v in rows[-1].items()
                                                  if not k.startswith("bytes")), flush=True)
        finally:
            old.close()
            store.close()
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    print(f"\nmedian over {args.rounds} rounds, us of client thread CPU per append of "
          f"{args.pauses} 16-sample pauses (appendfsync {args.appendfsync}):")
    for k, v in med.items():
        print(f"  {k:<40} {v:9.1f}")
    print(f"append: redis-py layers / packed = x{med['append, redis-py layers'] / med['append, packed']:.3f}")
    for form in ("full", "compact"):
        print(f"round trip ({form}): redis-py layers / packed = "
              f"x{med[f'round trip, redis-py layers, {form}'] / med[f'round trip, packed, {form}']:.3f}")
    print(f"round trip, packed: full / compact bytes = "
          f"x{med['round trip, packed, full'] / med['round trip, packed, compact']:.3f}; "
          f"chain: x{med['chain, full'] / med['chain, compact']:.3f}; bytes "
          f"{med['bytes per append, full']:.0f} -> {med['bytes per append, compact']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
