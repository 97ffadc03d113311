"""Folding a log into a ``RunState``: the pure half of the projector.

``controller.projector.Projector.get`` is how every reader gets a run's state (the
controller at start, replay, staleness, audit, the simulator); it reads pages from the
store and folds them here. Two entry points, by what the caller holds:

* :func:`fold` -- decoded ``StoredEvent`` values (tests, hand-built logs);
* :func:`apply_raw` -- raw ``(position, bytes)`` entries as a store returns them, decoded
  with the event codec (:func:`fold_raw` is the same, returning the state).

Both apply each event with ``reducer.apply_event`` -- the one dispatch from an event to
its handler -- and advance the state they are given **in place** (pass
``state.copy()`` to keep the original).

Observers watch a fold without being part of it (:class:`Observer`): each names the event
types it wants and gets a callback right after each of them is applied. An episode
pause (``EpisodeTurnsRecorded``) reaches them as the events it stands for, each right
after it is applied, all at the pause's position (``controller.core.turns``). Staleness
traces, the simulator's timeline and the what-if are observers of the one fold.

Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, runtime_checkable

import msgspec

from controller.core.reducer import apply_event, apply_parts
from controller.core.state import RunState, initial_state
from events.codec import decode
from events.schema import CURRENT_SCHEMA_VERSION, AnyEvent, EpisodeTurnsRecorded, StoredEvent

# The codec's fast path, inlined into the loop below to save a call per entry. Anything
# it does not accept as-is (errors, older schema versions) goes through
# ``events.codec.decode``, which stays the one place that upcasts and explains errors.
_fast_decode = msgspec.json.Decoder(AnyEvent).decode
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)

#: One log entry as a store returns it: (position, encoded event bytes).
RawEntry = tuple[int, bytes]

#: Called with (event, its position, the state right after it -- the event included).
Callback = Callable[[AnyEvent, int, RunState], None]


@runtime_checkable
class Observer(Protocol):
    """Something that watches a fold (``Projector.get(..., observers=[...])``).

    ``watches()`` maps each event type the observer wants to the callback to run right
    after each event of that type is applied: ``callback(event, position, state)``, with
    ``state`` the fold's own accumulator (read it, never change it; copy what must
    outlive the callback). Types it does not name cost the fold nothing. An exception a
    callback raises stops the fold there and reaches the caller. An observer sees every
    event from the start of the log: the projector never starts it from a snapshot.
    """

    def watches(self) -> Mapping[type, Callback]: ...


def watching(observers: Iterable[Observer]) -> dict[type, Callback]:
    """One callback per event type for several observers (each called in turn)."""
    merged: dict[type, list[Callback]] = {}
    for observer in observers:
        for cls, callback in observer.watches().items():
            merged.setdefault(cls, []).append(callback)
    return {cls: cbs[0] if len(cbs) == 1 else _chain(cbs) for cls, cbs in merged.items()}


def _chain(callbacks: list[Callback]) -> Callback:
    def each(event: AnyEvent, position: int, state: RunState) -> None:
        for callback in callbacks:
            callback(event, position, state)

    return each


def fold(events: Iterable[StoredEvent], state: RunState | None = None) -> RunState:
    """Apply ``events`` in order to ``state`` (a fresh initial state if None)."""
    state = initial_state() if state is None else state
    for stored in events:
        apply_event(state, stored.event, stored.position)
    return state


def fold_raw(entries: Iterable[RawEntry], state: RunState | None = None) -> RunState:
    """:func:`apply_raw` from ``state`` (a fresh initial state if None); returns it."""
    state = initial_state() if state is None else state
    apply_raw(state, entries)
    return state


def apply_raw(
    state: RunState,
    entries: Iterable[RawEntry],
    watches: Mapping[type, Callback] | None = None,
) -> AnyEvent | None:
    """Decode and apply raw entries to ``state`` in place; the last event applied (None
    when there was none). ``watches``: the observers' callbacks (:func:`watching`).

    Raises ``EventDecodeError`` or ``InvariantViolation`` naming the entry's position;
    ``state`` then stands at the entry before the bad one. The collector is off
    meanwhile: the fold makes no reference cycles, and with 10^5 live records each full
    pass (triggered by the decoded events' allocations) would walk them.
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _apply_raw(state, entries, watches.get if watches else None)
    finally:
        if gc_was_enabled:
            gc.enable()


def _apply_raw(
    state: RunState, entries: Iterable[RawEntry],
    watch: Callable[[type], Callback | None] | None,
) -> AnyEvent | None:
    fast_decode, apply = _fast_decode, apply_event
    event = None
    for position, data in entries:
        try:
            event = fast_decode(data)
        except _DECODE_ERRORS:
            event = decode(data, position)  # raises EventDecodeError, or upcasts
        if event.schema_version != CURRENT_SCHEMA_VERSION:
            event = decode(data, position)
        if watch is not None and type(event) is EpisodeTurnsRecorded:
            _apply_watched_parts(state, event, position, watch)
            continue
        apply(state, event, position)
        if watch is not None:
            observe = watch(type(event))
            if observe is not None:
                observe(event, position, state)
    return event


def _apply_watched_parts(
    state: RunState, event: EpisodeTurnsRecorded, position: int,
    watch: Callable[[type], Callback | None],
) -> None:
    # Observers see a pause's parts, each right after it is applied, as they saw the
    # separate events of an older log (``controller.core.turns``).
    def after(part: AnyEvent) -> None:
        observe = watch(type(part))
        if observe is not None:
            observe(part, position, state)

    apply_parts(state, event, position, after)
