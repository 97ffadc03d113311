"""Recovery in-process: workers dying mid-run, digest checks, the trainer kept when it
matches the log. Real redis-server, real worker objects (memory data plane + spill).
The process-level versions (kill -9 of the controller at every crash point, corrupt
checkpoints, lost payloads and rewinds) are in ``tests/chaos``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from controller import crashpoints
from controller.config import config_to_dict
from controller.journal import Journal
from controller.recovery import DigestMismatchError, bring_trainer_to_log
from controller.startup import create_run, resume_run
from events.redis_store import RedisEventStore
from controller.projector import Projector
from replay.retrain import run_retrain
from tests.integration.recovery_helpers import controller_for, reconcile, start_local, tiny_config
from workers.dataplane import MemoryDataPlane, SpillDataPlane

pytestmark = pytest.mark.integration

RUN = "rec"


def _new_run(redis_url: str, cfg):
    store = RedisEventStore(redis_url)
    return store, create_run(
        store, RUN, config=config_to_dict(cfg), seed=cfg.run.seed, code_version="test",
        window_versions=cfg.staleness.window_versions, groups_per_step=cfg.train.groups_per_step,
        samples_per_group=cfg.rollout.samples_per_group,
    )


def _train(cfg, writer, run_dir: Path, **kw):
    run = start_local(cfg, RUN, run_dir)
    reconcile(run, writer)
    asyncio.run(controller_for(run, writer, **kw).run())
    return run


@pytest.fixture
def disarm():
    yield
    crashpoints.rearm("")


def test_workers_die_mid_run_and_the_run_continues(redis_url: str, tmp_path, disarm) -> None:
    """Trainer dies mid-step, a generator mid-generation: WorkerLost, restart, reconcile."""
    cfg = tiny_config(tmp_path, "run.steps=4")
    store, writer = _new_run(redis_url, cfg)
    crashpoints.rearm("after_microbatch_trained:2@trainer,after_rollout_admitted:g000006@generator-0")
    said: list[str] = []
    run = _train(cfg, writer, tmp_path, on_trainer_replaced=said.append)
    run.workers.close()
    result = Projector(store).get(RUN)
    assert result.problem is None, result.problem
    state = result.state
    assert state.trainer_version == 4
    assert sorted((w.role, w.worker) for w in state.workers_lost) == [
        ("generator", "generator-0"), ("trainer", "trainer")
    ]
    aborted = [s for s in state.steps.values() if s.abort_reason]
    assert len(aborted) == 1 and aborted[0].abort_reason.startswith("trainer lost: ")
    # the console's one line for it (under Ray the only line was Ray's, which guesses
    # at an OOM kill): the cause, the version rebuilt, the step aborted
    (lost,) = [w for w in state.workers_lost if w.role == "trainer"]
    assert said == [
        f"trainer lost ({lost.reason.splitlines()[0]}): replaced, its weights rebuilt from "
        f"the log to trainer_version 2; step {aborted[0].step} aborted, its groups back in "
        "the buffer"
    ], said
    assert state.groups["g000006"].attempt == 2  # failed with its generator, re-admitted
    # the restarted trainer was rebuilt from the log: a replay of the log agrees
    report = run_retrain(state, tmp_path, from_version=None, stop_on_mismatch=True)
    assert report.ok and report.final_digest == state.steps[state.version_steps[4]].weights_digest
    store.close()


def test_trainer_that_matches_the_log_is_kept(redis_url: str, tmp_path) -> None:
    cfg = tiny_config(tmp_path, "run.steps=3")
    store, writer = _new_run(redis_url, cfg)
    run = _train(cfg, writer, tmp_path)
    writer2 = resume_run(RedisEventStore(redis_url), RUN)
    run.calls.phase = "reconcile"
    asyncio.run(bring_trainer_to_log(Journal(writer2), run.workers.trainer, run.workers.payloads))
    assert run.calls.during("reconcile") == [("trainer", "version_and_digest")]
    run.workers.close()
    store.close()


def test_digest_mismatch_stops_recovery(redis_url: str, tmp_path) -> None:
    """A payload that no longer reproduces its step: a clear error, never a continued run."""
    cfg = tiny_config(tmp_path, "run.steps=3")
    store, writer = _new_run(redis_url, cfg)
    _train(cfg, writer, tmp_path).workers.close()
    state = Projector(store).get(RUN).state
    step = state.steps[state.version_steps[3]]  # after checkpoint v2: re-trained on resume
    # a group with a learning signal (zero-variance groups have zero advantages)
    gid = max(step.group_ids, key=lambda g: torch.tensor(state.groups[g].rewards).var().item())
    assert torch.tensor(state.groups[gid].rewards).var().item() > 0
    key = state.groups[gid].payload_keys[0]
    # tamper with the spilled row: a later put of the key replaces its fields on reload
    spill = SpillDataPlane(MemoryDataPlane(), tmp_path / "spill")
    spill.reload(RUN)
    row = spill.get(RUN, [key])[0]
    mask = row["loss_mask"]
    row["input_ids"] = torch.where(mask, (row["input_ids"] + 1) % 8, row["input_ids"])
    spill.put(RUN, [key], [{"input_ids": row["input_ids"]}])

    writer2 = resume_run(RedisEventStore(redis_url), RUN)
    before = writer2.position
    run = start_local(cfg, RUN, tmp_path)
    with pytest.raises(DigestMismatchError, match=f"step {step.step}"):
        reconcile(run, writer2)
    run.workers.close()
    assert writer2.position == before, "nothing is appended after a mismatch"
    store.close()
