"""One contract suite over every data plane: in-memory, durable spill, TransferQueue."""

from __future__ import annotations

import shutil

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from tests.dataplane_fixtures import grpo_rows, partition, plane, tq_plane  # noqa: F401
from workers.batch import ROW_FIELDS, collate
from workers.dataplane import (
    DataPlane,
    DataPlaneRuntime,
    DataPlaneSection,
    DataPlaneError,
    MemoryDataPlane,
    MissingPayloadError,
    SpillDataPlane,
    SpillReader,
    make_dataplane,
)
from workers.dataplane.api import batch_of, rows_of


def assert_rows_equal(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for name in w:
            assert g[name].dtype == w[name].dtype, name
            assert tuple(g[name].shape) == tuple(w[name].shape), name
            assert torch.equal(g[name], w[name]), name


def test_roundtrip_jagged_rows(plane, partition):
    keys, rows = grpo_rows(groups=3, samples=4, prompt_len=5, max_completion=9)
    plane.put(partition, keys, rows)
    assert_rows_equal(plane.get(partition, keys), rows)


def test_put_columns_equals_put_rows(plane, partition):
    keys, rows = grpo_rows(groups=1, samples=3, prompt_len=2, max_completion=4)
    columns = {name: [r[name] for r in rows] for name in rows[0]}
    plane.put(partition, keys, columns)
    assert_rows_equal(plane.get(partition, keys), rows)


def test_dtypes_and_shapes_survive(plane, partition):
    rows = [
        {
            "bf16": torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16),
            "flag": torch.tensor([True, False, True, True]),
            "ids": torch.tensor([2**40, -3], dtype=torch.int64),
            "matrix": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "scalar_bool": torch.tensor(True),
        },
        {
            "bf16": torch.tensor([0.5], dtype=torch.bfloat16),
            "flag": torch.tensor([], dtype=torch.bool),  # empty completion
            "ids": torch.tensor([7, 8, 9], dtype=torch.int64),
            "matrix": torch.ones(4, 3),
            "scalar_bool": torch.tensor(False),
        },
    ]
    plane.put(partition, ["a", "b"], rows)
    assert_rows_equal(plane.get(partition, ["a", "b"]), rows)


def test_dense_equal_length_rows_come_back_dense_per_row(plane, partition):
    rows = [{"x": torch.full((2, 2), float(i))} for i in range(3)]
    plane.put(partition, ["k0", "k1", "k2"], rows)
    assert_rows_equal(plane.get(partition, ["k0", "k1", "k2"]), rows)


def test_get_follows_key_order_and_selects_fields(plane, partition):
    keys, rows = grpo_rows(groups=1, samples=4, prompt_len=3, max_completion=5)
    plane.put(partition, keys, rows)
    order = [keys[2], keys[0], keys[3]]
    got = plane.get(partition, order, ["reward", "input_ids"])
    want = [{f: rows[keys.index(k)][f] for f in ("reward", "input_ids")} for k in order]
    assert_rows_equal(got, want)


def test_missing_keys_raise_naming_them(plane, partition):
    keys, rows = grpo_rows(groups=1, samples=2, prompt_len=3, max_completion=5)
    plane.put(partition, keys, rows)
    with pytest.raises(KeyError) as err:
        plane.get(partition, [keys[0], "nope/1", keys[1], "nope/2"])
    assert isinstance(err.value, MissingPayloadError)
    assert err.value.keys == ["nope/1", "nope/2"]
    assert "nope/1" in str(err.value) and keys[0] not in str(err.value)


def test_missing_fields_raise_naming_them(plane, partition):
    keys, rows = grpo_rows(groups=1, samples=2, prompt_len=3, max_completion=5)
    plane.put(partition, keys, rows)
    with pytest.raises(KeyError) as err:
        plane.get(partition, keys, ["reward", "advantage", "values"])
    assert err.value.fields == ["advantage", "values"]
    assert "advantage" in str(err.value)


def test_unknown_partition_raises_and_lists_empty(plane, partition):
    with pytest.raises(KeyError):
        plane.get(partition + "-other", ["k"])
    assert plane.list(partition + "-other") == []


