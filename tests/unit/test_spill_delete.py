"""A put deleted from the spill is renamed out of the way first: a crash mid-delete
leaves a temporary directory that a reload skips and tidies, never a half-deleted put."""

from __future__ import annotations

import shutil

import torch

from workers.dataplane import MemoryDataPlane
from workers.dataplane.spill import SpillDataPlane


def _row(n: int) -> dict[str, torch.Tensor]:
    return {"tokens": torch.arange(n), "logprobs": torch.zeros(n)}


def test_a_delete_cut_short_leaves_nothing_a_reload_reads(tmp_path, monkeypatch):
    spill = SpillDataPlane(MemoryDataPlane(), tmp_path)
    spill.put("r", ["a", "b"], [_row(2), _row(3)], [{"k": 1}, {"k": 2}])
    spill.put("r", ["c"], [_row(4)], [{"k": 3}])

    def half_delete(path, ignore_errors=False):  # a SIGKILL after the first file went
        files = sorted(p for p in path.rglob("*") if p.is_file())
        files[0].unlink()
        raise SystemExit("killed")

    monkeypatch.setattr(shutil, "rmtree", half_delete)
    try:
        spill.clear("r", ["a", "b"])
    except SystemExit:
        pass
    monkeypatch.undo()
    fresh = SpillDataPlane(MemoryDataPlane(), tmp_path)
    assert fresh.reload("r") == 1  # only "c": the doomed put is gone, not half there
    assert fresh.list("r") == ["c"]
    assert not [p for p in (tmp_path / "r").iterdir() if p.name.startswith(".tmp-")]
