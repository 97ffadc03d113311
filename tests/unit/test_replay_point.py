"""``replay``'s state at a point names the checkpoint a resume could start from."""

from __future__ import annotations

from cli import render
from replay.point import state_at
from tests.unit.log_builder import LogBuilder
from workers.api import CHECKPOINT_MANIFEST


def test_a_checkpoint_whose_files_are_gone_is_not_the_latest_usable_one(tmp_path):
    # the log alone named v2, whose directory was deleted: the one a rewind or resume
    # would fail on; recovery and replay --retrain already check the disk
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.mkdir()
    (v1 / CHECKPOINT_MANIFEST).write_text("{}")
    b = LogBuilder(window=1, groups_per_step=1).start()
    b.group("g1").train_step(["g1"]).publish().checkpoint(uri=str(v1))
    b.group("g2").train_step(["g2"]).publish().checkpoint(uri=str(v2))
    point = state_at(b.fold(), 0.0)
    assert point["latest_checkpoint"] == {"trainer_version": 1, "uri": str(v1)}
    assert point["missing_checkpoints"] == [{"trainer_version": 2, "uri": str(v2)}]
    head = render.point_tables(point)[0]
    row = head.columns[0]._cells.index("missing_checkpoints")
    assert head.columns[1]._cells[row] == f"v2 {v2} (no {CHECKPOINT_MANIFEST})"
