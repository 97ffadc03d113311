"""Kill -9 during durable episodes: no side effect twice, no recorded turn sampled again.

Real controller processes (in-process workers, memory data plane + durable spill, a
real redis-server) run the ``ledger`` task: 3-turn episodes whose every env call
appends a line to a ledger file of the tool's own (the side effect, keyed by the call's
idempotency key). Processes die in every way an episode can be interrupted:

* the controller (the whole process) at a random moment -- mid-turn, mid-call, anywhere;
* the controller at the crash points around the episode's records (model turn recorded;
  intent recorded, calls not made; calls made, results not recorded; results recorded);
* a generator, right after a record (its groups are re-admitted to another incarnation);
* the environment mid-call: right after its side effect, before the result is recorded
  (``RLC_LEDGER_KILL_AT``).

Besides everything ``Chaos.check`` proves (audit 0, every group consumed once, the
weights retrained from the log match), the two ledgers are compared with the log:

* **0 side effects executed twice**: no key appears twice in the tool's ledger;
* **0 recorded turns regenerated**: no attempt sampled a model turn (group, sample,
  restart, turn) that an earlier attempt had recorded (the generators' token ledger,
  ``RLC_TOKEN_LEDGER``).
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path

import pytest

from events import schema as ev
from tests.chaos.harness import EXIT_CRASH, Chaos
from tests.chaos.test_random_kills import _run_exists
from workers.envs.ledger import KILL_ENV, read_ledger

TURNS = 3
#: kills per run of the random test: a few in CI (each costs a process start);
#: ``bench/chaos_episodes.py`` runs it with 50+
KILLS = int(os.environ.get("RLC_EPISODE_KILLS", "6"))

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.timeout(max(900, 30 * KILLS))]

#: the crash points around an episode's records, each a turn boundary or mid-turn
POINTS = ("after_segments_recorded", "after_env_steps_requested", "before_env_steps_completed",
          "after_env_steps_completed", "after_group_committed")


@pytest.fixture
def ledger(chaos: Chaos, tmp_path: Path) -> Chaos:
    chaos.extra = ["--set", "task.name=\"ledger\"", "--set", "rollout.partial.enabled=true",
                   "--set", "rollout.num_generators=2",
                   "--set", "sampling.max_new_tokens=4",
                   "--set", f"task.options={{path=\"{tmp_path / 'ledger.txt'}\", turns={TURNS}}}"]
    chaos.env = {"RLC_TOKEN_LEDGER": str(tmp_path / "tokens.txt")}
    return chaos


def _events(chaos: Chaos, run_id: str = "r") -> list[ev.Event]:
    """The run's log as readers see it: a pause as the events it stands for."""
    from controller.core.turns import expanded
    from events.redis_store import RedisEventStore

    store = RedisEventStore(chaos.redis_url)
    try:
        return list(expanded(e.event for e in store.read(run_id)))
    finally:
        store.close()


def check_exactly_once(chaos: Chaos, tmp_path: Path) -> dict[str, int]:
    """The module docstring's two rules; returns what was counted."""
    calls = Counter(key for key, _ in read_ledger(tmp_path / "ledger.txt"))
    twice = {k: n for k, n in calls.items() if n > 1}
    assert not twice, f"side effects executed more than once: {twice}"
    events = _events(chaos)
    restarts: dict[tuple[str, int], list[int]] = {}  # (group, sample) -> attempts after which it restarted
    for e in events:
        if isinstance(e, ev.EpisodesRestarted):
            for s in e.samples:
                restarts.setdefault((e.group_id, s), []).append(e.attempt)
    recorded: dict[tuple[str, str, int], int] = {}  # (group, sample.restart, turn) -> attempt
    for e in events:
        if isinstance(e, ev.SegmentsRecorded) and e.kind == "model":
            for seg in e.segments:
                again = sum(a < e.attempt for a in restarts.get((e.group_id, seg.sample), []))
                recorded.setdefault((e.group_id, f"{seg.sample}.{again}", seg.turn), e.attempt)
    sampled = 0
    for line in Path(chaos.env["RLC_TOKEN_LEDGER"]).read_text().splitlines():
        parts = line.split()
        if len(parts) != 6 or parts[0] != "E":
            continue  # a line cut by a kill
        group, attempt, sample, turn = parts[1], int(parts[2]), parts[3], int(parts[4])
        sampled += 1
        first = recorded.get((group, sample, turn))
        assert first is None or attempt <= first, (
            f"{group} sample {sample} turn {turn}: recorded by attempt {first}, sampled again "
            f"by attempt {attempt}")
    reissued = 0
    asked: dict[tuple[str, int, int, int], int] = {}
    for e in events:
        if isinstance(e, ev.EnvStepsRequested):
            for c in e.calls:
                key = (e.group_id, c.sample, c.restart, c.turn)
                reissued += key in asked
                asked.setdefault(key, e.attempt)
    committed = {e.group_id: e.attempt for e in events if isinstance(e, ev.GroupCommitted)}
    served = sum(committed.get(g, 0) > a for (g, _, _), a in recorded.items())
    return {"calls": sum(calls.values()), "reissued": reissued, "sampled": sampled,
            "served": served, "restarts": sum(len(v) for v in restarts.values())}


