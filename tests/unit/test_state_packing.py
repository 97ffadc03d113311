"""A group's packed payload keys, rewards and lengths read back exactly as committed.

The state keeps them packed (one object each per group; see ``GroupRecord``); these
check the round trip through the reducer, through the raw fold and through a snapshot,
including the values a packing could get wrong: keys holding the separator, an empty
key, -0.0, NaN, subnormal and huge floats, int64's ends.
"""

from __future__ import annotations

import struct

import msgspec
import pytest

from controller.core.errors import SnapshotDecodeError
from controller.core.fold import fold, fold_raw
from controller.projector import Projector
from events.codec import encode
from events.memory_store import MemoryEventStore
from controller.core.packing import KEY_SEPARATOR, pack_keys
from controller.core.state import decode_state, encode_state
from tests.unit.log_builder import LogBuilder

REWARDS = [-0.0, 0.1, 5e-324, -1.7976931348623157e308, 1 / 3, 2.0**-1074 * 3]
LENGTHS = [0, 1, -(2**63), 2**63 - 1, 4096, 7]


def _log(keys: list[str], rewards: list[float], lengths: list[int]) -> LogBuilder:
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=len(keys))
    return b.start().admit("g1").commit("g1", payload_keys=keys, rewards=rewards, lengths=lengths)


def _bits(values: tuple[float, ...] | list[float]) -> list[bytes]:
    return [struct.pack("<d", v) for v in values]


@pytest.mark.parametrize(
    "keys",
    [
        ["g1/a1/0", "g1/a1/1", "k", "x:y", "", "é/ü"],
        ["a" + KEY_SEPARATOR + "b", "c", "d", "e", "f", "g"],  # holds the separator
        [KEY_SEPARATOR] * 6,
    ],
    ids=["plain", "separator-inside", "only-separators"],
)
def test_payload_keys_rewards_lengths_round_trip(keys: list[str]) -> None:
    b = _log(keys, REWARDS, LENGTHS)
    for state in (fold(b.build()), fold_raw(b.encoded())):
        for group in (state.groups["g1"], decode_state(encode_state(state)).groups["g1"]):
            assert group.payload_keys == tuple(keys)
            assert _bits(group.rewards) == _bits(REWARDS)  # bit for bit: -0.0, subnormal
            assert group.lengths == tuple(LENGTHS)
            assert all(type(x) is int for x in group.lengths)


def test_nan_reward_keeps_its_bits() -> None:
    # in-process only: the JSON log writes NaN and infinities as null, which decode refuses
    nan = struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0]  # a NaN with a payload
    state = fold(_log(["a", "b"], [nan, 1.0], [1, 2]).build())
    assert _bits(state.groups["g1"].rewards) == _bits([nan, 1.0])


def test_separator_in_a_key_falls_back_to_a_tuple() -> None:
    assert pack_keys(["a", "b"]) == "a" + KEY_SEPARATOR + "b"
    assert pack_keys(["a" + KEY_SEPARATOR, "b"]) == ("a" + KEY_SEPARATOR, "b")
    assert pack_keys([""]) == ""  # one empty key: splits back to ("",)


def test_an_uncommitted_group_has_no_payload() -> None:
    b = LogBuilder(run_id="r1", window=1, groups_per_step=1, samples_per_group=2)
    group = fold(b.start().admit("g1").build()).groups["g1"]
    assert (group.payload_keys, group.rewards, group.lengths) == ((), (), ())


def test_resume_over_a_format_1_snapshot_folds_the_log_from_the_start() -> None:
    # A snapshot written before the packing (format 1: the per-sample lists) is a cache
    # this code cannot read: a resume folds the whole log instead, to the same state.
    b = _log(["k0", "k1"], [0.5, 1.0], [3, 4]).admit("g2").commit("g2")
    store = MemoryEventStore()
    for stored in b.build():
        store.append_raw("r1", encode(stored.event), event_type=type(stored.event).__name__)
    full = fold_raw(b.encoded())
    old = msgspec.to_builtins(full)
    old["state_format"] = 1
    for group in old["groups"].values():
        group["payload_keys"] = list(full.groups[group["group_id"]].payload_keys)
        group["rewards"] = list(full.groups[group["group_id"]].rewards)
        group["lengths"] = list(full.groups[group["group_id"]].lengths)
        del group["packed_keys"], group["rewards_f64"], group["lengths_i64"]
    store.save_snapshot("r1", full.position, msgspec.msgpack.encode(old))
    with pytest.raises(SnapshotDecodeError, match="state format 1"):
        decode_state(store.load_snapshot("r1")[1])  # type: ignore[index]
    assert encode_state(Projector(store).get("r1").require()) == encode_state(full)
