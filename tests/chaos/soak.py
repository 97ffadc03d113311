"""The soak behind ``scripts/soak.sh``: random chaos scenarios, counted and checked.

Not collected by pytest (no ``test_`` prefix); the CI suite runs fixed seeds of the
same scenario kinds (``test_random_kills``, ``test_crash_points``).
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

from tests.chaos.harness import EXIT_CRASH, Chaos, ForkServer
from tests.chaos.test_random_kills import NATURAL, chained_crash_points, kill_and_resume
from tests.redis_server import RedisServer


def worker_death(chaos: Chaos, rng: random.Random, steps: int) -> None:
    role = rng.choice(["trainer", "generator-0"])
    point = rng.choice(["after_microbatch_trained:1", "after_step_finished:1",
                        "after_rollout_admitted:g000004", "after_weights_published:2"])
    then = rng.choice(NATURAL + ["after_worker_lost"])
    chaos.run("r", steps=steps, resume=False, crash=f"{point}@{role},{then}", expect=(0, EXIT_CRASH))
    chaos.run("r", steps=steps, resume=True, expect=0)
    chaos.check("r", steps)


KINDS = {
    "sigkill": lambda c, rng, n: kill_and_resume(c, rng.randrange(1 << 30), kills=rng.randint(1, 3), steps=n),
    "chain": lambda c, rng, n: chained_crash_points(c, rng.randrange(1 << 30), crashes=rng.randint(1, 4), steps=n),
    "worker": worker_death,
}


def main(scenarios: int, seed: int) -> int:
    root = Path(os.environ.get("SOAK_DIR") or "/tmp/rlc-soak")
    redis = RedisServer(root / "redis").start()
    server = ForkServer()
    counts: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    started = time.monotonic()
    try:
        for i in range(scenarios):
            rng = random.Random(seed + i)
            kind = rng.choice(sorted(KINDS))
            steps = rng.choice([3, 4, 5])
            redis.command("FLUSHALL")
            where = root / f"s{i:04d}-{kind}"
            t0 = time.monotonic()
            try:
                KINDS[kind](Chaos(server, redis.url, where), rng, steps)
                counts[kind] += 1
                shutil.rmtree(where, ignore_errors=True)
                status = "ok"
            except Exception:
                failures[kind] += 1
                status = "FAILED"
                (root / f"s{i:04d}-failure.txt").write_text(traceback.format_exc())
            print(f"scenario {i:4d} seed {seed + i} {kind:<8} steps {steps} "
                  f"{status} ({time.monotonic() - t0:.1f}s)", flush=True)
    finally:
        server.close()
        redis.stop()
    total = sum(counts.values()) + sum(failures.values())
    print(f"\n{total} scenarios in {time.monotonic() - started:.0f}s: "
          f"{sum(counts.values())} ok ({dict(counts)}), {sum(failures.values())} failed "
          f"({dict(failures)}); seeds {seed}..{seed + scenarios - 1}; artefacts in {root}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
