"""Folding a log into a ``RunState``: from the start, from a snapshot, or from raw entries.

``fold`` advances the state it is given **in place** (see ``controller.core.reducer``); pass
``state.copy()`` to keep the original. The raw-entry helpers are the hot path of
recovery and replay over 1M-event logs: they decode with the event codec and call the
reducer directly, without building a ``StoredEvent`` per entry.

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import gc
from typing import Callable, Iterable, Iterator, Mapping

import msgspec

from controller.core.reducer import HANDLERS, apply_event, check_preamble, handler_for
from controller.core.state import RunState, decode_state, initial_state
from events.codec import decode
from events.schema import CURRENT_SCHEMA_VERSION, AnyEvent, StoredEvent

# The codec's fast path, inlined into the loop below to save a call per entry. Anything
# it does not accept as-is (errors, older schema versions) goes through
# ``events.codec.decode``, which stays the one place that upcasts and explains errors.
_fast_decode = msgspec.json.Decoder(AnyEvent).decode
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)

#: One log entry as a store returns it: (position, encoded event bytes).
RawEntry = tuple[int, bytes]

#: Called with (event, its position, the state right after it) by ``apply_raw``.
Observer = Callable[[AnyEvent, int, RunState], None]


def fold(events: Iterable[StoredEvent], state: RunState | None = None) -> RunState:
    """Apply ``events`` in order to ``state`` (a fresh initial state if None)."""
    state = initial_state() if state is None else state
    for stored in events:
        apply_event(state, stored.event, stored.position)
    return state


def fold_from_snapshot(snapshot: bytes, tail: Iterable[StoredEvent]) -> RunState:
    """Decode a snapshot (``encode_state`` bytes) and fold the events after it."""
    return fold(tail, decode_state(snapshot))


def fold_raw(entries: Iterable[RawEntry], state: RunState | None = None) -> RunState:
    """Decode and apply raw ``(position, bytes)`` entries (the fast path).

    Raises ``EventDecodeError`` or ``InvariantViolation`` naming the entry's position.
    """
    state = initial_state() if state is None else state
    apply_raw(state, entries)
    return state


def apply_raw(
    state: RunState,
    entries: Iterable[RawEntry],
    observers: Mapping[type, Observer] | None = None,
) -> AnyEvent | None:
    """Decode and apply raw entries to ``state`` in place; the last event applied (None
    when there was none).

    ``observers`` maps an event type to a callback run right after each event of that
    type is applied (replay's traces); an exception it raises stops the fold there.
    Raises like ``fold_raw``; ``state`` then stands at the entry before the bad one. The
    collector is off meanwhile: the fold makes no reference cycles, and with 10^5 live
    records each full pass (triggered by the decoded events' allocations) would walk them.
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if observers:
            return _apply_raw_observed(state, entries, observers)
        return _apply_raw(state, entries)
    finally:
        if gc_was_enabled:
            gc.enable()


def _apply_raw(state: RunState, entries: Iterable[RawEntry]) -> AnyEvent | None:
    # ``reducer.apply_event`` inlined (one call less per entry; see ``reducer.HANDLERS``),
    # with the position, epoch and started flag the preamble test reads kept in locals:
    # only RunStarted and ControllerStarted change the latter two, and both take the
    # slow branch (the first event; a new epoch), which reloads them. ``state.position``
    # is written once at the end (or at the first error), as no handler reads it.
    handlers, fast_decode = HANDLERS, _fast_decode
    event = None
    last, epoch, started = state.position, state.epoch, state.started
    try:
        for position, data in entries:
            try:
                event = fast_decode(data)
            except _DECODE_ERRORS:
                event = decode(data, position)  # raises EventDecodeError, or upcasts
            if event.schema_version != CURRENT_SCHEMA_VERSION:
                event = decode(data, position)
            if position == last + 1 and event.epoch == epoch and started:
                (handlers.get(type(event)) or handler_for(event))(state, event, position)
            else:
                state.position = last
                check_preamble(state, event, position)
                (handlers.get(type(event)) or handler_for(event))(state, event, position)
                epoch, started = state.epoch, state.started
            last = position
    finally:
        state.position = last
    return event


def _apply_raw_observed(
    state: RunState, entries: Iterable[RawEntry], observers: Mapping[type, Observer]
) -> AnyEvent | None:
    # _apply_raw plus the observer lookup; kept apart so plain folds do not pay for it.
    # Observers see the state right after their event, ``state.position`` included.
    handlers, fast_decode = HANDLERS, _fast_decode
    event = None
    epoch, started = state.epoch, state.started
    for position, data in entries:
        try:
            event = fast_decode(data)
        except _DECODE_ERRORS:
            event = decode(data, position)
        if event.schema_version != CURRENT_SCHEMA_VERSION:
            event = decode(data, position)
        if position == state.position + 1 and event.epoch == epoch and started:
            (handlers.get(type(event)) or handler_for(event))(state, event, position)
        else:
            check_preamble(state, event, position)
            (handlers.get(type(event)) or handler_for(event))(state, event, position)
            epoch, started = state.epoch, state.started
        state.position = position
        observe = observers.get(type(event))
        if observe is not None:
            observe(event, position, state)
    return event


def fold_raw_from_snapshot(snapshot: bytes, tail: Iterable[RawEntry]) -> RunState:
    return fold_raw(tail, decode_state(snapshot))


def decode_entries(entries: Iterable[RawEntry]) -> Iterator[StoredEvent]:
    """Raw entries as ``StoredEvent`` values (for callers that keep the events)."""
    for position, data in entries:
        yield StoredEvent(position=position, event=decode(data, position))


def fold_until(
    events: Iterable[StoredEvent], position: int, state: RunState | None = None
) -> RunState:
    """The state right after the event at ``position`` (replay's "state at any event")."""
    state = initial_state() if state is None else state
    for stored in events:
        if stored.position > position:
            break
        apply_event(state, stored.event, stored.position)
    return state
