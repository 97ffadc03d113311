"""A realistic random run, built with :class:`~tests.unit.log_builder.LogBuilder`.

``random_run(seed, steps)`` simulates an asynchronous run (admission ahead of the
trainer, out-of-order commits, failures and re-admission, evictions past the window,
aborted steps, controller restarts, checkpoints, releases, rewinds) with its own
bookkeeping -- independent of the reducer -- and returns the builder;
``stream_random_run`` hands the same events over in chunks, for logs too big to hold.
"""

from __future__ import annotations

import random
from typing import Any, Iterator

from events.schema import StoredEvent
from tests.unit.log_builder import LogBuilder

class _Sim:
    """Bookkeeping of ``random_run``: what a correct controller would know."""

    def __init__(self, b: LogBuilder, rng: random.Random, microbatch_groups: int) -> None:
        self.b, self.rng, self.mb = b, rng, microbatch_groups
        self.in_flight: list[str] = []
        self.buffer: list[str] = []
        self.commit_seq: dict[str, int] = {}
        self.start: dict[str, int] = {}
        self.uncovered: list[tuple[int, list[str]]] = []  # (trainer_version, groups)
        self.ckpt_version = -1
        self.n_groups = 0
        self.finished_steps = 0

    def admit_up_to(self, capacity: int) -> None:
        while len(self.in_flight) + len(self.buffer) < capacity:
            gid = f"g{self.n_groups:07d}"
            self.n_groups += 1
            self.b.admit(gid, generator=_generator(gid))
            self.in_flight.append(gid)

    def complete_some(self, p_fail: float) -> None:
        rng, b = self.rng, self.b
        if not self.in_flight:
            return
        k = rng.randint(1, len(self.in_flight))
        for gid in rng.sample(self.in_flight, k):
            self.in_flight.remove(gid)
            if rng.random() < p_fail:
                b.fail(gid)
                if rng.random() < 0.5:
                    b.release([gid])
                b.admit(gid, generator=_generator(gid))
                self.in_flight.append(gid)
            else:
                b.commit(gid)
                self.start[gid] = b.dispatch_versions[gid]
                self.commit_seq[gid] = b.last_position
                self.buffer.append(gid)

    def evict_stale(self) -> None:
        b = self.b
        for gid in list(self.buffer):
            lag = b.trainer_version - self.start[gid]
            if lag > b.window or lag < 0:
                self.buffer.remove(gid)
                b.evict(gid, lag=lag).release([gid])

    def step(self, p_abort: float, p_restart: float) -> None:
        b, rng = self.b, self.rng
        picked = self.buffer[: b.groups_per_step]
        del self.buffer[: b.groups_per_step]
        b.begin_step()
        chunks = [picked[i : i + self.mb] for i in range(0, len(picked), self.mb)]
        restart = rng.random() < p_restart
        abort = restart or rng.random() < p_abort
        if abort:
            chunks = chunks[: rng.randint(0, len(chunks) - 1)]
        for chunk in chunks:
            b.microbatch(chunk)
        if not abort:
            b.finish_step()
            self.finished_steps += 1
            self.uncovered.append((b.trainer_version, picked))
            b.publish()
            return
        if restart:
            b.restart()
        b.abort_step("restart" if restart else "trainer error")
        self.buffer = sorted(self.buffer + picked, key=self.commit_seq.__getitem__)
        if restart:
            for gid in list(self.in_flight):
                b.fail(gid, "controller restart").admit(gid, generator=_generator(gid))
            b.publish()

    def checkpoint(self) -> None:
        b = self.b
        b.checkpoint()
        self.ckpt_version = b.trainer_version
        covered = [g for v, gs in self.uncovered if v <= b.trainer_version for g in gs]
        self.uncovered = [(v, gs) for v, gs in self.uncovered if v > b.trainer_version]
        if covered:
            b.release(covered)

    def rewind(self) -> None:
        b = self.b
        lost = [g for _, gs in self.uncovered for g in gs]
        b.rewind(self.ckpt_version)
        self.uncovered = []
        if lost:
            b.release(lost)
        b.publish()


def _generator(group_id: str) -> str:
    """The simulated run's two generators (no random draw: other logs stay the same)."""
    return f"generator-{int(group_id[1:]) % 2}"


def random_run(seed: int, steps: int, **options: Any) -> LogBuilder:
    """A valid log of a simulated run that finishes ``steps`` training steps (options:
    those of :func:`_simulate`)."""
    *_, builder = _simulate(seed, steps, **options)  # the last yield holds the whole run
    return builder


def stream_random_run(seed: int, steps: int, **options: Any) -> Iterator[list[StoredEvent]]:
    """``random_run``'s events (the same ones, in order) in chunks, none kept after its
    chunk is handed over: logs of 10^7 events for benchmarks, in bounded memory."""
    for builder in _simulate(seed, steps, **options):
        if builder.events:
            chunk, builder.events = builder.events, []
            yield chunk


def _simulate(
    seed: int,
    steps: int,
    *,
    window: int = 1,
    groups_per_step: int = 4,
    samples_per_group: int = 8,
    microbatch_groups: int = 2,
    p_fail: float = 0.02,
    p_abort: float = 0.02,
    p_restart: float = 0.01,
    p_rewind: float = 0.0,
    p_worker_lost: float = 0.005,
    checkpoint_every: int = 10,
    finish: bool = True,
) -> Iterator[LogBuilder]:
    """The builder of ``random_run`` after each round of the simulation, then at the end
    (the simulation never reads ``builder.events``, so a caller may drain it)."""
    rng = random.Random(seed)
    b = LogBuilder(
        run_id=f"sim-{seed}",
        window=window,
        groups_per_step=groups_per_step,
        samples_per_group=samples_per_group,
        seed=seed,
    ).start(config={"run": {"seed": seed}, "train": {"groups_per_microbatch": microbatch_groups}})
    b.checkpoint()  # initial weights, version 0
    sim = _Sim(b, rng, microbatch_groups)
    sim.ckpt_version = 0
    capacity = groups_per_step * (window + 1)
    while sim.finished_steps < steps:
        yield b
        sim.admit_up_to(capacity)
        sim.complete_some(p_fail)
        sim.evict_stale()
        if rng.random() < p_worker_lost:
            b.worker_lost()
        if len(sim.buffer) < groups_per_step:
            continue
        before = sim.finished_steps
        sim.step(p_abort, p_restart)
        if sim.finished_steps > before and sim.finished_steps % checkpoint_every == 0:
            sim.checkpoint()
        elif sim.uncovered and rng.random() < p_rewind:
            sim.rewind()
    if finish:
        b.finish_run()
    yield b
