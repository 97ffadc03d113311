"""Load-dependent decode speed: a server decodes fewer concurrent sequences faster.

A continuous-batching engine (vLLM, SGLang) advances every running sequence by one token
per step, and its step time grows with the batch: memory-bound at small batches (each
step reads the weights once, whatever the batch), compute- and KV-bound at large ones.
Without this model a simulated group takes its drawn time whatever else runs, so a
generator slot the controller leaves idle is throughput lost; with it, the groups still
running decode faster, as a real server's do.

:class:`DecodeCurve` is the sim config: the step time at a few batch sizes (a published
measurement, :data:`NIM_LLAMA31_8B_H100`), the servers the fleet's sequences spread
over, and the reference load at which a group's drawn time holds. A group's drawn time
is its *work*: the seconds it takes while every server runs ``reference_sequences``;
at ``n`` sequences per server it progresses ``step(reference) / step(n)`` times as
fast. Sequences spread evenly over the servers (verl routes each request to the server
with the fewest in flight), so one load -- and one speed -- holds for every group.

:class:`LoadedDecode` is the shared work clock: the work a group running since time 0
would have done. Since every running group progresses at the same rate, a group ends
when the clock reaches its start reading plus its work, and a change of load only
re-times the single earliest deadline (a heap), not every group in flight.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sim.clock import VirtualTimeLoop

#: NVIDIA NIM for LLMs benchmarking guide, "Performance" (docs.nvidia.com/nim/
#: benchmarking/llm/1.0.0/performance), Llama-3.1-8B-Instruct, NIM 1.8.0 on H100:
#: (concurrent requests, inter-token latency in ms) -- the decode step time at that
#: batch. docs/scale.md lists the source and the figures near it.
NIM_LLAMA31_8B_H100: tuple[tuple[int, float], ...] = (
    (1, 4.63), (5, 4.58), (25, 5.19), (50, 5.91),
    (100, 7.57), (150, 9.81), (200, 12.65), (250, 16.14),
)
#: the same page's older measurement (NIM 1.3.0), steeper at large batches: a second
#: published shape, to see how much an answer depends on the curve
NIM_LLAMA31_8B_H100_V13: tuple[tuple[int, float], ...] = (
    (1, 4.37), (5, 5.1), (25, 6.02), (50, 7.19), (100, 8.62), (150, 12.49), (200, 17.76),
)


@dataclass(frozen=True)
class DecodeCurve:
    """Decode step time versus the sequences one server runs at once."""

    #: (sequences per server, step time) at measured batch sizes, sequences increasing;
    #: the time's unit is free (only ratios are used)
    points: tuple[tuple[int, float], ...]
    #: servers the fleet's sequences are spread over
    servers: int
    #: sequences per server at which a drawn generation time holds (e.g. the server's
    #: full concurrency: a group's drawn time is its time on a full server)
    reference_sequences: int

    def __post_init__(self) -> None:
        pts = self.points
        if len(pts) < 2:
            raise ValueError(f"sim.decode.points: needs at least 2 (sequences, step) points, got {len(pts)}")
        if any(n < 1 for n, _ in pts) or any(b[0] <= a[0] for a, b in zip(pts, pts[1:])):
            raise ValueError(f"sim.decode.points: sequences must be >= 1 and increasing, got {[n for n, _ in pts]}")
        if any(not t > 0 for _, t in pts):
            raise ValueError(f"sim.decode.points: step times must be > 0, got {[t for _, t in pts]}")
        if self.servers < 1:
            raise ValueError(f"sim.decode.servers: must be >= 1, got {self.servers}")
        if self.reference_sequences < 1:
            raise ValueError(f"sim.decode.reference_sequences: must be >= 1, got {self.reference_sequences}")

    def step(self, sequences: float) -> float:
        """Step time at this many sequences per server: linear between measured points,
        the first point's below it (a step cannot beat reading the weights once), the
        last segment's slope beyond the last point."""
        pts = self.points
        if sequences <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if sequences <= n1:
                return t0 + (t1 - t0) * (sequences - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) * (sequences - n1) / (n1 - n0)

    def speed(self, running_sequences: int) -> float:
        """Work per second while the fleet runs this many sequences (1 at the reference)."""
        return self.step(self.reference_sequences) / self.step(running_sequences / self.servers)


class _Deadline:
    __slots__ = ("work", "callback", "args", "cancelled")

    def __init__(self, work: float, callback: Callable[..., Any], args: tuple) -> None:
        self.work, self.callback, self.args, self.cancelled = work, callback, args, False

    def cancel(self) -> None:
        self.cancelled = True


class LoadedDecode:
    """The shared work clock of a fleet under a :class:`DecodeCurve`.

    ``time()`` and ``call_later(work, callback)`` read like the loop's (a generator uses
    either), in work seconds; ``add(sequences)`` / ``remove(sequences)`` say when
    sequences start and stop decoding, which sets the rate."""

    def __init__(self, loop: VirtualTimeLoop, curve: DecodeCurve) -> None:
        self.loop, self.curve = loop, curve
        self.sequences = 0
        self._work = 0.0
        self._at = loop.time()
        self._rate = curve.speed(0)
        self._heap: list[tuple[float, int, _Deadline]] = []
        self._order = itertools.count()  # ties keep their scheduling order
        self._timer: Any = None

    def time(self) -> float:
        return self._work + (self.loop.time() - self._at) * self._rate

    def call_later(self, work: float, callback: Callable[..., Any], *args: Any) -> _Deadline:
        deadline = _Deadline(self.time() + work, callback, args)
        heapq.heappush(self._heap, (deadline.work, next(self._order), deadline))
        self._retime()
        return deadline

    def add(self, sequences: int) -> None:
        self._set_load(self.sequences + sequences)

    def remove(self, sequences: int) -> None:
        self._set_load(self.sequences - sequences)

    def _set_load(self, sequences: int) -> None:
        if sequences < 0:
            raise RuntimeError(f"sim.decode: {sequences} sequences decoding (a call ended twice)")
        self._work, self._at = self.time(), self.loop.time()
        self.sequences = sequences
        self._rate = self.curve.speed(sequences)
        self._retime()

    def _retime(self) -> None:
        """One loop timer, at the earliest live deadline at today's rate."""
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if heap:
            delay = max(0.0, (heap[0][0] - self.time()) / self._rate)
            self._timer = self.loop.call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        with self.loop.uncharged():
            # the deadline's own reading, not the clock's float sum: a group that ends
            # here has done exactly its work
            top = self._heap[0][0] if self._heap else 0.0
            self._work, self._at = max(self.time(), top), self.loop.time()
            due = []
            while self._heap and self._heap[0][0] <= self._work:
                deadline = heapq.heappop(self._heap)[2]
                if not deadline.cancelled:
                    due.append(deadline)
        for deadline in due:  # each callback takes its own uncharged section
            if not deadline.cancelled:
                deadline.callback(*deadline.args)
        self._retime()
