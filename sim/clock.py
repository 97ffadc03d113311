"""An asyncio event loop whose clock jumps to the next timer instead of sleeping.

``VirtualTimeLoop`` is a ``SelectorEventLoop`` whose ``time()`` is a virtual clock.
Each turn of the loop asks its selector to wait ``timeout`` seconds (until the next
timer); the wrapped selector instead polls the real file descriptors without waiting
and, when none is ready, moves the virtual clock straight to that timer. So
``asyncio.sleep``, ``asyncio.timeout``, ``call_later`` -- the controller's own wake-up
timeouts and its stall watchdog included -- all run on virtual time, and a simulated
25-hour run takes as long as its callbacks take to execute.

Why this is safe for the controller: its log appends are *synchronous* store calls
(``LogWriter.append`` blocks on the Redis round trip), so no store I/O is ever pending
on the loop while it is idle. The only real descriptor the loop polls is its own
self-pipe; work handed to threads (``run_in_executor``) would let the clock run ahead
of it, so the loop refuses it.

Two modes:

* ``charge_real_time=False`` (default): callbacks take no virtual time. Deterministic:
  the same inputs give the same sequence of events at the same virtual times.
* ``charge_real_time=True``: the real wall time the loop spends running callbacks is
  added to the virtual clock, so a controller that is slow (CPU, Redis round trips,
  fsyncs) delays everything after it exactly as it would on a cluster. Work done by the
  simulated workers themselves is excluded with :meth:`VirtualTimeLoop.uncharged`.

The simulated workers' timers (:meth:`VirtualTimeLoop.call_uncharged_later`) live in a
heap of their own, behind ONE loop timer that runs every due one in an uncharged
section. On a cluster the controller's loop holds only its own timers; a fleet of 1024
simulated generators in the loop's heap made every push and pop of the controller's
timers pay for theirs (~10 Python comparisons each), and the pop and dispatch of each
of theirs was counted as the controller's CPU. What stays counted: one turn of the loop
per wake-up of the fleet, as a generator's reply on a socket would cost.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import selectors
import time
from time import perf_counter as _perf_counter, thread_time as _thread_time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class VirtualTimeError(RuntimeError):
    """The simulation cannot go on (nothing scheduled and nothing ready: a deadlock)."""


class _JumpingSelector(selectors.BaseSelector):
    """Delegates to a real selector, but never waits: an idle wait is a clock jump."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        loop = self._loop
        loop._settle()
        ready = self._real.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise VirtualTimeError(
                "virtual-time loop is idle with no timer scheduled: every task waits on "
                "something that can never happen"
            )
        scheduled = loop._scheduled  # the loop's timer heap (head is not cancelled)
        loop._advance_to(scheduled[0]._when if scheduled else loop.time() + timeout)
        return []


