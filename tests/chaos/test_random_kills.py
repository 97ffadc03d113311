"""Random SIGKILLs: of the controller process at a random moment, chains of random
crash points across restarts, and of redis-server itself (AOF, appendfsync always).

Seeds are fixed per scenario so a failure reproduces; ``scripts/soak.sh`` runs the
same scenarios with fresh seeds, many times.
"""

from __future__ import annotations

import random

import pytest

from controller.crashpoints import CRASH_POINTS
from tests.chaos.harness import EXIT_CRASH, Chaos, wait_for
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.timeout(300)]

N = 4
#: points a run reaches without help (no corrupt checkpoint, no lost payload, no dead worker)
NATURAL = [
    p for p in CRASH_POINTS
    if p not in {"after_checkpoint_rejected", "after_lost_payloads_evicted", "after_run_rewound",
                 "after_worker_lost", "after_group_failed", "after_group_evicted",
                 "after_step_aborted", "before_payloads_released", "after_payloads_released",
                 # partial rollouts only (tests.chaos.test_partial_crashes)
                 "before_segments_recorded", "after_segments_recorded",
                 # episodes only (tests.chaos.test_episode_crashes)
                 "after_env_steps_requested", "before_env_steps_completed",
                 "after_env_steps_completed", "after_episodes_restarted"}
]


def kill_and_resume(chaos: Chaos, seed: int, kills: int, steps: int = N) -> None:
    """Start; SIGKILL the controller at random moments ``kills`` times; finish; check."""
    rng = random.Random(seed)
    resume = False
    for _ in range(kills):
        chaos.kill_after("r", steps=steps, resume=resume, delay_s=rng.uniform(0.2, 2.5))
        resume = _run_exists(chaos)
    chaos.run("r", steps=steps, resume=resume, expect=0)
    chaos.check("r", steps)


def chained_crash_points(chaos: Chaos, seed: int, crashes: int, steps: int = N) -> None:
    """Each process dies at a random crash point (if it reaches it); then finish; check."""
    rng = random.Random(seed)
    resume = False
    for _ in range(crashes):
        point = rng.choice(NATURAL)
        rc = chaos.run("r", steps=steps, resume=resume, crash=point, expect=(0, EXIT_CRASH))
        resume = _run_exists(chaos)
        assert rc in (0, EXIT_CRASH)
    chaos.run("r", steps=steps, resume=resume, expect=0)
    chaos.check("r", steps)


def _run_exists(chaos: Chaos) -> bool:
    from events.redis_store import RedisEventStore

    store = RedisEventStore(chaos.redis_url)
    try:
        return store.run_exists("r") and store.last_position("r") > 0
    finally:
        store.close()


@pytest.mark.parametrize("seed", range(6))
def test_random_controller_sigkill(chaos: Chaos, seed: int) -> None:
    kill_and_resume(chaos, seed, kills=2)


@pytest.mark.parametrize("seed", range(4))
def test_chained_crash_points(chaos: Chaos, seed: int) -> None:
    chained_crash_points(chaos, 1000 + seed, crashes=3)


@pytest.fixture
def own_redis(redis_server: RedisServer) -> RedisServer:
    return redis_server


@pytest.mark.parametrize("seed", range(2))
def test_redis_sigkill(forkserver, own_redis: RedisServer, tmp_path, seed: int) -> None:
    """kill -9 redis-server mid-run, restart it on the same AOF: nothing acknowledged is lost."""
    chaos = Chaos(forkserver, own_redis.url, tmp_path)
    rng = random.Random(seed)
    proc = chaos.start("r", steps=6, resume=False)
    assert wait_for(lambda: _run_exists(chaos), timeout_s=60)
    wait_for(lambda: False, timeout_s=rng.uniform(0.3, 1.5))
    own_redis.kill()
    wait_for(lambda: False, timeout_s=rng.uniform(0.0, 1.0))
    own_redis.start()
    chaos.finish(proc)  # the controller either rode it out (retries) or stopped
    chaos.run("r", steps=6, resume=True, expect=0)
    chaos.check("r", 6)
