"""Kill -9 with partial rollouts on: a crash resumes every group from its last flush.

Real controller processes (in-process workers, memory data plane + durable spill, a
real redis-server), ``segment_tokens = 2`` so every group flushes several times. Each
scenario crashes somewhere -- between a flush's rows and its event, right after the
event, a generator killed after a flush, the controller SIGKILLed at random moments --
then resumes to N steps. Besides everything ``Chaos.check`` proves (audit 0, every
group consumed once, ``replay --retrain --verify`` digests equal), the token ledger
that every generator writes (``RLC_TOKEN_LEDGER``) is compared with the log:

* **0 recorded tokens regenerated**: the attempt that committed a group sampled exactly
  its tokens that no earlier attempt had recorded;
* **the bound**: the tokens every failed attempt sampled but never recorded are at
  most ``segment_tokens`` per sample per failed attempt.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from events import schema as ev
from tests.chaos.harness import EXIT_CRASH, Chaos
from tests.chaos.test_random_kills import _run_exists

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.timeout(300)]

N = 4
SEGMENT_TOKENS = 2
SAMPLES = 4  # the harness's rollout.samples_per_group
PARTIAL = ["--set", "rollout.partial.enabled=true",
           "--set", f"rollout.partial.segment_tokens={SEGMENT_TOKENS}"]

#: name -> crash spec of the first run (the crash points are per group id)
PARTIAL_SCENARIOS = {
    "before_segments_recorded": "before_segments_recorded:g000001",
    "after_segments_recorded": "after_segments_recorded:g000002",
    "before_group_committed": "before_group_committed:g000003",
    "generator_lost_after_a_flush":
        "after_segments_recorded:g000001@generator-0,after_group_failed:g000001",
}


@pytest.fixture
def partial(chaos: Chaos, tmp_path: Path) -> Chaos:
    chaos.extra = PARTIAL
    chaos.env = {"RLC_TOKEN_LEDGER": str(tmp_path / "ledger.txt")}
    return chaos


def check_tokens(chaos: Chaos, run_id: str) -> dict[str, int]:
    """The two token rules of the module docstring; returns what was counted."""
    sampled: Counter[tuple[str, int]] = Counter()
    for line in Path(chaos.env["RLC_TOKEN_LEDGER"]).read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:  # a line cut by a kill -9 is not counted (it undercounts)
            sampled[(parts[0], int(parts[1]))] += int(parts[2])
    events = [e.event for e in _read(chaos, run_id)]
    recorded: Counter[tuple[str, int]] = Counter()
    for e in events:
        if isinstance(e, ev.SegmentsRecorded):
            recorded[(e.group_id, e.attempt)] += sum(s.length for s in e.segments)
    lost_total = flushes = resumed = 0
    for c in (e for e in events if isinstance(e, ev.GroupCommitted)):
        before = sum(n for (g, a), n in recorded.items() if g == c.group_id and a < c.attempt)
        resumed += before
        assert sampled[(c.group_id, c.attempt)] == sum(c.lengths) - before, (
            f"{c.group_id}: attempt {c.attempt} sampled {sampled[(c.group_id, c.attempt)]}, "
            f"committed {sum(c.lengths)} of which {before} were recorded earlier")
        for a in range(1, c.attempt):
            lost = sampled[(c.group_id, a)] - recorded[(c.group_id, a)]
            assert 0 <= lost <= SAMPLES * SEGMENT_TOKENS, (c.group_id, a, lost)
            lost_total += lost
        flushes += sum(1 for e in events if isinstance(e, ev.SegmentsRecorded) and e.group_id == c.group_id)
    assert flushes, "segment_tokens = 2 must flush"
    return {"lost": lost_total, "flushes": flushes, "resumed": resumed}


def _read(chaos: Chaos, run_id: str):
    from events.redis_store import RedisEventStore

    store = RedisEventStore(chaos.redis_url)
    try:
        return list(store.read(run_id))
    finally:
        store.close()


@pytest.mark.parametrize("name", sorted(PARTIAL_SCENARIOS))
def test_crash_resumes_from_the_last_flush(partial: Chaos, name: str) -> None:
    partial.run("r", steps=N, resume=False, crash=PARTIAL_SCENARIOS[name], expect=EXIT_CRASH)
    partial.run("r", steps=N, resume=True, expect=0)
    partial.check("r", N)
    counted = check_tokens(partial, "r")
    failed = [e for e in (x.event for x in _read(partial, "r")) if isinstance(e, ev.GroupFailed)]
    assert failed, "the crash must have cost an attempt"
    assert counted["lost"] <= len(failed) * SAMPLES * SEGMENT_TOKENS
    if name in ("after_segments_recorded", "generator_lost_after_a_flush"):
        assert counted["resumed"] > 0, "a group must have resumed from recorded tokens"


@pytest.mark.parametrize("seed", range(3))
def test_random_sigkills_with_partial_rollouts(partial: Chaos, seed: int) -> None:
    rng = random.Random(7000 + seed)
    resume = False
    for _ in range(2):
        partial.kill_after("r", steps=N, resume=resume, delay_s=rng.uniform(0.2, 2.5))
        resume = _run_exists(partial)
    partial.run("r", steps=N, resume=resume, expect=0)
    partial.check("r", N)
    check_tokens(partial, "r")
