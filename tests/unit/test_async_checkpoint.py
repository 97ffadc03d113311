"""Checkpoints written behind training: same content as in line, a consistent snapshot,
and a log where CheckpointSaved (and the release it allows) follows the durable write."""

from __future__ import annotations

import pytest

from events import schema as ev
from tests.trainer_helpers import ADAMW, FACTORY
from tests.unit.test_loop_inprocess import Harness, make_config
from tests.unit.test_trainer_checkpoint import split_step, trained
from workers.trainer import TorchTrainer
from workers.trainer.async_checkpoint import AsyncCheckpointer


def _wait(ckpt: AsyncCheckpointer, directory: str):
    return ckpt.wait(directory)  # blocks on the write itself: no timer to race


def test_a_background_checkpoint_is_the_state_at_its_snapshot(tmp_path):
    a = trained(2)
    ckpt = AsyncCheckpointer()
    ckpt.begin(a, str(tmp_path / "async"))
    want = split_step(a, 2, 52)  # training goes on while the snapshot is written
    info = _wait(ckpt, str(tmp_path / "async"))
    assert info.trainer_version == 2 and info.step == 1
    b = TorchTrainer(FACTORY, *ADAMW)
    b.load_checkpoint(tmp_path / "async")  # verified: every file's sha256, the digest
    assert b.trainer_version == 2
    assert split_step(b, 2, 52) == want  # resumes exactly where the snapshot was taken
    ckpt.close()


def test_one_background_checkpoint_at_a_time_and_an_unknown_one_is_refused(tmp_path):
    a = trained(1)
    ckpt = AsyncCheckpointer()
    ckpt.begin(a, str(tmp_path / "one"))
    _wait(ckpt, str(tmp_path / "one"))
    with pytest.raises(KeyError, match="no checkpoint"):
        ckpt.outcome(str(tmp_path / "two"))
    ckpt.close()


def test_the_loop_records_each_checkpoint_once_durable_and_releases_after_it(tmp_path):
    cfg = make_config("run.steps=4", "checkpoint.every_steps=2",
                      "checkpoint.retain_payloads=until_checkpoint")
    h = Harness(cfg, tmp_path)
    assert h.run() == "completed"
    h.check_log()
    log = h.events()
    saved = [e for e in log if isinstance(e, ev.CheckpointSaved)]
    assert [s.trainer_version for s in saved if s.trainer_version > 0] == [2, 4]
    for s in saved:
        i = log.index(s)
        released = next((e for e in log[i:] if isinstance(e, ev.PayloadsReleased)), None)
        if s.trainer_version == 2:  # the release follows the durable checkpoint
            assert released is not None
    # nothing released before the checkpoint covering it was saved
    first_save = log.index(saved[1] if saved[0].trainer_version == 0 else saved[0])
    assert not any(isinstance(e, ev.PayloadsReleased) for e in log[:first_save])
