"""Fencing: a second controller claims the run; the first one stops without a side effect.

Two controllers on one run, each with its own real in-process workers whose handles
record every call. Controller B claims a new epoch at a chosen moment of A's work (in
the middle of a microbatch, while a generation is in flight, right after a step
finished). A must then fail with ``FencedError`` at its next append or epoch check and
make *no* further trainer, generator or data-plane call; B recovers the run and
finishes it, and the log holds no event of A's epoch after B's claim.
"""

from __future__ import annotations

import asyncio

import pytest

from controller.config import config_to_dict
from controller.startup import create_run, resume_run
from events.errors import FencedError
from events.redis_store import RedisEventStore
from controller.projector import Projector
from tests.integration.recovery_helpers import controller_for, reconcile, start_local, tiny_config

pytestmark = pytest.mark.integration

RUN = "fenced"


def _open(redis_url: str, cfg):
    store = RedisEventStore(redis_url)
    writer = create_run(
        store, RUN, config=config_to_dict(cfg),
        seed=cfg.run.seed, code_version="test", window_versions=cfg.staleness.window_versions,
        groups_per_step=cfg.train.groups_per_step, samples_per_group=cfg.rollout.samples_per_group,
    )
    return store, writer


@pytest.mark.parametrize("moment", ["train_microbatch", "generate", "step_finished"])
def test_zombie_controller_makes_no_side_effect(redis_url: str, tmp_path, moment: str) -> None:
    cfg = tiny_config(tmp_path, "run.steps=3")
    store_a, writer_a = _open(redis_url, cfg)
    run_a = start_local(cfg, RUN, tmp_path / "a")
    reconcile(run_a, writer_a)
    store_b = RedisEventStore(redis_url)
    claimed: dict = {}

    def claim() -> None:
        if "writer" not in claimed:
            claimed["writer"] = resume_run(store_b, RUN)  # B: new epoch, log repaired
            run_a.calls.phase = "after_claim"

    on_step = None
    if moment == "step_finished":
        def on_step(step, version, metrics):  # noqa: ANN001 - loop callback
            if version == 1:
                claim()
    else:
        # The hook runs when the call returns to A: the claim lands mid-flight.
        who, method = (
            ("trainer", moment) if moment == "train_microbatch" else ("generator-0", "generate_groups")
        )
        run_a.hooks[who][method] = claim
    controller_a = controller_for(run_a, writer_a, on_step=on_step)
    with pytest.raises(FencedError):
        asyncio.run(controller_a.run())
    assert "writer" in claimed, "the claim never happened"
    assert run_a.calls.during("after_claim") == [], run_a.calls.during("after_claim")
    run_a.workers.close()

    writer_b = claimed["writer"]
    run_b = start_local(cfg, RUN, tmp_path / "a")  # same run directory: the spill
    reconcile(run_b, writer_b)
    asyncio.run(controller_for(run_b, writer_b).run())
    run_b.workers.close()
    result = Projector(store_b).get(RUN)
    assert result.problem is None, result.problem
    assert result.state.trainer_version == 3
    claim_pos = next(e.position for e in result.state.epochs if e.epoch == writer_b.epoch)
    stale = [e for e in store_b.read(RUN, claim_pos) if e.event.epoch < writer_b.epoch]
    assert stale == [], stale
    store_a.close()
    store_b.close()


def test_fenced_writer_never_snapshots_or_appends_again(redis_url: str, tmp_path) -> None:
    cfg = tiny_config(tmp_path)
    store, writer_a = _open(redis_url, cfg)
    resume_run(RedisEventStore(redis_url), RUN)
    from events.schema import RunFinished

    with pytest.raises(FencedError):
        writer_a.append(writer_a.make(RunFinished, event_id="x", reason="zombie"))
    assert writer_a.fenced is not None
    with pytest.raises(FencedError):  # final: not even a store round trip
        writer_a.append(writer_a.make(RunFinished, event_id="y", reason="zombie"))
    store.close()
