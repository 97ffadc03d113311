"""What the controller does when a worker dies mid-run.

A call that reports ``WorkerLostError`` is turned into facts and a replacement:
``WorkerLost`` (and ``StepAborted`` for the open step when it was the trainer), a
restarted actor, and the actor brought back to the log -- the trainer by checkpoint
plus exact re-training (``recovery.bring_trainer_to_log``), a generator by publishing
the current weights to it. Whoever notices a trainer's death first starts the one
replacement; every other caller waits for it.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import structlog

from controller import effects, recovery
from controller.core import decisions
from controller.journal import Journal
from events import schema as ev
from workers.api import (
    GeneratorClient,
    PayloadStore,
    Replaceable,
    TrainerClient,
    WeightPublisher,
    WorkerLostError,
    WorkerRestarter,
)

log = structlog.get_logger("rl_controller.loop")


class WorkerLossHandling:
    """Records a dead worker, restarts it and brings it back to the log."""

    def __init__(
        self,
        journal: Journal,
        *,
        trainer: TrainerClient,
        generators: list[GeneratorClient],
        publisher: WeightPublisher,
        payloads: PayloadStore,
        restarter: WorkerRestarter | None,
        on_trainer_replaced: Callable[[str], None] | None = None,
    ) -> None:
        self.journal = journal
        #: told, in one line, of each trainer death once its replacement holds the
        #: log's weights (a generator's shows as its failed call)
        self.on_trainer_replaced = on_trainer_replaced
        self.trainer = trainer
        self.generators = generators
        self.publisher = publisher
        self.payloads = payloads
        self.restarter = restarter
        #: generators being replaced (admission skips them)
        self.restarting: set[str] = set()
        #: the one trainer replacement in progress (both pumps may see the death)
        self._trainer_recovery: asyncio.Task | None = None

    def generator(self, name: str) -> GeneratorClient:
        return next(g for g in self.generators if g.name == name)

    async def replace_generator(
        self, gen: GeneratorClient, err: WorkerLostError, *, publish_all: bool = False
    ) -> None:
        """Record the loss, restart the generator, give it the current weights."""
        if gen.name in self.restarting:
            return  # another of its calls saw the same death first
        if self.restarter is None:
            raise err
        j = self.journal
        self.restarting.add(gen.name)
        try:
            await j.append(self._worker_lost(err))
            await self.restarter.restart_generator(gen.name)
            while True:
                await self.trainer_ready()
                j.ensure_owner()
                try:
                    await effects.publish_current(
                        j, self.publisher, only=None if publish_all else [gen.name]
                    )
                    break
                except WorkerLostError as lost:
                    if lost.role != "trainer":
                        raise
                    await self.trainer_lost(lost)  # weights come from the trainer
        finally:
            self.restarting.discard(gen.name)
        j.wake()

    def _worker_lost(self, err: WorkerLostError) -> ev.WorkerLost:
        return decisions.worker_lost(err.worker, err.role, err.reason, self.journal.stamp())

    def trainer_lost(self, err: WorkerLostError) -> asyncio.Task:
        """The one replacement of the dead trainer (whoever noticed first starts it)."""
        task = self._trainer_recovery
        if task is None or (task.done() and not self._failed_handle_is_current(err)):
            task = asyncio.create_task(self._replace_trainer(err), name="trainer-recovery")
            self._trainer_recovery = task
        return task

    def _failed_handle_is_current(self, err: WorkerLostError) -> bool:
        # A death reported by a call on an already replaced handle is old news.
        if not isinstance(self.trainer, Replaceable):
            return True  # nothing swaps this trainer: its death is always news
        return self.trainer.handle is err.handle

    async def trainer_ready(self) -> None:
        """Wait for a trainer replacement in progress (returns at once when none is)."""
        if self._trainer_recovery is not None and not self._trainer_recovery.done():
            await self._trainer_recovery

    async def _replace_trainer(self, err: WorkerLostError) -> None:
        """The trainer died: record it, restart it, rebuild its weights from the log."""
        if self.restarter is None:
            raise err
        j = self.journal
        at = j.stamp()
        aborted = decisions.step_aborted(j.state, str(err), at)  # "trainer lost: <cause>"
        await j.append(*([aborted] if aborted else []), self._worker_lost(err))
        log.warning("worker_lost", worker=err.worker, role=err.role, reason=err.reason)
        await self.restarter.restart_trainer()
        j.ensure_owner()
        await recovery.bring_trainer_to_log(j, self.trainer, self.payloads)
        if j.state.weight_version < j.state.trainer_version:
            await effects.publish_current(j, self.publisher)
        if self.on_trainer_replaced is not None:
            cause = err.reason.strip().splitlines()[0] if err.reason.strip() else "no reason given"
            self.on_trainer_replaced(
                f"trainer lost ({cause}): replaced, its weights rebuilt from the log to "
                f"trainer_version {j.state.trainer_version}"
                + (f"; step {aborted.step} aborted, its groups back in the buffer" if aborted else "")
            )