class _Uncharged:
    """The loop's uncharged section: ``with loop.uncharged(): ...``.

    What it subtracts is the loop thread's CPU between its two clock reads, so whatever
    the section's own machinery runs outside them is charged to the controller. A
    generator-based context manager ran most of its work there -- building the manager
    and its generator, stepping into it and out of it through ``StopIteration``: ~1.3 us
    charged per section against ~0.7 us here (``bench/bench_uncharged.py``), with ~25
    sections per episode group. This one is built once per loop, and reads the CPU clock
    last on entry and first on exit. Sections nest (a worker's timer resolving a call
    inside the fleet's section): only the outermost reads the clocks.
    """

    __slots__ = ("_loop", "_start", "_cpu")

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop
        self._start = self._cpu = 0.0

    def __enter__(self) -> None:
        loop = self._loop
        loop._uncharged_depth += 1
        if loop._uncharged_depth == 1:
            self._start = _perf_counter()
            self._cpu = _thread_time()

    def __exit__(self, kind: object, err: object, tb: object) -> None:
        loop = self._loop
        if loop._uncharged_depth == 1:
            cpu = _thread_time() - self._cpu
            spent = _perf_counter() - self._start
            loop.uncharged_cpu_s += cpu
            loop.uncharged_s += spent
            loop._mark += spent  # as if that time never passed
        loop._uncharged_depth -= 1


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop on a virtual clock (see the module docstring)."""

    def __init__(self, *, start_s: float = 0.0, charge_real_time: bool = False) -> None:
        self._vnow = float(start_s)
        self.charge_real_time = charge_real_time
        self._mark = time.perf_counter()
        #: real seconds the loop spent in ``uncharged`` sections (simulated workers)
        self.uncharged_s = 0.0
        #: loop-thread CPU seconds spent in ``uncharged`` sections
        self.uncharged_cpu_s = 0.0
        #: virtual seconds the clock jumped over (the loop had nothing to do)
        self.idle_s = 0.0
        #: nested ``uncharged`` sections count once, in the outermost
        self._uncharged_depth = 0
        self._uncharged = _Uncharged(self)
        #: the simulated workers' timers: (when, order, callback, args), and the one loop
        #: timer armed for the earliest (None: none armed)
        self._worker_timers: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._worker_order = itertools.count()
        self._worker_wake: asyncio.TimerHandle | None = None
        super().__init__(_JumpingSelector(self))

    # -- the clock ---------------------------------------------------------------------

    def time(self) -> float:
        if self.charge_real_time:
            return self._vnow + (time.perf_counter() - self._mark)
        return self._vnow

    def _settle(self) -> None:
        """Fold the real time spent since the last turn into the virtual clock."""
        if self.charge_real_time:
            now = time.perf_counter()
            self._vnow += now - self._mark
            self._mark = now

    def _advance_to(self, when: float) -> None:
        if when > self._vnow:
            self.idle_s += when - self._vnow
            # The loop runs timers due before time() + clock resolution; far from zero
            # (an epoch-sized clock) that sum rounds back to time() and the timer would
            # never be due. Keep the clock small (offset timestamps instead), and step
            # past such a timer if it happens anyway.
            if when + self._clock_resolution <= when:
                when = math.nextafter(when, math.inf)
            self._vnow = when
        self._mark = time.perf_counter()

    def uncharged(self) -> _Uncharged:
        """Real time spent inside is not added to the clock (the simulated workers'
        own bookkeeping is not the controller's cost). One reusable context manager
        per loop (see :class:`_Uncharged`)."""
        return self._uncharged

    # -- the simulated workers' timers --------------------------------------------------

    def call_uncharged_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> None:
        """``callback(*args)`` in ``delay`` virtual seconds, uncharged, from the workers'
        own heap (see the module docstring). Same-time timers run in the order set."""
        when = self.time() + max(0.0, delay)
        heapq.heappush(self._worker_timers, (when, next(self._worker_order), callback, args))
        self._arm_workers()

    def _arm_workers(self) -> None:
        if not self._worker_timers:
            return
        when = self._worker_timers[0][0]
        armed = self._worker_wake
        if armed is not None and not armed.cancelled() and armed.when() <= when:
            return
        if armed is not None:
            armed.cancel()
        self._worker_wake = self.call_at(when, self._run_workers)

    def _run_workers(self) -> None:
        """Every worker timer due now, in one uncharged section."""
        with self.uncharged():
            self._worker_wake = None
            timers, now = self._worker_timers, self.time() + self._clock_resolution
            try:
                while timers and timers[0][0] <= now:
                    _, _, callback, args = heapq.heappop(timers)
                    callback(*args)
            finally:  # one that raises (to the loop's handler) leaves the others armed
                self._arm_workers()

    # -- refusals ------------------------------------------------------------------------

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any) -> Any:
        raise VirtualTimeError(
            "run_in_executor on a virtual-time loop: the clock would not wait for the thread"
        )


def run(main: Any, *, start_s: float = 0.0, charge_real_time: bool = False) -> Any:
    """``asyncio.run`` on a fresh :class:`VirtualTimeLoop`; returns ``main``'s result."""
    loop = VirtualTimeLoop(start_s=start_s, charge_real_time=charge_real_time)
    with asyncio.Runner(loop_factory=lambda: loop) as runner:
        return runner.run(main)
