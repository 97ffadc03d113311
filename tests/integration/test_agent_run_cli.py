"""``rl-controller run --local-workers`` on an agent task: agent code written for the
OpenAI client (``tests.plugin_tasks:ReverseAgent``: a question, the model's tool call,
the tool's result sent back, a final reply) plays every episode against the
generators' own model, through the installed command.

The log audits clean, ``replay --retrain`` re-trains both steps to their recorded
digests from the retained rows, and every row the steps trained is, id for id, what
the agent's session held (its last reply's ``prompt_token_ids + token_ids``), with the
loss on the model's two replies only.

With ``rollout.partial.enabled = true`` the agent's turns are durable: the log holds
every completion's intent and the result the agent sent back, audits clean, and a tool
keyed by the replies' ``step_key`` (``tests.plugin_tasks:LedgerAgent``) ran each key once.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.integration.test_run_cli import ROOT, cli
from tests.plugin_tasks import AGENT_LOG_ENV, ReverseAgent

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN_ID = "agent-smoke"


def _runs_of_true(mask: list[bool]) -> int:
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


def test_an_openai_client_agent_drives_two_steps_and_the_rows_are_its_sessions(
    data_dir: Path, tmp_path: Path
):
    from controller.projector import Projector
    from events.embedded import ensure_embedded_redis
    from events.redis_store import RedisEventStore
    from workers.dataplane import MemoryDataPlane, SpillDataPlane

    sessions = tmp_path / "sessions.jsonl"
    env = {**os.environ, AGENT_LOG_ENV: str(sessions), "PYTHONPATH": str(ROOT)}
    run = cli("run", "--local-workers", "--steps", "2", "--run-id", RUN_ID, "--no-progress",
              "--data-dir", str(data_dir), "--set", f'task.name="{ReverseAgent.name}"',
              env=env, timeout_s=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"run {RUN_ID} finished: trainer_version 2" in run.stdout + run.stderr
    audit = cli("audit", "--run", RUN_ID, "--data-dir", str(data_dir))
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
    retrain = cli("replay", "--run", RUN_ID, "--retrain", "--verify", "--data-dir",
                  str(data_dir), timeout_s=600)
    assert retrain.returncode == 0, retrain.stdout[-2000:] + retrain.stderr[-2000:]
    assert "replayed 2 steps from trainer_version 0: all digests match" in retrain.stdout

    held = {tuple(json.loads(line)["ids"]) for line in sessions.open()}
    state = Projector(RedisEventStore(ensure_embedded_redis(data_dir).url)).get(RUN_ID).state
    spill = SpillDataPlane(MemoryDataPlane(), data_dir / "runs" / RUN_ID / "spill")
    spill.reload(RUN_ID)
    trained = 0
    for version in (1, 2):
        step = state.steps[state.version_steps[version]]
        keys = [k for g in step.group_ids for k in state.groups[g].payload_keys]
        for row in spill.get(RUN_ID, keys):
            assert tuple(row["input_ids"].tolist()) in held
            # the question, reply 1 (the call), the tool's result, reply 2
            assert _runs_of_true(row["loss_mask"].tolist()) == 2
            trained += 1
    assert trained == 2 * 16 * 16  # the run's groups_per_step x samples_per_group


def test_an_agent_runs_durably_with_partial_rollouts(data_dir: Path, tmp_path: Path):
    """The same command with ``rollout.partial.enabled = true`` (the preflight refused it
    before agent turns were recorded): every completion's intent and every result the
    agent sent back are in the log, the log audits clean, and the agent's tool, which
    writes a ledger line per ``step_key``, ran each key once."""
    from tests.plugin_tasks import LedgerAgent
    from workers.envs.ledger import read_ledger

    run_id, ledger = "agent-durable", tmp_path / "ledger.txt"
    run = cli("run", "--local-workers", "--steps", "2", "--run-id", run_id, "--no-progress",
              "--data-dir", str(data_dir), "--set", f'task.name="{LedgerAgent.name}"',
              "--set", f'task.options={{path="{ledger}", turns=3}}',
              "--set", "rollout.partial.enabled=true", "--set", "sampling.max_new_tokens=4",
              "--set", "train.groups_per_step=4", "--set", "rollout.samples_per_group=4",
              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout_s=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"run {run_id} finished: trainer_version 2" in run.stdout + run.stderr
    audit = cli("audit", "--run", run_id, "--data-dir", str(data_dir))
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
    keys = [k for k, _ in read_ledger(ledger)]
    assert keys and len(keys) == len(set(keys))
    # every committed episode's three turns are in the log, as the audit counts them
    counted = re.search(r"episodes: (\d+) committed in (\d+) groups, (\d+) turns \(at most 3 in one\)",
                        audit.stdout)
    assert counted, audit.stdout[-2000:]
    episodes, groups, turns = map(int, counted.groups())
    assert episodes == 4 * groups >= 4 * 8 and turns == 3 * episodes
    assert len(keys) >= turns  # and each of their tools ran (once)