def _upcoming(chaos: Chaos, rng: random.Random) -> str:
    """A group the next process will run: one in flight, or one of the next new ones."""
    state = chaos.fold("r").state if _run_exists(chaos) else None
    if state is None:
        return f"g{rng.randrange(0, 3):06d}"
    live = list(state.admitted) + [g.group_id for g in state.failed_groups()]
    fresh = [f"g{len(state.groups) + k:06d}" for k in range(2)]
    return rng.choice(live + fresh)


def _one_kill(chaos: Chaos, rng: random.Random, steps: int, resume: bool) -> int:
    """One process that dies (if it gets there) in a randomly chosen way; returns 1 if
    it was killed (a generator it killed shows in the log as WorkerLost)."""
    kind = rng.choice(["sigkill", "point", "point", "generator", "env"])
    chaos.env.pop(KILL_ENV, None)
    if kind == "sigkill":
        return int(chaos.kill_after("r", steps=steps, resume=resume, delay_s=rng.uniform(0.5, 4.0))
                   == EXIT_CRASH)
    gid = _upcoming(chaos, rng)
    if kind == "env":
        chaos.env[KILL_ENV] = ",".join(f"r/{gid}/s{s}/t{rng.randint(1, TURNS)}" for s in range(4))
        crash = ""
    elif kind == "generator":  # a generator dies after a record; the controller replaces
        # it and goes on, or dies too once the group's attempt is failed
        crash = f"{rng.choice(POINTS[:4])}:{gid}@generator-{rng.randint(0, 1)}"
        crash += f",after_group_failed:{gid}" if rng.random() < 0.5 else ""
    else:
        crash = f"{rng.choice(POINTS)}:{gid}"
    rc = chaos.run("r", steps=steps, resume=resume, crash=crash, expect=(0, EXIT_CRASH))
    return int(rc == EXIT_CRASH)


def random_kills(chaos: Chaos, tmp_path: Path, seed: int, kills: int) -> dict[str, int]:
    """``kills`` random kills (processes and generators) of run ``r``, three steps on
    per life; then one clean resume to the end, checked; the exactly-once counts."""
    rng = random.Random(seed)
    processes, generators, resume = 0, 0, False
    while processes + generators < kills:
        done = chaos.fold("r").state.trainer_version if resume else 0
        processes += _one_kill(chaos, rng, steps=done + 3, resume=resume)
        resume = _run_exists(chaos)
        generators = sum(f.read_text().count(": killing generator-") for f in tmp_path.glob("[0-9]*-*.txt"))
    final = chaos.fold("r").state.trainer_version + 1
    chaos.env.pop(KILL_ENV, None)  # the last kill may have armed the env or tool: disarm it
    chaos.run("r", steps=final, resume=True, expect=0)
    chaos.check("r", final)
    counted = check_exactly_once(chaos, tmp_path)
    print(f"kills: {processes} processes, {generators} generators; {counted}")
    return counted


def test_random_kills_repeat_no_side_effect_and_regenerate_no_turn(ledger: Chaos, tmp_path: Path) -> None:
    counted = random_kills(ledger, tmp_path, int(os.environ.get("RLC_EPISODE_SEED", "31")), KILLS)
    assert counted["reissued"] > 0, "some calls must have been re-issued after a kill"
    assert counted["served"] > 0, "some recorded turns must have been served to a resumed attempt"


