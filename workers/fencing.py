"""Fencing tokens at the workers: a zombie controller's calls are refused by the resource.

The controller's epoch (claimed in the log) is a fencing token. The controller checks
it against the log before each side effect, but a takeover that lands between that
check and the call would still let one call through. So every call a controller
makes to a worker carries its epoch, and the worker keeps the highest epoch it has
seen::

    controller A (epoch 1)        worker                controller B (epoch 2)
    check log: epoch 1 ok
         .... paused ....                                claims epoch 2
                                  highest 1 -> 2   <---  first call (epoch 2)
    call (epoch 1)          --->  1 < 2: refused,
                                  StaleEpochError(1, 2), nothing changed

Admission (check and raise) happens when the call starts *executing* on the worker,
under the fence's lock, so a call that was issued before the takeover but is still
queued behind B's first call is refused too. Side effects that outlive admission
(a generator writing its rows after a long generation, a weight update on a
generator that serves two calls at once) re-check under the same lock with
:meth:`EpochFence.guard`, so B's first contact and A's write are ordered.

A call made without an epoch (a start-up probe, a tool) is not fenced. Pure Python,
no I/O: used in-process and inside Ray actors alike.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from events.errors import FencedError


class StaleEpochError(FencedError):
    """A worker refused a call: its epoch is older than one the worker has already seen."""

    def __init__(self, run_id: str, worker: str, method: str, epoch: int, highest: int) -> None:
        super().__init__(run_id, epoch, highest)
        self.worker = worker
        self.method = method
        # FencedError's message speaks of the log; say where this refusal came from
        self.args = (
            f"run {run_id!r}: {worker} refused {method} from controller epoch {epoch}: "
            f"it has seen epoch {highest} (another controller has taken over this run)",
        )

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray process boundaries intact
        return (type(self), (self.run_id, self.worker, self.method, self.epoch, self.current_epoch))


class _ThreadState(threading.local):
    """Per thread: the (epoch, method) of the call it serves, and whether it holds the
    fence inside :meth:`EpochFence.guard` (class defaults: a new thread has neither)."""

    epoch: tuple[int, str] | None = None
    holding: bool = False


class EpochFence:
    """The highest controller epoch one worker has seen; refuses anything older."""

    def __init__(self, run_id: str, worker: str) -> None:
        self.run_id = run_id
        self.worker = worker
        self.highest = 0
        #: calls (or writes) refused so far, for tests and logs
        self.refused = 0
        self._lock = threading.Lock()
        self._local = _ThreadState()

    def admit(self, epoch: int, method: str) -> None:
        """Accept a call from ``epoch`` (raising the highest seen) or raise StaleEpochError."""
        with self._lock:
            self._check(epoch, method)
            self.highest = epoch

    def _check(self, epoch: int, method: str) -> None:
        if epoch < self.highest:
            self.refused += 1
            raise StaleEpochError(self.run_id, self.worker, method, epoch, self.highest)

    def call(self, epoch: int, method: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Admit, then run ``fn`` with the epoch known to :meth:`guard` on this thread."""
        self.admit(epoch, method)
        previous = self._local.epoch
        self._local.epoch = (epoch, method)
        try:
            return fn(*args)
        finally:
            self._local.epoch = previous

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Hold the fence while a side effect happens: refused if a newer epoch came in
        since this thread's call was admitted. A no-op outside :meth:`call`."""
        current = self._local.epoch
        if current is None:
            yield
            return
        with self._lock:
            self._check(*current)
            self._local.holding = True
            try:
                yield
            finally:
                self._local.holding = False

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Let go of the fence this thread holds in :meth:`guard` while it waits for
        another thread, and take it back after. A weight update that must wait for the
        generating thread's next step boundary waits here: that thread may first write a
        flush under the fence, and each would wait for the other. The update was checked
        and queued under the fence, and every later check counts it as held, so a newer
        controller admitted meanwhile sees it as landed before its first call. A no-op
        outside :meth:`guard`."""
        if not self._local.holding:
            yield
            return
        self._local.holding = False
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            self._local.holding = True


class Fenced:
    """Mixin for worker classes: the ``fenced`` entry point every controller call uses."""

    fence: EpochFence

    def fenced(self, epoch: int, method: str, *args: Any) -> Any:
        """Run ``method(*args)`` for a controller at ``epoch`` (refused if it is stale)."""
        if method.startswith("_") or method == "fenced":
            raise AttributeError(f"{type(self).__name__}.{method} is not a worker call")
        return self.fence.call(epoch, method, getattr(self, method), *args)


class EpochToken:
    """The epoch a controller's handles stamp on every call (0 = not fenced yet)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value
