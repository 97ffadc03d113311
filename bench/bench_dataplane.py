"""Data plane put+get of one GRPO-shaped batch: TransferQueue vs in-memory vs ray.put/get.

The batch is 64 groups x 8 samples, each row in the ``workers.batch.ROW_FIELDS`` layout
with a 128-token prompt and a jagged completion so rows are up to 512 tokens. Each
plane runs the same put-then-get of all rows ``--repeats`` times in one process; the
median is reported, with ratios against ``ray.put``/``ray.get`` of the same row list
(the baseline TransferQueue should get close to: target >= 0.8x its throughput), and
against a hand-packed ``ray.put`` (one flat tensor per field plus offsets), the
fastest way to move the same rows through Ray's object store.

Second table: the whole crossing from generator to trainer -- put (one call per group),
get of the rows as one batch, collate into a padded ``TrainBatch`` -- through
TransferQueue, as the code does it now (TensorDict end to end: jagged TensorDict in and
out, ``TensorDict.to_padded_tensor``) and as it did before (``before_*`` below: every
row flattened to 1-D with a ``__shape__`` companion row, reshaped and cloned per row on
get, padded by a Python loop), side by side in one run. Target: now >= 0.9x before.

Third table (``--units-rounds N``): TransferQueue put+get with 2 storage units vs 1
(``dataplane.storage_units``), each started afresh, alternating, N rounds each; the
median of every round's median, and 1 unit's throughput as a ratio of 2 units'.

    python -m bench.bench_dataplane [--groups 64] [--samples 8] [--repeats 5] [--units-rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch

from tensordict import TensorDict

from workers.batch import ROW_FIELDS, collate
from workers.dataplane import MemoryDataPlane
from workers.dataplane.config import DataPlaneSection
from workers.dataplane.transferqueue import TransferQueueDataPlane


def make_batch(groups: int, samples: int, prompt: int, max_tokens: int):
    g = torch.Generator().manual_seed(0)
    keys, rows = [], []
    for gi in range(groups):
        for si in range(samples):
            comp = int(torch.randint(max_tokens // 2, max_tokens - prompt + 1, (1,), generator=g))
            t = prompt + comp
            mask = torch.zeros(t, dtype=torch.bool)
            mask[prompt:] = True
            rows.append(
                {
                    "input_ids": torch.randint(2, 50000, (t,), generator=g),
                    "loss_mask": mask,
                    "generator_logprobs": -torch.rand(t, generator=g) * mask,
                    "token_versions": torch.where(mask, 7, -1),
                    "reward": torch.rand((), generator=g),
                    "prompt_len": torch.tensor(prompt),
                    "completion_len": torch.tensor(comp),
                }
            )
            keys.append(f"bench/g{gi:04d}/a0/s{si}")
    return keys, rows


def payload_mb(rows) -> float:
    return sum(t.numel() * t.element_size() for r in rows for t in r.values()) / 2**20


def time_plane(plane, keys, rows, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        part = f"bench-{i}"
        t0 = time.perf_counter()
        plane.put(part, keys, rows)
        got = plane.get(part, keys)
        dt = time.perf_counter() - t0
        assert len(got) == len(rows) and torch.equal(got[-1]["input_ids"], rows[-1]["input_ids"])
        plane.clear(part)
        if i:  # the first round warms up connections and allocators
            times.append(dt)
    return statistics.median(times)


def time_ray(rows, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        ref = ray.put(rows)
        got = ray.get(ref)
        dt = time.perf_counter() - t0
        assert len(got) == len(rows)
        del ref, got
        if i:
            times.append(dt)
    return statistics.median(times)


def pack(rows) -> dict[str, torch.Tensor]:
    """Rows -> one flat tensor per field plus offsets (a hand-tuned ray.put payload)."""
    lengths = torch.tensor([r["input_ids"].shape[0] for r in rows])
    packed = {"offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])}
    for name in rows[0]:
        packed[name] = torch.cat([r[name].reshape(-1) for r in rows])
    return packed


def time_ray_packed(rows, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        ref = ray.put(pack(rows))
        flat = ray.get(ref)
        off = flat["offsets"].tolist()
        got = [flat["input_ids"][a:b] for a, b in zip(off, off[1:])]
        dt = time.perf_counter() - t0
        assert len(got) == len(rows)
        del ref, flat
        if i:
            times.append(dt)
    return statistics.median(times)


# -- the crossing before the TensorDict change (kept here as the baseline) -------------

_SHAPE = "__shape__/"


def before_encode(values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    shapes = torch.tensor([[v.dim(), *v.shape] for v in values], dtype=torch.int64)
    if values[0].dim() == 0:
        return torch.stack([v.detach().cpu() for v in values]), shapes
    flat = [v.detach().cpu().reshape(-1) for v in values]
    if len({f.shape[0] for f in flat}) == 1:
        return torch.stack(flat), shapes
    return torch.nested.as_nested_tensor(flat, layout=torch.jagged), shapes


def _before_rows(t: torch.Tensor) -> list[torch.Tensor]:
    if t.is_nested:
        return list(t.values().split(t.offsets().diff().tolist()))
    return list(t.unbind(0))


def before_decode(data: torch.Tensor, shapes: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for value, shape in zip(_before_rows(data), _before_rows(shapes)):
        dims = [int(x) for x in shape.tolist()][1:]
        out.append(value.reshape(dims).clone())
    return out


def before_collate(rows, advantages) -> dict[str, torch.Tensor]:
    t = max(int(r["input_ids"].shape[0]) for r in rows)
    b = len(rows)
    ids = torch.zeros(b, t, dtype=torch.int64)
    att = torch.zeros(b, t, dtype=torch.bool)
    mask = torch.zeros(b, t, dtype=torch.bool)
    lp = torch.zeros(b, t, dtype=torch.float32)
    for i, r in enumerate(rows):
        n = int(r["input_ids"].shape[0])
        ids[i, :n] = r["input_ids"]
        att[i, :n] = True
        mask[i, :n] = r["loss_mask"].to(torch.bool)
        lp[i, :n] = r["generator_logprobs"].to(torch.float32)
    return {"input_ids": ids, "attention_mask": att, "loss_mask": mask,
            "generator_logprobs": lp, "advantages": torch.tensor(advantages)}


def before_crossing(tq, part: str, groups, keys) -> dict[str, torch.Tensor]:
    for gkeys, grows in groups:
        batch = {}
        for name in grows[0]:
            batch[name], batch[_SHAPE + name] = before_encode([r[name] for r in grows])
        tq.kv_batch_put(keys=gkeys, partition_id=part,
                        fields=TensorDict(batch, batch_size=[len(gkeys)]))
    select = [x for f in ROW_FIELDS for x in (f, _SHAPE + f)]
    td = tq.kv_batch_get(keys=keys, partition_id=part, select_fields=select)
    rows = [{} for _ in keys]
    for name in ROW_FIELDS:
        for i, value in enumerate(before_decode(td[name], td[_SHAPE + name])):
            rows[i][name] = value
    return before_collate(rows, [0.0] * len(rows))


def now_crossing(plane, part: str, groups, keys):
    for gkeys, grows in groups:
        plane.put(part, gkeys, grows)
    return collate(plane.get_batch(part, keys, list(ROW_FIELDS)), [0.0] * len(keys))


def time_crossing(plane, keys, rows, samples: int, repeats: int) -> tuple[float, float]:
    """Median (before, now) seconds, the two paths alternating round by round (and which
    goes first, since the second one pays for the storage the first one just freed)."""
    groups = [(keys[i : i + samples], rows[i : i + samples]) for i in range(0, len(rows), samples)]
    times: dict[str, list[float]] = {"before": [], "now": []}
    for i in range(repeats + 1):
        for name in ("before", "now") if i % 2 else ("now", "before"):
            part = f"cross-{name}-{i}"
            t0 = time.perf_counter()
            if name == "before":
                got = before_crossing(plane._tq, part, groups, keys)["input_ids"]
            else:
                got = now_crossing(plane, part, groups, keys).input_ids
            dt = time.perf_counter() - t0
            n = rows[-1]["input_ids"].shape[0]
            assert torch.equal(got[-1, :n], rows[-1]["input_ids"])
            plane.clear(part)
            if i:
                times[name].append(dt)
    return statistics.median(times["before"]), statistics.median(times["now"])


def time_storage_units(keys, rows, repeats: int, rounds: int) -> dict[int, float]:
    """Median put+get seconds with 2 and with 1 storage units, alternating starts."""
    times: dict[int, list[float]] = {2: [], 1: []}
    for r in range(rounds):
        for units in (2, 1) if r % 2 == 0 else (1, 2):
            plane = TransferQueueDataPlane(DataPlaneSection(storage_units=units))
            try:
                times[units].append(time_plane(plane, keys, rows, repeats))
            finally:
                plane.close()
    return {units: statistics.median(t) for units, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--units-rounds", type=int, default=0,
                    help="also compare 2 vs 1 TransferQueue storage units, this many rounds each")
    args = ap.parse_args()

    keys, rows = make_batch(args.groups, args.samples, args.prompt_tokens, args.max_tokens)
    print(f"batch: {len(rows)} rows, {payload_mb(rows):.1f} MiB, median of {args.repeats}")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        tq_plane = TransferQueueDataPlane()
        try:
            results = {
                "ray.put/get": time_ray(rows, args.repeats),
                "ray packed": time_ray_packed(rows, args.repeats),
                "memory": time_plane(MemoryDataPlane(), keys, rows, args.repeats),
                "transferqueue": time_plane(tq_plane, keys, rows, args.repeats),
            }
            before, now = time_crossing(tq_plane, keys, rows, args.samples, args.repeats)
        finally:
            tq_plane.close()  # before the storage-unit comparison starts its own
        units = time_storage_units(keys, rows, args.repeats, args.units_rounds) if args.units_rounds else {}
    finally:
        ray.shutdown()
    base = results["ray.put/get"]
    print(f"{'plane':<16}{'put+get s':>12}{'MiB/s':>10}{'vs ray.put/get':>18}")
    for name, dt in results.items():
        print(f"{name:<16}{dt:>12.4f}{payload_mb(rows) / dt:>10.1f}{base / dt:>17.2f}x")
    print(f"\ngenerator -> trainer through TransferQueue (put per group, get, collate)")
    print(f"{'path':<28}{'seconds':>10}")
    print(f"{'before (rows + shape rows)':<28}{before:>10.4f}")
    print(f"{'now (TensorDict)':<28}{now:>10.4f}")
    print(f"now vs before: {before / now:.2f}x throughput (target >= 0.9x)")
    if units:
        print(f"\nTransferQueue storage units ({args.units_rounds} alternating starts each)")
        for n, dt in units.items():
            print(f"{n} unit(s){dt:>12.4f} s{payload_mb(rows) / dt:>10.1f} MiB/s")
        print(f"1 unit vs 2: {units[2] / units[1]:.2f}x throughput")


if __name__ == "__main__":
    main()