def test_list_is_sorted_and_partitions_are_isolated(plane, partition):
    other = partition + "-b"
    plane.put(partition, ["b", "a", "c"], [{"x": torch.tensor(i)} for i in range(3)])
    plane.put(other, ["z"], [{"x": torch.tensor(9)}])
    try:
        assert plane.list(partition) == ["a", "b", "c"]
        assert plane.list(other) == ["z"]
    finally:
        plane.clear(other)


def test_clear_specific_keys(plane, partition):
    plane.put(partition, ["a", "b", "c"], [{"x": torch.tensor(i)} for i in range(3)])
    plane.clear(partition, ["a", "c", "never-there"])
    assert plane.list(partition) == ["b"]
    assert plane.get(partition, ["b"])[0]["x"].item() == 1
    with pytest.raises(KeyError):
        plane.get(partition, ["a"])


def test_clear_partition_leaves_others(plane, partition):
    other = partition + "-keep"
    plane.put(partition, ["a", "b"], [{"x": torch.tensor(i)} for i in range(2)])
    plane.put(other, ["a"], [{"x": torch.tensor(7)}])
    try:
        plane.clear(partition)
        assert plane.list(partition) == []
        assert plane.get(other, ["a"])[0]["x"].item() == 7
        plane.clear(partition)  # clearing twice is a no-op
    finally:
        plane.clear(other)


def test_tags_roundtrip_and_replace(plane, partition):
    plane.put(partition, ["a", "b"], [{"x": torch.tensor(1)}] * 2, [{"v": 1}, {"v": 2, "s": "x"}])
    assert plane.tags(partition) == {"a": {"v": 1}, "b": {"v": 2, "s": "x"}}
    plane.put(partition, ["a"], [{"x": torch.tensor(5)}], [{"v": 3}])
    assert plane.tags(partition)["a"] == {"v": 3}


def test_put_to_existing_key_merges_fields(plane, partition):
    plane.put(partition, ["a"], [{"x": torch.tensor([1, 2]), "y": torch.tensor(1.0)}])
    plane.put(partition, ["a"], [{"x": torch.tensor([3, 4, 5])}])
    row = plane.get(partition, ["a"])[0]
    assert row["x"].tolist() == [3, 4, 5] and row["y"].item() == 1.0


@pytest.mark.parametrize(
    "keys, fields, error",
    [
        (["a"], [{"x": [1, 2]}], TypeError),  # not a tensor
        (["a"], [{"__shape__/x": torch.tensor(1)}], ValueError),  # reserved name
        (["a", "a"], [{"x": torch.tensor(1)}] * 2, ValueError),  # duplicate key
        (["a", "b"], [{"x": torch.tensor(1)}], ValueError),  # row count
        (["a", "b"], [{"x": torch.tensor(1)}, {"x": torch.ones(2)}], ValueError),  # ndim
    ],
)
def test_put_rejects_bad_input(plane, partition, keys, fields, error):
    with pytest.raises(error):
        plane.put(partition, keys, fields)
    assert plane.list(partition) == []


def test_stored_rows_do_not_alias_caller_tensors(plane, partition):
    x = torch.tensor([1, 2, 3])
    plane.put(partition, ["a"], [{"x": x}])
    x[0] = 99
    got = plane.get(partition, ["a"])[0]["x"]
    got[1] = 77
    assert plane.get(partition, ["a"])[0]["x"].tolist() == [1, 2, 3]


# -- the batch as one TensorDict (what the trainer collates) ----------------------------


def test_get_batch_is_one_tensordict_of_the_rows(plane, partition):
    keys, rows = grpo_rows(groups=2, samples=3, prompt_len=4, max_completion=6)
    plane.put(partition, keys, rows)
    order = [keys[4], keys[0], keys[2]]
    td = plane.get_batch(partition, order, ["input_ids", "reward"])
    assert isinstance(td, TensorDictBase) and list(td.batch_size) == [3]
    assert set(td.keys()) == {"input_ids", "reward"}
    want = [{f: rows[keys.index(k)][f] for f in ("input_ids", "reward")} for k in order]
    assert_rows_equal(rows_of(td), want)
    with pytest.raises(MissingPayloadError):
        plane.get_batch(partition, [keys[0], "nope"], ["reward"])


