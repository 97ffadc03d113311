"""One episode's rows from a run's spill: the keyed read against the whole-run reload.

``replay --episode`` wants a few keys of one group. It used to reload every spilled row
of the run into an in-memory plane (``SpillDataPlane.reload(tidy=False)``) and read
them from there; it now reads them with ``SpillReader.get``, which opens only the puts
of the keys' group. This writes a spill of ``--groups`` groups (one put each, as a
generator writes them: ``--samples`` rows of jagged ids + logprobs, about ``--tokens``
tokens), then times both reads of one row, side by side in one run, alternating their
order over ``--rounds`` rounds (best of each), and prints the ratio. CPU seconds of this
process are printed next to wall time: on a shared machine they move less with the load.
Both reads must return the same tensors, or the bench stops.

    python bench/bench_spill_read.py --groups 400
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from workers.dataplane import MemoryDataPlane, SpillDataPlane, SpillReader  # noqa: E402

RUN = "bench"
FIELDS = ["input_ids", "prompt_len"]  # what replay --episode reads of a committed row


def write_spill(directory: Path, groups: int, samples: int, tokens: int) -> None:
    plane = SpillDataPlane(MemoryDataPlane(), directory)
    gen = torch.Generator().manual_seed(0)
    for g in range(groups):
        n = [tokens + i for i in range(samples)]
        plane.put(RUN, [f"{RUN}/g{g:06d}/a1/s{i}" for i in range(samples)], {
            "input_ids": [torch.randint(0, 50_000, (k,), generator=gen) for k in n],
            "logprobs": [torch.randn(k, generator=gen) for k in n],
            "prompt_len": [torch.tensor(16)] * samples,
        })
    plane.close()


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=400)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="bench-spill-"))
    try:
        write_spill(directory, args.groups, args.samples, args.tokens)
        key = f"{RUN}/g{args.groups // 2:06d}/a1/s{args.samples // 2}"

        def reload() -> list:
            plane = SpillDataPlane(MemoryDataPlane(), directory)
            plane.reload(RUN, tidy=False)
            return plane.get(RUN, [key], FIELDS)

        def keyed() -> list:
            return SpillReader(directory).get(RUN, [key], FIELDS)

        best: dict[str, tuple[float, float]] = {}
        reads = {"reload": reload, "keyed": keyed}
        for r in range(args.rounds):
            names = list(reads) if r % 2 == 0 else list(reversed(reads))
            rows = {}
            for name in names:
                wall, cpu, rows[name] = timed(reads[name])
                best[name] = min(best.get(name, (wall, cpu)), (wall, cpu))
            (a,), (b,) = rows["reload"], rows["keyed"]
            if not all(torch.equal(a[f], b[f]) for f in FIELDS):
                sys.exit("the keyed read and the reload returned different rows")
        print(f"{args.groups} groups x {args.samples} rows (~{args.tokens} tokens): one row read")
        for name, (wall, cpu) in best.items():
            print(f"  {name:<7} wall {wall * 1000:8.1f} ms   cpu {cpu * 1000:8.1f} ms")
        print(f"  reload / keyed: wall x{best['reload'][0] / best['keyed'][0]:.0f}, "
              f"cpu x{best['reload'][1] / best['keyed'][1]:.0f}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
