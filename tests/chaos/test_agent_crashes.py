"""Kill -9 during durable agent episodes: no tool effect twice, no recorded turn sampled again.

``tests/chaos/test_episode_crashes.py`` with the episodes played by agent code written
for the OpenAI client (``tests.plugin_tasks:LedgerAgent``) instead of an environment:
3 completions per episode, after each of which the agent's tool appends a line to a
ledger file keyed by the completion's ``step_key`` (its memory of keys, too: the agent
declares ``dedupes_by_key``). Processes die the same ways: the controller at a random
moment and at the crash points around every pause (a completion and its intent
recorded; the tool run, its result -- the agent's next request -- not recorded; the
result recorded), a generator after a record, and the agent's tool mid-call, right
after its side effect (``RLC_LEDGER_KILL_AT``). Each resumed attempt runs the agent
again from the start against the log.

The checks are that test's: ``Chaos.check`` (audit 0, every group consumed once, the
weights retrained from the log equal), **0 side effects executed twice** (no key twice
in the tool's ledger) and **0 recorded turns regenerated** (the generators' token
ledger against the log).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from events import schema as ev
from tests.chaos.harness import EXIT_CRASH, REPO, Chaos
from tests.chaos.test_episode_crashes import (
    MID_TURN,
    TURNS,
    _events,
    check_exactly_once,
    check_replay_episode,
    random_kills,
)
from tests.plugin_tasks import LedgerAgent
from workers.envs.ledger import KILL_ENV

#: kills per run of the random test (each costs a process start); ``python
#: bench/chaos_episodes.py --agent`` runs it with 50+
KILLS = int(os.environ.get("RLC_AGENT_KILLS", "6"))

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.timeout(max(900, 30 * KILLS))]


@pytest.fixture
def agent(chaos: Chaos, tmp_path: Path) -> Chaos:
    chaos.extra = ["--set", f'task.name="{LedgerAgent.name}"', "--set", "rollout.partial.enabled=true",
                   "--set", "rollout.num_generators=2",
                   "--set", "sampling.max_new_tokens=4",
                   "--set", f"task.options={{path=\"{tmp_path / 'ledger.txt'}\", turns={TURNS}}}"]
    chaos.env = {"RLC_TOKEN_LEDGER": str(tmp_path / "tokens.txt"), "PYTHONPATH": str(REPO)}
    return chaos


def test_random_kills_repeat_no_tool_effect_and_regenerate_no_completion(agent: Chaos, tmp_path: Path) -> None:
    counted = random_kills(agent, tmp_path, int(os.environ.get("RLC_AGENT_SEED", "31")), KILLS)
    assert counted["served"] > 0, "some recorded turns must have been served to a resumed attempt"


@pytest.mark.parametrize("point", MID_TURN)
def test_a_crash_at_an_agent_turns_record_resumes_it_from_the_log(agent: Chaos, tmp_path: Path, point: str) -> None:
    agent.run("r", steps=2, resume=False, crash=f"{point}:g000001", expect=EXIT_CRASH)
    agent.run("r", steps=2, resume=True, expect=0)
    agent.check("r", 2)
    counted = check_exactly_once(agent, tmp_path)
    assert counted["served"] > 0  # turn 1 of g000001 at least
    check_replay_episode(agent, "g000001", 1)


def test_the_agents_tool_killed_after_its_effect_is_answered_from_its_ledger(agent: Chaos, tmp_path: Path) -> None:
    agent.env[KILL_ENV] = "r/g000001/s0/t2"
    agent.run("r", steps=2, resume=False, expect=EXIT_CRASH)
    agent.env.pop(KILL_ENV)
    agent.run("r", steps=2, resume=True, expect=0)
    agent.check("r", 2)
    counted = check_exactly_once(agent, tmp_path)
    assert counted["reissued"] > 0 and counted["served"] > 0


@pytest.mark.parametrize("point", ["before_env_steps_completed", "after_env_steps_requested"])
def test_an_agent_that_cannot_dedupe_restarts_the_episode_instead(agent: Chaos, tmp_path: Path, point: str) -> None:
    agent.extra = [a.replace(f"turns={TURNS}}}", f"turns={TURNS}, dedupe=false}}") for a in agent.extra]
    agent.run("r", steps=2, resume=False, crash=f"{point}:g000001", expect=EXIT_CRASH)
    agent.run("r", steps=2, resume=True, expect=0)
    agent.check("r", 2)
    counted = check_exactly_once(agent, tmp_path)
    assert counted["restarts"] > 0 and counted["reissued"] == 0
    (restart,) = [e for e in _events(agent) if isinstance(e, ev.EpisodesRestarted)]
    assert restart.group_id == "g000001" and "cannot deduplicate" in restart.reason