def test_put_of_a_tensordict_equals_put_of_rows(plane, partition):
    keys, rows = grpo_rows(groups=1, samples=4, prompt_len=3, max_completion=5)
    plane.put(partition, keys, batch_of({n: [r[n] for r in rows] for n in rows[0]}, len(rows)))
    assert_rows_equal(plane.get(partition, keys), rows)


def test_collate_pads_the_batch_tensordict(plane, partition):
    keys, rows = grpo_rows(groups=1, samples=3, prompt_len=2, max_completion=5)
    plane.put(partition, keys, rows)
    batch = collate(plane.get_batch(partition, keys, list(ROW_FIELDS)), [0.5, -1.0, 0.0])
    lengths = [int(r["input_ids"].shape[0]) for r in rows]
    assert tuple(batch.input_ids.shape) == (3, max(lengths))
    for i, (row, n) in enumerate(zip(rows, lengths)):
        assert torch.equal(batch.input_ids[i, :n], row["input_ids"])
        assert torch.equal(batch.loss_mask[i, :n], row["loss_mask"])
        assert batch.attention_mask[i].tolist() == [True] * n + [False] * (max(lengths) - n)
        assert not batch.loss_mask[i, n:].any() and not batch.generator_logprobs[i, n:].any()
    assert batch.advantages.tolist() == [0.5, -1.0, 0.0]
    assert batch[1:].num_sequences == 2  # a TensorDict type: indexing slices every field


def test_rows_may_differ_only_in_their_first_dimension(plane, partition):
    with pytest.raises(ValueError, match="first dimension"):
        plane.put(partition, ["a", "b"], [{"m": torch.ones(2, 3)}, {"m": torch.ones(2, 4)}])


# -- durable spill ------------------------------------------------------------------


def test_spill_survives_restart(tmp_path):
    keys, rows = grpo_rows(groups=2, samples=3, prompt_len=4, max_completion=6)
    first = SpillDataPlane(MemoryDataPlane(), tmp_path)
    first.put("run-1", keys, rows, [{"group": k.split("/")[1]} for k in keys])
    first.put("run-1", [keys[0]], [{"extra": torch.tensor([1.0])}])
    first.clear("run-1", [keys[-1]])
    # "restart": a fresh process has an empty inner plane and the same directory
    second = SpillDataPlane(MemoryDataPlane(), tmp_path)
    assert second.list("run-1") == []
    assert second.reload() == len(keys) - 1
    assert second.list("run-1") == sorted(keys[:-1])
    want = [dict(rows[0], extra=torch.tensor([1.0]))] + rows[1:-1]
    assert_rows_equal(second.get("run-1", keys[:-1]), want)
    assert second.tags("run-1")[keys[1]] == {"group": "g0000"}


def test_spill_leaves_no_temporary_files(tmp_path):
    plane = SpillDataPlane(MemoryDataPlane(), tmp_path)
    plane.put("p/with/slashes", ["k/1"], [{"x": torch.tensor(1)}])
    # on disk: one put = one memory-mapped TensorDict directory, and nothing else
    (folder,) = tmp_path.iterdir()
    assert folder.name == "p%2Fwith%2Fslashes"
    (put,) = folder.iterdir()
    assert put.is_dir() and not put.name.startswith(".")
    assert TensorDict.load_memmap(put).get_non_tensor("__keys__") == '["k/1"]'
    plane.clear("p/with/slashes")
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_spill_clearing_part_of_a_put_keeps_the_rest_across_restart(tmp_path):
    keys, rows = grpo_rows(groups=1, samples=4, prompt_len=3, max_completion=5)
    first = SpillDataPlane(MemoryDataPlane(), tmp_path)
    first.put("run-1", keys, rows, [{"sample": i} for i in range(4)])
    first.clear("run-1", [keys[1], keys[3]])
    (put,) = (tmp_path / "run-1").iterdir()
    assert put.name.endswith(".1")  # the rest, rewritten as the next generation
    second = SpillDataPlane(MemoryDataPlane(), tmp_path)
    assert second.reload("run-1") == 2
    assert_rows_equal(second.get("run-1", [keys[0], keys[2]]), [rows[0], rows[2]])
    assert second.tags("run-1") == {keys[0]: {"sample": 0}, keys[2]: {"sample": 2}}


