"""A checkpoint the log names but whose files are gone is not offered as usable.

``replay --retrain --from-checkpoint`` and the payloads-lost stop read the checkpoints
from the log: after a checkpoint's directory was deleted they still said "usable: [1]"
and "continue from the newest usable checkpoint (trainer_version 2)". They now list
only checkpoints whose files exist and name the others as missing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.recovery import payloads_lost
from replay.retrain import RetrainError, pick_checkpoint
from tests.unit.log_builder import LogBuilder
from workers.trainer.checkpoint import MANIFEST_NAME


def _run(tmp_path: Path, on_disk: set[int]):
    """Checkpoints of trainer_version 1 and 2 in the log; only ``on_disk``'s files exist."""
    b = LogBuilder(run_id="r1", window=2, groups_per_step=1).start()
    for gid in ("g1", "g2", "g3"):
        b.group(gid)
    b.train_step(["g1"]).publish().checkpoint(uri=str(tmp_path / "v1"))
    b.train_step(["g2"]).publish().checkpoint(uri=str(tmp_path / "v2"))
    b.train_step(["g3"]).publish()
    for version in on_disk:
        (tmp_path / f"v{version}").mkdir()
        (tmp_path / f"v{version}" / MANIFEST_NAME).write_text("{}")
    return b.fold()


def test_retrain_from_a_checkpoint_whose_files_are_gone_names_it_missing(tmp_path) -> None:
    state = _run(tmp_path, on_disk={1})
    assert pick_checkpoint(state, 1).trainer_version == 1
    with pytest.raises(RetrainError) as err:
        pick_checkpoint(state, 2)
    assert str(err.value) == (
        f"no usable checkpoint of trainer_version 2 in run 'r1' (usable: [1]; missing, "
        f"their files gone: [2] ({tmp_path / 'v2'}); 0 = the initial weights)"
    )
    state = _run(tmp_path / "none", on_disk=set())
    with pytest.raises(RetrainError, match=r"\(usable: none; missing, their files gone: "
                                           r"\[1, 2\] \("):
        pick_checkpoint(state, 1)


def test_the_payloads_lost_stop_names_the_newest_checkpoint_on_disk(tmp_path) -> None:
    state = _run(tmp_path, on_disk={1})
    text = str(payloads_lost(state, ["g3"]))
    assert "continue from the newest usable checkpoint (trainer_version 1)" in text, text
    assert "checkpoint of trainer_version 2 is missing (its files are gone" in text, text
    state = _run(tmp_path / "none", on_disk=set())
    text = str(payloads_lost(state, ["g3"]))
    assert "continue from the initial weights (no usable checkpoint)" in text, text
    assert "checkpoints of trainer_version 1, 2 are missing (their files are gone" in text, text
