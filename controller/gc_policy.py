"""The garbage collector's policy for the controller's process (``controller.gc``).

A long run's state holds thousands of groups' records (an episode run: ~300,000
tracked objects at 1024 generators), and every full collection walks all of them:
0.04-0.28 s each, ~16 per 2048-group run, landing in whichever callback allocates
when one is due (docs/agents.md, "Cost"). Almost none of that state is ever cyclic
garbage: it is freed by reference counting when a group leaves the state.

``freeze``: once the loop starts (after recovery folded the log), one full collection
frees what is garbage now and ``gc.freeze()`` moves the survivors out of the collector's
sight; after every full collection the interpreter makes on its own, its survivors
are frozen too (seen at the next append: a collector callback would run at every
young collection, hundreds per group). So each full collection walks only what was
allocated and survived since the one before (the interpreter starts one when those
reach a quarter of what the last one kept), never the whole long-lived state again.
Frozen objects are still freed by reference counting -- a record dropped from the
state goes as before; only frozen *cyclic* garbage (objects in a cycle, alive at a
freeze, dropped after it) is never found. To keep that bounded, a step boundary that
finds the frozen count doubled since the last whole sweep unfreezes everything and
sweeps it once (a whole sweep per doubling of the heap; cyclic garbage can at most
double it before it is found). Freezing at every step boundary instead was measured
and not kept: a boundary comes once per ``train.groups_per_step`` groups (512 at 1024
generators), and each collection there walked a whole step's allocations on top of
the interpreter's own (docs/agents.md, "Fifth pass: the collector"). ``default``: the
interpreter's collector as it is. The loop's end unfreezes (a process that runs
several controllers -- tests, the simulator -- gets its collector back as it was).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Literal

GcPolicy = Literal["freeze", "default"]

#: a whole sweep once the frozen objects grew this many times since the last one
SWEEP_GROWTH = 2


@dataclass
class CollectorStats:
    """What the policy did: freezes after the interpreter's full collections, whole
    sweeps and their thread CPU (the interpreter's own collections are not in it)."""

    freezes: int = 0
    sweeps: int = 0
    cpu_s: float = 0.0
    #: frozen objects after the last freeze
    frozen: int = 0


class Collector:
    """Applies ``policy`` to this process's collector around one controller loop."""

    def __init__(self, policy: GcPolicy) -> None:
        self.policy = policy
        self.stats = CollectorStats()
        self._swept = 0  # frozen count right after the last whole sweep
        self._full_seen = 0  # the interpreter's full collections when last looked
        self._running = False  # between start and stop (the writer outlives the loop)

    @property
    def active(self) -> bool:
        return self.policy == "freeze"

    def start(self) -> None:
        """The loop starts: the recovered state is long-lived; sweep it and freeze it."""
        if self.active:
            self._running = True
            self._sweep()

    def step_boundary(self) -> None:
        """A step finished: a whole sweep if the frozen heap doubled since the last."""
        if self._running and gc.get_freeze_count() >= SWEEP_GROWTH * max(self._swept, 1):
            self._sweep()

    def stop(self) -> None:
        """The loop ended: hand the process its collector back as it was."""
        if self._running:
            self._running = False
            gc.unfreeze()

    def after_append(self, *_: object) -> None:
        """An append was folded (``LogWriter.listeners``): freeze the survivors of a full
        collection made since the last look -- the next walks only what is newer."""
        if not self._running:
            return
        full = gc.get_stats()[2]["collections"]
        if full != self._full_seen:
            self._full_seen = full
            gc.freeze()
            self.stats.freezes += 1
            self.stats.frozen = gc.get_freeze_count()

    def _sweep(self) -> None:
        t0 = time.thread_time()
        gc.unfreeze()
        gc.collect()  # everything, frozen cyclic garbage included
        gc.freeze()
        self._swept = gc.get_freeze_count()
        self._full_seen = gc.get_stats()[2]["collections"]
        self.stats.sweeps += 1
        self.stats.cpu_s += time.thread_time() - t0
        self.stats.frozen = self._swept
