"""The raw fold stops at a bad entry exactly as the typed fold would: the error names the
entry's position and the state it was given stands at the entry before, equal to a fold
of the good prefix -- on the plain path (which keeps the position, epoch and started
flag in locals) and on the observed path alike."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.core.errors import InvariantViolation
from controller.core.fold import apply_raw, fold
from controller.core.state import RunState, encode_state, initial_state
from events.codec import encode
from events.errors import EventDecodeError
from events.schema import AnyEvent, RunFinished
from tests.unit.random_log import random_run
from tests.unit.test_fold_snapshot import runs


def _stale(epoch: int) -> bytes:
    return encode(RunFinished(event_id="run:x:finished", epoch=epoch - 1, ts=0.0, reason="x"))


BAD = {
    "malformed": (lambda epoch: b'{"type": "RolloutAdmitted", "group_id": ', EventDecodeError),
    "unknown type": (lambda epoch: b'{"type": "NoSuchEvent", "event_id": "x"}', EventDecodeError),
    "stale epoch": (_stale, InvariantViolation),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(builder=runs, data=st.data())
def test_a_bad_entry_stops_the_raw_fold_at_the_entry_before(builder, data) -> None:
    log = builder.build()
    entries = builder.encoded()
    k = data.draw(st.integers(2, len(entries)), label="bad position")
    kind = data.draw(st.sampled_from(sorted(BAD)), label="kind")
    prefix = fold(log[: k - 1])
    bad_bytes, error = BAD[kind]
    tampered = [*entries[: k - 1], (k, bad_bytes(prefix.epoch)), *entries[k:]]
    seen: list[int] = []

    def observe(event: AnyEvent, position: int, state: RunState) -> None:
        assert state.position == position  # observers see the state right after it
        seen.append(position)

    observers = {type(s.event): observe for s in log}
    for watch in (None, observers):
        state = initial_state()
        with pytest.raises(error) as raised:
            apply_raw(state, tampered, watch)
        assert raised.value.position == k
        assert state.position == k - 1
        assert encode_state(state) == encode_state(prefix)
    assert seen == list(range(1, k))


def test_a_gap_stops_the_raw_fold_at_the_entry_before() -> None:
    builder = random_run(3, 4, p_restart=0.3)
    entries = builder.encoded()
    state = initial_state()
    with pytest.raises(InvariantViolation) as raised:
        apply_raw(state, [*entries[:5], *entries[6:]])
    assert raised.value.position == 7 and state.position == 5
    assert encode_state(state) == encode_state(fold(builder.build()[:5]))
