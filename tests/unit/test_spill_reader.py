"""``SpillReader``: a few keys read straight from a spill directory, opening only the puts
of their groups, with the data plane's own read semantics.

Which puts a read opens is counted through the real directory: every put is a
memory-mapped ``TensorDict`` whose ``meta.json`` is opened (Python's ``open``, seen by an
audit hook) before any of its tensors can be read, so the ``meta.json`` files opened name
the puts the read loaded.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from workers.dataplane import MemoryDataPlane, MissingPayloadError, SpillDataPlane, SpillReader

RUN = "r1"
_opened: list[Path] | None = None  # the audit hook records while this is a list


def _record_open(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, Path)):
        _opened.append(Path(args[0]))


sys.addaudithook(_record_open)  # hooks cannot be removed: it records only when asked


def _puts_opened(read) -> tuple[object, set[str]]:
    """``read()``'s result and the put directories whose ``meta.json`` it opened."""
    global _opened
    _opened = []
    try:
        result = read()
    finally:
        opened, _opened = _opened, None
    return result, {p.parent.name for p in opened if p.name == "meta.json" and p.parent.name[0].isdigit()}


def _puts_holding(directory: Path, part: str) -> set[str]:
    """The put directories that hold a key containing ``part``."""
    return {p.name for p in (directory / RUN).iterdir()
            if any(part in k for k in json.loads(TensorDict.load_memmap(p).get_non_tensor("__keys__")))}


def _group_rows(group: int, n: int = 4) -> dict[str, list[torch.Tensor]]:
    """A committed put: jagged ids, a scalar, float64 logprobs (exact values to compare)."""
    return {
        "input_ids": [torch.arange(group, group + 3 + i) for i in range(n)],
        "prompt_len": [torch.tensor(2 + i) for i in range(n)],
        "logprobs": [torch.linspace(-1, 0, 3 + i, dtype=torch.float64) * group for i in range(n)],
    }


def _spill(tmp_path: Path, groups: int = 30) -> SpillDataPlane:
    """``groups`` groups as a generator writes them: two segment puts, then the group."""
    plane = SpillDataPlane(MemoryDataPlane(), tmp_path)
    for g in range(groups):
        for k in range(2):
            keys = [f"{RUN}/g{g:06d}/a1/s{i}/k{k}" for i in range(4)]
            plane.put(RUN, keys, {"tokens": [torch.full((2 + k,), g) for _ in keys]})
        plane.put(RUN, [f"{RUN}/g{g:06d}/a1/s{i}" for i in range(4)], _group_rows(g),
                  [{"group": g, "sample": i} for i in range(4)])
    return plane


def test_a_keyed_read_returns_the_asked_rows_and_opens_only_their_groups_puts(tmp_path):
    plane = _spill(tmp_path)
    keys = [f"{RUN}/g000007/a1/s3", f"{RUN}/g000007/a1/s1/k1", f"{RUN}/g000007/a1/s0"]
    rows, opened = _puts_opened(lambda: SpillReader(tmp_path).get(RUN, keys))
    expected = plane.get(RUN, keys)
    assert [sorted(r) for r in rows] == [sorted(e) for e in expected]
    for got, want in zip(rows, expected):
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name])
    # the group's three puts (its first segment put holds none of the keys but is of the
    # group: its keys are read, not its tensors); none of the other groups' 87 puts
    assert opened == _puts_holding(tmp_path, "/g000007/") and len(opened) == 3
    assert len(list((tmp_path / RUN).iterdir())) == 90
    # the asked fields only, in the asked order; only that group's puts opened
    (row,), opened = _puts_opened(lambda: SpillReader(tmp_path).get(
        RUN, [f"{RUN}/g000029/a1/s2"], ["prompt_len", "input_ids"]))
    assert list(row) == ["prompt_len", "input_ids"] and row["prompt_len"].item() == 4
    assert row["input_ids"].tolist() == [29, 30, 31, 32, 33]
    assert opened == _puts_holding(tmp_path, "/g000029/")


def test_a_missing_key_or_field_is_named_as_the_plane_names_it(tmp_path):
    _spill(tmp_path, groups=3)
    reader = SpillReader(tmp_path)
    with pytest.raises(MissingPayloadError, match=r"missing keys \['r1/g000001/a2/s0'\]"):
        reader.get(RUN, [f"{RUN}/g000001/a1/s0", f"{RUN}/g000001/a2/s0"])
    with pytest.raises(MissingPayloadError, match=r"missing fields \['tokens'\]"):
        reader.get(RUN, [f"{RUN}/g000001/a1/s0"], ["input_ids", "tokens"])
    with pytest.raises(MissingPayloadError, match="missing keys"):
        SpillReader(tmp_path / "nowhere").get(RUN, ["a"])


