"""The controller's one way to the log once workers exist: append, wake, check ownership.

Every collaborator of ``controller.loop.Controller`` (admission, training, step
closing, worker-loss handling) and recovery (``controller.recovery``) is given a
``Journal``. It is the only state they share: the log writer (whose ``state`` is the
fold of what the log acknowledged), the wake-up event the pumps wait on, and the step's
clocks and counters (``Timers``).

``append`` is a coroutine: when the store is unavailable it waits (``asyncio.sleep``,
never blocking the event loop) and tries again, within the writer's ``Backoff``, then
gives up with one line naming the cause. Once it gave up, every later append fails with
that same line: the batch it gave up on may be in the log (its outcome is in doubt), so
a different batch at the same position would only be refused as a conflict. Appends are serialised: one that is waiting
to try again holds back the next, so two batches never race for one log position. An
append that needs no retry never yields to the event loop, so the pumps' interleaving
is the same as with a plain call.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from controller.core.decisions import Stamp
from controller.core.state import RunState
from controller.log_writer import Backoff, LogWriter
from events import schema as ev
from events.errors import FencedError, StoreUnavailableError

E = TypeVar("E", bound=ev.Event)

#: Events that change nothing a pump waits on (free call slots, the admission gate's
#: counts and versions, the buffer, failures): what a pause of a partial rollout or an
#: episode appends, ~5 times per group with a large fleet. Their appends do not wake
#: the pumps (each wake-up is a task step and a timeout per pump); anything else in a
#: batch, a commit riding with a pause included, does.
_QUIET = frozenset({ev.SegmentsRecorded, ev.EnvStepsRequested, ev.EnvStepsCompleted,
                    ev.EpisodeTurnsRecorded})


@dataclass
class Timers:
    """The loop's clocks and counters; all but ``started`` and ``last_progress`` start
    again at every StepFinished."""

    started: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    trainer_busy: float = 0.0
    data_wait: float = 0.0
    generator_busy: float = 0.0
    step_started: float = field(default_factory=time.monotonic)
    evicted: int = 0
    failed: int = 0
    zero_variance: int = 0


class Journal:
    """The log writer, the pumps' wake-up and the step's timers, behind one object."""

    def __init__(
        self,
        writer: LogWriter,
        clock: Callable[[], float] = time.monotonic,
        backoff: Backoff = Backoff(),
    ) -> None:
        self.writer = writer
        self.clock = clock
        self.backoff = backoff
        #: replaced (not reset) at every StepFinished: a reader holding the old object
        #: keeps the finished step's figures
        now = clock()  # the timers run on the loop's clock (virtual in ``sim``)
        self.timers = Timers(started=now, last_progress=now, step_started=now)
        self._wake = asyncio.Event()
        self._appending = asyncio.Lock()
        #: the error an append gave up with: its batch's outcome is in doubt, so the
        #: log's position is unknown and every later append fails with the same error
        #: (one behind it would only conflict with it and hide the cause)
        self.gave_up: StoreUnavailableError | None = None

    @property
    def state(self) -> RunState:
        return self.writer.state

    @property
    def epoch(self) -> int:
        return self.writer.epoch

    @property
    def fenced(self) -> FencedError | None:
        return self.writer.fenced

    def make(self, cls: type[E], **fields: Any) -> E:
        return self.writer.make(cls, **fields)

    def stamp(self) -> Stamp:
        return self.writer.stamp()

    async def append(self, *events: ev.Event, batch_point: str | None = None) -> None:
        """Append a batch (see the module docstring); wakes the pumps once it landed."""
        async with self._appending:
            if self.gave_up is not None:
                raise self.gave_up
            started = self.clock()
            delays = self.backoff.delays()
            while True:
                try:
                    self.writer.append(*events, batch_point=batch_point)
                    break
                except StoreUnavailableError as err:
                    delay = next(delays, None)
                    if delay is None:
                        self.gave_up = self._gave_up(events, err, self.clock() - started)
                        raise self.gave_up from err
                    await asyncio.sleep(delay)
        self.timers.last_progress = self.clock()
        if not _QUIET.issuperset(map(type, events)):
            self._wake.set()

    def _gave_up(self, events: tuple[ev.Event, ...], err: Exception, waited_s: float) -> StoreUnavailableError:
        w = self.writer
        return StoreUnavailableError(
            f"appending {len(events)} event(s) ({events[0].event_id}, ...) to run "
            f"{w.run_id!r} at position {w.position + 1} failed {self.backoff.tries} times "
            f"over {waited_s:.1f}s; last error: {err}"
        )

    def wake(self) -> None:
        self._wake.set()

    def ensure_owner(self) -> None:
        """Raise FencedError if a newer controller claimed the run (before a side effect)."""
        w = self.writer
        if w.fenced is not None:
            raise w.fenced
        current = w.store.current_epoch(w.run_id)
        if current != w.epoch:
            w.fenced = FencedError(w.run_id, w.epoch, current)
            raise w.fenced

    async def wait_wake(self, timeout_s: float = 0.5) -> None:
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
        # that races with the event being set, and a pump would then never stop.
        self._wake.clear()
        try:
            async with asyncio.timeout(timeout_s):
                await self._wake.wait()
        except TimeoutError:
            pass

    def next_step_timers(self) -> Timers:
        """Start the next step's timers; returns the finished step's."""
        done = self.timers
        self.timers = Timers(
            started=done.started, last_progress=done.last_progress, step_started=self.clock()
        )
        return done