def test_spill_reload_tidies_what_a_crash_left(tmp_path):
    plane = SpillDataPlane(MemoryDataPlane(), tmp_path)
    plane.put("p", ["a", "b"], [{"x": torch.tensor(1)}, {"x": torch.tensor(2)}])
    (put,) = (tmp_path / "p").iterdir()
    stamp = put.name.rsplit(".", 1)[0]
    # a crash between writing generation 1 (only "a") and deleting generation 0
    shutil.copytree(put, tmp_path / "p" / f"{stamp}.7")
    TensorDict({"x": torch.tensor([9])}, batch_size=[1]).set_non_tensor(
        "__keys__", '["a"]').set_non_tensor("__tags__", "null").memmap(
        prefix=tmp_path / "p" / f"{stamp}.8")
    (tmp_path / "p" / ".tmp-half-written").mkdir()  # a write cut before its rename
    fresh = SpillDataPlane(MemoryDataPlane(), tmp_path)
    assert fresh.reload() == 1
    assert fresh.get("p", ["a"])[0]["x"].item() == 9 and fresh.list("p") == ["a"]
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [f"{stamp}.8"]


def test_a_reader_beside_a_live_run_deletes_nothing(tmp_path):
    """``reload(tidy=False)`` (``replay --retrain``): a temporary directory may be a put
    being written by the live run, and a superseded generation is its writer's to drop."""
    plane = SpillDataPlane(MemoryDataPlane(), tmp_path)
    plane.put("p", ["a"], [{"x": torch.tensor(1)}])
    (put,) = (tmp_path / "p").iterdir()
    shutil.copytree(put, tmp_path / "p" / f"{put.name.rsplit('.', 1)[0]}.1")
    (tmp_path / "p" / ".tmp-being-written").mkdir()
    before = sorted(p.name for p in (tmp_path / "p").iterdir())
    reader = SpillDataPlane(MemoryDataPlane(), tmp_path)
    assert reader.reload("p", tidy=False) == 1
    assert reader.get("p", ["a"])[0]["x"].item() == 1
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == before
    # the keyed read (``SpillReader``) neither: it reads the newest generation in place
    assert SpillReader(tmp_path).get("p", ["a"])[0]["x"].item() == 1
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == before


def test_spill_refuses_the_old_safetensors_format(tmp_path):
    (tmp_path / "run-1").mkdir()
    (tmp_path / "run-1" / "run-1%2Fg0%2Fa0%2Fs0.safetensors").write_bytes(b"old")
    with pytest.raises(DataPlaneError, match="safetensors format of an earlier release"):
        SpillDataPlane(MemoryDataPlane(), tmp_path).reload()


# -- factory ------------------------------------------------------------------------


def test_factory_builds_memory_and_spill(tmp_path):
    memory = DataPlaneSection(kind="memory", spill=False)
    assert isinstance(make_dataplane(memory, DataPlaneRuntime()), MemoryDataPlane)
    spilled = DataPlaneSection(kind="memory", spill=True)
    spill = make_dataplane(spilled, DataPlaneRuntime(run_dir=str(tmp_path)))
    assert isinstance(spill, SpillDataPlane) and isinstance(spill.inner, MemoryDataPlane)
    assert (tmp_path / "spill").is_dir()
    # a spill without a run directory is refused, never silently dropped
    with pytest.raises(ValueError, match="dataplane.spill"):
        make_dataplane(spilled, DataPlaneRuntime())


def test_factory_rejects_unknown_kind():
    with pytest.raises(ValueError, match="dataplane.kind"):
        DataPlaneSection(kind="redis")  # type: ignore[arg-type]


def test_only_a_plane_that_keeps_rows_declares_reload(plane):
    """Recovery reloads kept rows only through the ``DurableDataPlane`` tier: a plane
    is one exactly when it can reload (never probed for with getattr)."""
    from workers.dataplane import DurableDataPlane

    assert isinstance(plane, DataPlane)
    assert isinstance(plane, DurableDataPlane) == isinstance(plane, SpillDataPlane)
    assert hasattr(type(plane), "reload") == isinstance(plane, DurableDataPlane)
