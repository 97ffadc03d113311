"""The trace's tracks (processes and threads in the viewer): where each slice goes.

    run RUN        pid 1: trainer (tid 1), publish / checkpoint (2), controller (3)
    generator-k    pid 100 + k: one thread per *slot*

A generator serves several groups at once and a thread's slices must nest, so a group
takes its generator's first free slot while it generates (``take_slot``) and gives it
back at its commit or failure (``free_slot``). Each track is named once, when it is
first drawn on (a window of steps names only what it draws).
"""

from __future__ import annotations

from views.trace_writer import TraceWriter

RUN_PID = 1
TRAINER, PUBLISH, CONTROLLER = (RUN_PID, 1), (RUN_PID, 2), (RUN_PID, 3)
#: generator k is process GENERATOR_PID + k
GENERATOR_PID = 100
_RUN_THREADS = ((1, "trainer"), (2, "publish / checkpoint"), (3, "controller"))


class Tracks:
    def __init__(self, writer: TraceWriter) -> None:
        self.w = writer
        self.generators: dict[str, int] = {}
        self.slots: dict[int, list[bool]] = {}  # pid -> busy flag per slot
        self.named: set[tuple[int, int | None]] = set()

    def generator(self, name: str, drawing: bool) -> int:
        """The process of generator ``name`` (named now if it is new and ``drawing``)."""
        pid = self.generators.get(name)
        if pid is None:
            pid = self.generators[name] = GENERATOR_PID + len(self.generators)
            self.slots[pid] = []
            if drawing:
                self.name_process(pid, name)
        return pid

    def take_slot(self, pid: int) -> int:
        """The generator's first free slot, now busy."""
        slots = self.slots[pid]
        slot = slots.index(False) if False in slots else len(slots)
        if slot == len(slots):
            slots.append(True)
        slots[slot] = True
        return slot

    def free_slot(self, pid: int, slot: int) -> tuple[int, int]:
        """Give ``slot`` back; returns its track."""
        self.slots[pid][slot] = False
        return pid, slot + 1

    def name_process(self, pid: int, name: str) -> None:
        if (pid, None) not in self.named:
            self.named.add((pid, None))
            self.w.name(pid, None, name, pid)

    def name_slot(self, pid: int, slot: int) -> None:
        if (pid, slot + 1) not in self.named:
            self.named.add((pid, slot + 1))
            self.w.name(pid, slot + 1, f"slot {slot}", slot)

    def name_run(self, run_id: str) -> None:
        """Name the run's tracks and every generator seen so far (drawing starts)."""
        self.name_process(RUN_PID, f"run {run_id}")
        for tid, name in _RUN_THREADS:
            self.named.add((RUN_PID, tid))
            self.w.name(RUN_PID, tid, name, tid)
        for name, pid in self.generators.items():
            self.name_process(pid, name)
