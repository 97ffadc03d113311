"""Whose CPU the event loop spends: thread CPU per loop callback, grouped by its owner.

A simulated run's loop thread runs the controller and the simulated workers together.
``VirtualTimeLoop.uncharged`` already takes the workers' own bookkeeping out of the
controller's figure; :func:`callbacks_by_owner` says where the rest goes, to check that
split rather than trust it: every callback the loop runs (a task's step is one) is
timed with the thread's CPU clock and named by what it runs -- the coroutine of a task,
else the callback's qualified name -- and split into what the loop's uncharged sections
took inside it and the rest, the part the controller's figure counts. What no callback
holds is the loop's own turn (selector poll, timer heap, ready queue).

It wraps ``asyncio.events.Handle._run`` for the duration of the ``with`` block (two
clock reads per callback, ~1 us), so it is for a bench's diagnosis, not for the figures
compared side by side.
"""

from __future__ import annotations

import asyncio
import asyncio.events
import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Owners:
    """Per owner: callbacks run and thread CPU seconds they took (uncharged parts included)."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    cpu_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    #: the part of ``cpu_s`` outside the loop's uncharged sections: what the controller's
    #: figure counts of that owner (a controller callback that issues a simulated
    #: generator's call runs the simulator's bookkeeping inside it, uncharged)
    charged_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def top(self, n: int) -> list[tuple[str, int, float]]:
        ranked = sorted(self.cpu_s, key=self.cpu_s.__getitem__, reverse=True)[:n]
        return [(name, self.calls[name], self.cpu_s[name]) for name in ranked]

    def top_charged(self, n: int) -> list[tuple[str, int, float]]:
        """The ``n`` owners the controller's figure charges most: (name, calls, seconds)."""
        ranked = sorted(self.charged_s, key=self.charged_s.__getitem__, reverse=True)[:n]
        return [(name, self.calls[name], self.charged_s[name]) for name in ranked]

    @property
    def total_s(self) -> float:
        return sum(self.cpu_s.values())


def owner_of(handle: asyncio.Handle) -> str:
    """``module:name``: the coroutine a task step resumes, else the callback."""
    callback = handle._callback
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        coro = task.get_coro()
        frame = getattr(coro, "cr_frame", None)
        module = frame.f_globals.get("__name__", "?") if frame is not None else "?"
        return f"{module}:task {getattr(coro, '__qualname__', type(coro).__name__)}"
    return f"{getattr(callback, '__module__', None) or '?'}:{getattr(callback, '__qualname__', '?')}"


def is_simulator(owner: str) -> bool:
    """Callbacks of the simulated workers (``sim``), the fleet's timer heap included."""
    return owner.startswith("sim.")


@contextlib.contextmanager
def callbacks_by_owner() -> Iterator[Owners]:
    """Time every loop callback run inside the block (see the module docstring)."""
    owners, run, clock = Owners(), asyncio.events.Handle._run, time.thread_time

    def timed(handle: asyncio.Handle) -> None:
        name = owner_of(handle)  # before the step: a finished coroutine has no frame
        loop = handle._loop
        uncharged = getattr(loop, "uncharged_cpu_s", 0.0)
        start = clock()
        run(handle)
        spent = clock() - start
        owners.calls[name] += 1
        owners.cpu_s[name] += spent
        owners.charged_s[name] += spent - (getattr(loop, "uncharged_cpu_s", 0.0) - uncharged)

    asyncio.events.Handle._run = timed  # type: ignore[method-assign]
    try:
        yield owners
    finally:
        asyncio.events.Handle._run = run  # type: ignore[method-assign]