@pytest.mark.parametrize("point", ["before_env_steps_completed", "after_env_steps_requested"])
def test_an_env_that_cannot_dedupe_restarts_the_episode_instead(ledger: Chaos, tmp_path: Path, point: str) -> None:
    ledger.extra = [a.replace("turns=3}", "turns=3, dedupe=false}") for a in ledger.extra]
    ledger.run("r", steps=2, resume=False, crash=f"{point}:g000001", expect=EXIT_CRASH)
    ledger.run("r", steps=2, resume=True, expect=0)
    ledger.check("r", 2)
    counted = check_exactly_once(ledger, tmp_path)
    assert counted["restarts"] > 0 and counted["reissued"] == 0
    (restart,) = [e for e in _events(ledger) if isinstance(e, ev.EpisodesRestarted)]
    assert restart.group_id == "g000001" and "cannot deduplicate" in restart.reason


def test_a_crash_right_after_an_episode_restart_is_recorded_restarts_it_once(
        ledger: Chaos, tmp_path: Path) -> None:
    """The restart is a fact in the log: a crash just after it must not restart the
    episode again, nor run its unrecorded call."""
    ledger.extra = [a.replace("turns=3}", "turns=3, dedupe=false}") for a in ledger.extra]
    ledger.run("r", steps=2, resume=False, crash="before_env_steps_completed:g000001",
               expect=EXIT_CRASH)
    ledger.run("r", steps=2, resume=True, crash="after_episodes_restarted:g000001",
               expect=EXIT_CRASH)
    ledger.run("r", steps=2, resume=True, expect=0)
    ledger.check("r", 2)
    counted = check_exactly_once(ledger, tmp_path)
    assert counted["reissued"] == 0
    restarts = [e for e in _events(ledger) if isinstance(e, ev.EpisodesRestarted)]
    assert [e.group_id for e in restarts] == ["g000001"], restarts


#: the crash points in the middle of a turn (the random test also draws the others): the
#: intent recorded, calls not made (after_segments_recorded is the same append); calls
#: made, results not recorded; results recorded, next turn not begun
MID_TURN = ("after_env_steps_requested", "before_env_steps_completed", "after_env_steps_completed")


@pytest.mark.parametrize("point", MID_TURN)
def test_a_crash_at_an_episode_record_resumes_it_from_the_log(ledger: Chaos, tmp_path: Path, point: str) -> None:
    ledger.run("r", steps=2, resume=False, crash=f"{point}:g000001", expect=EXIT_CRASH)
    ledger.run("r", steps=2, resume=True, expect=0)
    ledger.check("r", 2)
    counted = check_exactly_once(ledger, tmp_path)
    assert counted["served"] > 0  # turn 1 of g000001 at least
    check_replay_episode(ledger, "g000001", 1)


def check_replay_episode(chaos: Chaos, group: str, sample: int) -> None:
    """``replay --episode`` shows every turn: the model's ids, the call, its reward; the
    ids are the committed row's, cut where the log recorded each turn."""
    rc, out = chaos.cli("replay", "--run", "r", "--episode", f"{group}/{sample}", "--json")
    assert rc == 0, out
    view = json.loads(out[out.index("{"):])
    turns = view["turns"]
    assert [t["turn"] for t in turns] == list(range(1, TURNS + 1))
    ids: list[int] = []
    for t in turns:
        kinds = [p["kind"] for p in t["pieces"]]
        assert kinds[0] == "model" and t["request"] and t["reward"] is not None, t
        ids += [i for p in t["pieces"] for i in p["ids"]]
    assert turns[-1]["ended"] and turns[-1]["end_reason"] == "done"
    assert sum(t["reward"] for t in turns) == view["reward"]  # the core checks it at the commit
    assert len(ids) == sum(p["length"] for t in turns for p in t["pieces"])
    rc, out = chaos.cli("replay", "--run", "r", "--episode", f"{group}/{sample}")
    assert rc == 0 and out.count(" env call ") == TURNS, out
    for bad, why in ((f"{group}", "expected GROUP/SAMPLE"), ("g999999/0", "never admitted"),
                     (f"{group}/9", "has samples 0..3")):
        rc, out = chaos.cli("replay", "--run", "r", "--episode", bad)
        assert rc == 2 and why in out and "Traceback" not in out, out
