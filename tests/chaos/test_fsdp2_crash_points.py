"""Crash points around a train step with the FSDP2 trainer (``train.backend = "fsdp2"``).

The same scenarios as ``test_crash_points`` for the points where the trainer's state
matters: the controller is killed right after ``StepBegun`` and ``begin_train_step``,
around ``MicrobatchTrained``, around ``StepFinished``, and around ``CheckpointSaved``
(a sharded DCP checkpoint). A ``--resume`` must abort the open step, reload the newest
checkpoint, re-train the logged steps exactly (digest checks against the log) and reach
N; then ``Chaos.check``: audit exits 0, no acknowledged step lost, every group
accounted for, ``replay --retrain --verify`` reproduces every digest, and the final
checkpoint's manifest digest is the last step's.

In-process workers: at dp 1 the trainer is one FSDP2 rank over a world-size-1 gloo
group; at dp 2 (``test_fsdp2_dp2_crash_then_resume``) it is a group of two Ray rank
actors over gloo, so a crash leaves a step open on both shards and the resumed run must
rebuild both, re-train the logged steps at dp 2 and still match every logged digest.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.harness import EXIT_CRASH, Chaos

pytestmark = [pytest.mark.chaos, pytest.mark.integration, pytest.mark.timeout(400)]

N = 4
FSDP2 = ["--set", "train.backend=fsdp2"]

CRASHES = {
    "after_step_begun": "after_step_begun:1",
    "after_begin_train_step": "after_begin_train_step:1",
    "before_microbatch_trained": "before_microbatch_trained:2",
    "after_microbatch_trained": "after_microbatch_trained:2",
    "before_step_finished": "before_step_finished:0",
    "after_step_finished": "after_step_finished:2",
    "before_checkpoint_saved": "before_checkpoint_saved:2",
    "after_checkpoint_saved": "after_checkpoint_saved:2",
}


#: one crash point on each side of the four events whose timing the trainer's state
#: depends on; each fires for certain in a run of N steps
DP2_CRASHES = {
    "after_step_begun": "after_step_begun:1",
    "after_microbatch_trained": "after_microbatch_trained:2",
    "after_step_finished": "after_step_finished:2",
    "after_checkpoint_saved": "after_checkpoint_saved:2",
}


@pytest.fixture
def fsdp2_chaos(chaos: Chaos) -> Chaos:
    chaos.extra = list(FSDP2)
    return chaos


@pytest.mark.parametrize("name", sorted(CRASHES))
def test_fsdp2_crash_then_resume(fsdp2_chaos: Chaos, name: str) -> None:
    fsdp2_chaos.run("r", steps=N, resume=False, crash=CRASHES[name], expect=EXIT_CRASH)
    fsdp2_chaos.run("r", steps=N, resume=True, expect=0)
    result = fsdp2_chaos.check("r", N)
    assert result["state"].config["train"]["backend"] == "fsdp2"
    ckpts = [c for c in result["state"].checkpoints if not c.rejected and not c.lost]
    assert ckpts and all((Path(c.uri) / ".metadata").is_file() for c in ckpts)  # DCP shards


@pytest.mark.parametrize("name", sorted(DP2_CRASHES))
def test_fsdp2_dp2_crash_then_resume(fsdp2_chaos: Chaos, name: str) -> None:
    fsdp2_chaos.extra += ["--set", "train.data_parallel=2"]
    fsdp2_chaos.run("r", steps=N, resume=False, crash=DP2_CRASHES[name], expect=EXIT_CRASH)
    fsdp2_chaos.run("r", steps=N, resume=True, expect=0)
    result = fsdp2_chaos.check("r", N)
    train = result["state"].config["train"]
    assert (train["backend"], train["data_parallel"]) == ("fsdp2", 2)
    ckpts = [c for c in result["state"].checkpoints if not c.rejected and not c.lost]
    assert ckpts and all(len(list(Path(c.uri).glob("*.distcp"))) == 2 for c in ckpts)  # 2 shards
