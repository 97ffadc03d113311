"""The clients ``bench_async.py`` wraps around the trainer and the publisher to time
them: when each trainer call was issued and returned (and the loop's data wait in
between), and how long each publish took."""

from __future__ import annotations

import time
from typing import Any

from workers.api import MicrobatchRef, TrainerClient, WeightPublisher


class TimedTrainer:
    """A ``TrainerClient`` that records when each call was issued and returned.

    ``probe`` reads the loop's data-wait clock (its timers object and seconds waited
    for selectable groups) at both moments, so the data wait inside each gap between
    two calls can be subtracted exactly.
    """

    def __init__(self, inner: TrainerClient) -> None:
        self.inner = inner
        self.probe: Any = lambda: (None, 0.0)
        #: (issued, returned, probe at issue, probe at return)
        self.calls: list[tuple[float, float, Any, Any]] = []

    async def _timed(self, coro: Any) -> Any:
        issued, at_issue = time.perf_counter(), self.probe()
        try:
            return await coro
        finally:
            self.calls.append((issued, time.perf_counter(), at_issue, self.probe()))

    async def begin_train_step(self, step: int) -> None:
        return await self._timed(self.inner.begin_train_step(step))

    async def train_microbatch(self, ref: MicrobatchRef):
        return await self._timed(self.inner.train_microbatch(ref))

    async def finish_train_step(self):
        return await self._timed(self.inner.finish_train_step())

    async def abort_train_step(self) -> None:
        return await self._timed(self.inner.abort_train_step())

    async def version_and_digest(self):
        return await self.inner.version_and_digest()

    async def save_checkpoint(self, directory: str):
        return await self._timed(self.inner.save_checkpoint(directory))

    async def begin_checkpoint(self, directory: str) -> None:
        return await self._timed(self.inner.begin_checkpoint(directory))

    async def checkpoint_outcome(self, directory: str):
        return await self.inner.checkpoint_outcome(directory)

    async def load_checkpoint(self, directory: str, *expected: Any):
        return await self.inner.load_checkpoint(directory, *expected)

    async def reset(self) -> None:
        return await self.inner.reset()

    def busy_s(self) -> float:
        return sum(c[1] - c[0] for c in self.calls)

    def gaps_s(self, publishing: list[tuple[float, float]]) -> tuple[float, float, float]:
        """Between one call returning and the next being issued: (the gaps, the data wait
        in them, the controller's own time in them). A gap's own time is what neither the
        wait for data nor a publish (``publishing``: intervals) covers; the two may run
        at once (a publish behind the next step), so the larger of them is taken off
        (an upper bound of the controller's time)."""
        gaps = waits = own = 0.0
        for cur, nxt in zip(self.calls, self.calls[1:]):
            gap = max(0.0, nxt[0] - cur[1])
            (timers_then, waited_then), (timers_now, waited_now) = cur[3], nxt[2]
            # the loop starts fresh timers at every StepFinished: count from zero then
            wait = waited_now - (waited_then if timers_now is timers_then else 0.0)
            published = sum(
                max(0.0, min(end, nxt[0]) - max(start, cur[1])) for start, end in publishing
            )
            gaps, waits, own = gaps + gap, waits + wait, own + max(0.0, gap - max(wait, published))
        return gaps, waits, own


class TimedPublisher:
    """A ``WeightPublisher`` that adds up the time spent publishing."""

    def __init__(self, inner: WeightPublisher) -> None:
        self.inner = inner
        self.intervals: list[tuple[float, float]] = []

    @property
    def total_s(self) -> float:
        return sum(end - start for start, end in self.intervals)

    async def publish(self, version: int, *only: Any) -> list[str]:
        started = time.perf_counter()
        try:
            return await self.inner.publish(version, *only)
        finally:
            self.intervals.append((started, time.perf_counter()))
