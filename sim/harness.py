"""One simulated run: the real controller on a virtual clock with simulated workers.

``simulate(store, spec)`` opens a run in ``store`` with ``controller.startup.create_run``
(a real store: memory, or a real redis-server), stamps every later event with the
virtual clock, publishes the initial weights as ``reconcile_workers`` does, and runs
``controller.loop.Controller`` -- constructed through its public constructor with the
simulated workers of ``sim.workers`` -- until ``run.steps``; then appends
``RunFinished`` like ``rl-controller run``. What it returns is measured, not modelled:
virtual wall time, the simulated trainer's busy time, the real CPU the loop thread
spent (minus the simulated workers' own bookkeeping), events appended.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgspec

from controller.config import Config, config_to_dict
from controller.log_writer import LogWriter
from controller.loop import Controller
from controller.effects import publish_current
from controller.startup import create_run
from events import schema as ev
from events.store import EventStore
from sim.clock import VirtualTimeLoop
from sim.decode import DecodeCurve, LoadedDecode
from sim.episodes import SimEpisodeGenerator
from sim.timings import Timings
from sim.partial import SimPartialGenerator
from sim.workers import (
    Fleet,
    SimGenerator,
    SimGroupBoundaryGenerator,
    SimPayloads,
    SimPublisher,
    SimTrainer,
)

CODE_VERSION = "rl-controller simulate (virtual time)"


@dataclass(frozen=True)
class SimSpec:
    config: Config
    timings: Timings
    run_id: str
    #: virtual time of the first event the loop writes (a recorded run's first admission)
    start_s: float = 0.0
    #: add the loop's real time to the virtual clock (the controller is not free)
    charge_real_time: bool = False
    #: the watchdog's stall timeout (virtual seconds): a simulated deadlock ends there
    stall_timeout_s: float = 86_400.0
    #: live-group capacity of the admission gate instead of the config's (a what-if of a
    #: buffer the config validation would refuse: between groups_per_step and
    #: policies.full_capacity)
    capacity: int | None = None
    #: multi-turn episodes of this many turns (``sim.episodes``; needs rollout.partial);
    #: 0: single-turn rollouts
    episode_turns: int = 0
    #: whether the simulated episodes' env deduplicates by key (one pause per turn) or
    #: not (two: ``sim.episodes``)
    episode_dedupes: bool = True
    #: load-dependent decode speed (``sim.decode``): a group's drawn time holds at the
    #: curve's reference load and shrinks or grows with the sequences its server runs
    #: at once; None (the default): a group takes its drawn time whatever else runs
    decode: DecodeCurve | None = None

    def __post_init__(self) -> None:
        if self.decode is not None and not isinstance(self.decode, DecodeCurve):
            raise ValueError(f"sim.decode: a DecodeCurve or None, got {type(self.decode).__name__}")
        if self.decode is not None and self.episode_turns:
            # an episode's turns wait on the env as well as decode; their split is not modelled
            raise ValueError("sim.decode: covers single-turn rollouts; episode_turns must be 0")


@dataclass
class SimOutcome:
    writer: LogWriter
    #: virtual seconds from the loop's start to its end
    virtual_s: float
    #: real seconds the run took
    real_s: float
    #: loop-thread CPU seconds, minus the simulated workers' own bookkeeping
    controller_cpu_s: float
    trainer_busy_s: float
    refit_s: float
    checkpoint_s: float
    #: checkpoint writes that ran behind training (``checkpoint.async_save``)
    checkpoint_background_s: float
    generation_calls: int
    #: real seconds inside the simulated workers (not charged to the clock)
    workers_real_s: float
    #: loop-thread CPU seconds inside the simulated workers (not in ``controller_cpu_s``)
    workers_cpu_s: float = 0.0
    #: batches the loop appended (several events, and several groups' flushes, may share one)
    appends: int = 0

    @property
    def events(self) -> int:
        return self.writer.state.position


def refits_between_calls(cfg: Config) -> bool:
    """Whether the configured generators change weights only between calls: vLLM without
    chunks or partial rollouts (``docs/backends.md``); the torch sampler lands a refit
    between two tokens."""
    rollout = cfg.rollout
    vllm_whole_groups = rollout.backend == "vllm" and not rollout.vllm.chunk_tokens
    return vllm_whole_groups and not rollout.partial.enabled


def _generators(cfg: Config, spec: SimSpec, fleet: Fleet, names: list[str]) -> list:
    """The simulated generators the config asks for: episodes, partial rollouts, refits
    only between calls (vLLM without chunks), or the torch sampler."""
    partial = cfg.rollout.partial
    if spec.episode_turns and not partial.enabled:
        raise ValueError("sim: episodes are recorded by partial rollouts (rollout.partial.enabled)")
    if spec.episode_turns:
        return [SimEpisodeGenerator(n, fleet, spec.episode_turns, dedupes_by_key=spec.episode_dedupes)
                for n in names]
    if partial.enabled:
        return [SimPartialGenerator(n, fleet, partial.segment_tokens, partial.flush_on_refit) for n in names]
    if refits_between_calls(cfg):
        return [SimGroupBoundaryGenerator(n, fleet) for n in names]
    return [SimGenerator(n, fleet) for n in names]


def simulate(store: EventStore, spec: SimSpec) -> SimOutcome:
    cfg = spec.config
    writer = create_run(
        store, spec.run_id, config=config_to_dict(cfg), seed=cfg.run.seed,
        code_version=CODE_VERSION, window_versions=cfg.staleness.window_versions,
        groups_per_step=cfg.train.groups_per_step,
        samples_per_group=cfg.rollout.samples_per_group,
    )
    writer.snapshot_every = cfg.controller.snapshot_every_events
    writer.snapshot_events_per_mib = cfg.controller.snapshot_events_per_mib
    # The loop's clock starts at 0 (float resolution stays fine for years of virtual
    # time); the log's timestamps are offset to start at ``start_s``.
    loop = VirtualTimeLoop(charge_real_time=spec.charge_real_time)
    origin = spec.start_s
    writer.clock = lambda: origin + loop.time()  # every later event carries virtual time
    # The run's own config, with the watchdog's limit in virtual seconds and, for a
    # what-if buffer, the gate's capacity set past the config's validation.
    run_cfg = msgspec.structs.replace(
        cfg, controller=msgspec.structs.replace(cfg.controller, stall_timeout_s=spec.stall_timeout_s),
    )
    if spec.capacity is not None:
        # an attribute set, not a replace: ``Config.__post_init__`` would refuse the buffer
        run_cfg.staleness = msgspec.structs.replace(cfg.staleness, buffer_groups=spec.capacity)
    fleet = Fleet(loop=loop, timings=spec.timings,
                  decode=None if spec.decode is None else LoadedDecode(loop, spec.decode))
    names = [f"generator-{i}" for i in range(cfg.rollout.num_generators)]
    trainer = SimTrainer(fleet)
    generators = _generators(cfg, spec, fleet, names)
    waits_for = [g for g in generators if isinstance(g, SimGroupBoundaryGenerator)]
    publisher = SimPublisher(fleet, names, waits_for)
    controller = Controller(
        writer, run_cfg, trainer, generators, publisher,  # type: ignore[arg-type]
        SimPayloads(fleet, trainer), checkpoint_dir=f"sim-checkpoints/{spec.run_id}",
        clock=loop.time,
    )

    async def main() -> None:
        journal = controller.journal
        await publish_current(journal, publisher)  # as reconcile_workers ends
        await controller.run()
        await journal.append(journal.make(
            ev.RunFinished, event_id=ev.run_finished_id(writer.epoch, writer.position),
            reason="completed",
        ))

    appends = [0]
    writer.listeners.append(lambda batch, state: appends.__setitem__(0, appends[0] + 1))
    real0, cpu0 = time.perf_counter(), time.thread_time()
    with asyncio.Runner(loop_factory=lambda: loop) as runner:
        runner.run(main())
        virtual_s = loop.time()
    real_s, cpu_s = time.perf_counter() - real0, time.thread_time() - cpu0
    return SimOutcome(
        writer=writer,
        virtual_s=virtual_s,
        real_s=real_s,
        controller_cpu_s=max(0.0, cpu_s - loop.uncharged_cpu_s),
        trainer_busy_s=trainer.busy_s,
        refit_s=publisher.busy_s,
        checkpoint_s=trainer.checkpoint_s,
        checkpoint_background_s=trainer.checkpoint_background_s,
        generation_calls=fleet.calls,
        workers_real_s=loop.uncharged_s,
        workers_cpu_s=loop.uncharged_cpu_s,
        appends=appends[0],
    )
