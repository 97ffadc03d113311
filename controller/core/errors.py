"""Typed errors of the controller core. Each names the log position it is about."""

from __future__ import annotations

from typing import NoReturn


class ControllerError(Exception):
    """Base of every error raised by the controller."""


class InvariantViolation(ControllerError):
    """An event breaks a rule of the run's state machines.

    Raised by the reducer for the event at ``position``; the log is never silently
    repaired or skipped past. ``event_id`` is the offending event's deterministic id
    (``None`` when the violation is not about one event).
    """

    def __init__(self, position: int, reason: str, event_id: str | None = None) -> None:
        self.position = position
        self.reason = reason
        self.event_id = event_id
        which = f"event at position {position}"
        if event_id is not None:
            which += f" ({event_id})"
        super().__init__(f"invariant violated by {which}: {reason}")


class SnapshotDecodeError(ControllerError):
    """A state snapshot could not be decoded (garbage, or written by another format).

    Snapshots are a cache: the caller's remedy is to fold the log from the start.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"cannot decode state snapshot: {reason}")


def violation(position: int, event: object, reason: str) -> "NoReturn":
    """Raise the InvariantViolation for ``event`` at ``position`` (the reducer's one exit)."""
    raise InvariantViolation(position, reason, getattr(event, "event_id", None))
