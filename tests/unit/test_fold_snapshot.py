"""Snapshots are a faithful cache: folding the tail onto a decoded snapshot of any prefix
gives exactly the state of folding the whole log."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.core.errors import InvariantViolation, SnapshotDecodeError
from controller.core.fold import fold, fold_raw
from controller.core.state import STATE_FORMAT_VERSION, RunState, decode_state, encode_state
from events.errors import EventDecodeError
from tests.unit.log_builder import LogBuilder
from tests.unit.random_log import random_run

runs = st.builds(
    random_run,
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(1, 25),
    window=st.integers(0, 2),
    groups_per_step=st.integers(1, 4),
    microbatch_groups=st.integers(1, 3),
    p_fail=st.sampled_from([0.0, 0.1]),
    p_abort=st.sampled_from([0.0, 0.2]),
    p_restart=st.sampled_from([0.0, 0.1]),
    p_rewind=st.sampled_from([0.0, 0.2]),
    checkpoint_every=st.integers(1, 5),
    finish=st.booleans(),
)

_settings = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_settings
@given(builder=runs, data=st.data())
def test_fold_from_snapshot_of_any_prefix_equals_full_fold(builder: LogBuilder, data: st.DataObject) -> None:
    log = builder.build()
    k = data.draw(st.integers(0, len(log)), label="split")
    full = fold(log)
    snapshot = encode_state(fold(log[:k]))
    resumed = fold(log[k:], decode_state(snapshot))
    assert resumed == full
    assert encode_state(resumed) == encode_state(full)


@_settings
@given(builder=runs, data=st.data())
def test_raw_fold_equals_typed_fold(builder: LogBuilder, data: st.DataObject) -> None:
    entries = builder.encoded()
    k = data.draw(st.integers(0, len(entries)), label="split")
    full = fold(builder.build())
    assert fold_raw(entries) == full
    assert fold_raw(entries[k:], decode_state(encode_state(fold_raw(entries[:k])))) == full


def test_fold_advances_the_given_state_in_place() -> None:
    log = LogBuilder().start().admit("g1").build()
    state = fold(log[:2])
    assert fold(log[2:], state) is state and state.position == 3


def test_raw_fold_names_the_position_of_a_bad_entry() -> None:
    entries = LogBuilder().start().admit("g1").encoded()
    with pytest.raises(EventDecodeError) as decode_err:
        fold_raw([*entries[:2], (3, b"{not json")])
    assert decode_err.value.position == 3
    with pytest.raises(InvariantViolation) as violation:
        fold_raw([entries[0], entries[2]])
    assert violation.value.position == 3


def test_snapshot_round_trip_keeps_buffer_order_and_enums() -> None:
    b = LogBuilder().start().admit("b").admit("a").commit("a").commit("b")
    state = decode_state(encode_state(fold(b.build())))
    assert list(state.buffer) == ["a", "b"]
    assert state.groups["a"].status is state.groups["a"].status.__class__.COMMITTED


def test_snapshot_garbage_or_other_format_is_refused() -> None:
    with pytest.raises(SnapshotDecodeError):
        decode_state(b"\xc1garbage")
    other = msgspec.msgpack.encode(RunState(state_format=STATE_FORMAT_VERSION + 1))
    with pytest.raises(SnapshotDecodeError, match="state format"):
        decode_state(other)