def test_the_keyed_read_reads_what_a_reload_would(tmp_path):
    """Re-puts replace the fields they give, a partial clear leaves the next generation,
    a put of several groups carries no group mark (opened by every read), and a put
    written before the mark existed is read too."""
    plane = _spill(tmp_path, groups=2)
    g0 = [f"{RUN}/g000000/a1/s{i}" for i in range(4)]
    plane.put(RUN, g0[:2], {"prompt_len": [torch.tensor(9), torch.tensor(8)]})
    plane.clear(RUN, [g0[3], f"{RUN}/g000001/a1/s0/k0"])
    plane.put(RUN, ["x/1", "y/2/z"], {"tokens": [torch.tensor([1]), torch.tensor([2, 3])]})
    (old,) = (tmp_path / RUN / name for name in _puts_holding(tmp_path, "/g000001/a1/s1/k1"))
    old.rename(old.with_name(old.name.rsplit("-", 1)[0] + ".0"))  # the earlier release's name
    fresh = SpillDataPlane(MemoryDataPlane(), tmp_path)
    fresh.reload(RUN, tidy=False)
    reader = SpillReader(tmp_path)
    for key in fresh.list(RUN):
        (got,), (want,) = reader.get(RUN, [key]), fresh.get(RUN, [key])
        assert sorted(got) == sorted(want), key
        assert all(torch.equal(got[n], want[n]) for n in want), key
    assert reader.get(RUN, g0[:1], ["prompt_len"])[0]["prompt_len"].item() == 9
    plane.put(RUN, g0[:1], {"late": [torch.tensor(1)]})  # a field first given by a later put
    row = SpillReader(tmp_path).get(RUN, g0[:1], ["late", "input_ids", "prompt_len"])[0]
    assert list(row) == ["late", "input_ids", "prompt_len"] == list(plane.get(RUN, g0[:1], list(row))[0])
    with pytest.raises(MissingPayloadError):
        reader.get(RUN, [g0[3]])


def test_a_put_cleared_after_the_listing_is_read_from_its_next_generation(tmp_path):
    """The live run clears some rows of a put the reader has listed: the rest are now the
    put's next generation, which the reader finds by listing again."""
    plane = _spill(tmp_path, groups=2)
    keys = [f"{RUN}/g000001/a1/s{i}" for i in range(4)]
    reader = SpillReader(tmp_path)
    assert reader.get(RUN, keys[:1], ["prompt_len"])[0]["prompt_len"].item() == 2
    plane.clear(RUN, keys[:2])
    rows = reader.get(RUN, keys[2:], ["prompt_len"])
    assert [r["prompt_len"].item() for r in rows] == [4, 5]
    with pytest.raises(MissingPayloadError, match="missing keys"):
        reader.get(RUN, keys[:1])


def test_one_reader_opens_a_put_that_holds_none_of_the_keys_once(tmp_path):
    """``replay --episode`` reads a piece at a time: a put of the group already seen to
    hold none of the keys is not opened again."""
    _spill(tmp_path, groups=3)
    reader = SpillReader(tmp_path)
    counts = []
    for k in range(2):
        for i in range(4):
            rows, opened = _puts_opened(lambda: reader.get(RUN, [f"{RUN}/g000002/a1/s{i}/k{k}"]))
            assert rows[0]["tokens"].tolist() == [2] * (2 + k)
            counts.append(len(opened))
    # the first read learns the keys of the group's three puts; then only the holder
    assert counts == [3, 1, 1, 1, 1, 1, 1, 1]


#: a put directory's name as the previous release wrote it: ``{ns}-{pid}-{n}.{generation}``
PREVIOUS_NAME = re.compile(r"\d{20}-\d+-\d{8}\.\d+")


def _as_previous_release(folder: Path) -> None:
    """Rename every put under ``folder`` as the previous release named it: no group mark."""
    for put in folder.iterdir():
        if not put.name.startswith("."):
            stamp, _, generation = put.name.rpartition(".")
            put.rename(put.with_name(f"{stamp.rsplit('-', 1)[0]}.{generation}"))


def _same_rows(got: SpillDataPlane | SpillReader, want: SpillDataPlane, keys: list[str]) -> None:
    for key in keys:
        (a,), (b,) = got.get(RUN, [key]), want.get(RUN, [key])
        assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in b), key


def test_a_run_resumed_from_a_spill_of_the_previous_release_reloads_every_row(tmp_path):
    """The resume path (``reload`` with its tidy), then the resumed run's puts and clears,
    over put directories named as the previous release named them, beside new ones."""
    folder = tmp_path / RUN
    written = _spill(tmp_path, groups=3)
    (g0,) = _puts_holding(tmp_path, "/g000000/a1/s0/k0")
    shutil.copytree(folder / g0, tmp_path / "superseded")
    written.clear(RUN, [f"{RUN}/g000000/a1/s{i}/k0" for i in range(2)])
    _as_previous_release(folder)
    # a crash between writing a put's next generation and deleting the old one, and a
    # write cut before its rename
    (gen1,) = (p for p in folder.iterdir() if p.name.endswith(".1"))
    (tmp_path / "superseded").rename(gen1.with_suffix(".0"))
    (folder / ".tmp-half-written").mkdir()
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    assert len(names) == 10 and all(PREVIOUS_NAME.fullmatch(n) for n in names)

    resumed = SpillDataPlane(MemoryDataPlane(), tmp_path)
    assert resumed.reload(RUN) == len(written.list(RUN)) == 34
    _same_rows(resumed, written, written.list(RUN))
    tidied = [n for n in names if n != gen1.with_suffix(".0").name]
    assert sorted(p.name for p in folder.iterdir()) == tidied  # both went

    # the resumed run writes on: a new group, fields of an old row, part of an old put cleared
    resumed.put(RUN, [f"{RUN}/g000009/a1/s0"], _group_rows(9, n=1))
    resumed.put(RUN, [f"{RUN}/g000001/a1/s2"], {"prompt_len": [torch.tensor(7)]})
    resumed.clear(RUN, [f"{RUN}/g000002/a1/s0"])
    assert sum(not PREVIOUS_NAME.fullmatch(p.name) for p in folder.iterdir()) == 2  # the new puts
    again = SpillDataPlane(MemoryDataPlane(), tmp_path)
    assert again.reload(RUN) == len(resumed.list(RUN)) == 34
    _same_rows(again, resumed, resumed.list(RUN))
    _same_rows(SpillReader(tmp_path), resumed, resumed.list(RUN))
    assert again.get(RUN, [f"{RUN}/g000001/a1/s2"])[0]["prompt_len"].item() == 7
