"""What the controller does when a worker dies mid-run (a part of ``Controller``).

A call that reports ``WorkerLostError`` is turned into facts and a replacement:
``WorkerLost`` (and ``StepAborted`` for the open step when it was the trainer), a
restarted actor, and the actor brought back to the log -- the trainer by checkpoint
plus exact re-training (``recovery.bring_trainer_to_log``), a generator by publishing
the current weights to it. Whoever notices a trainer's death first starts the one
replacement; every other caller waits for it.
"""

from __future__ import annotations

import asyncio

import structlog

from controller import recovery
from workers.api import GeneratorClient
from controller.crashpoints import crash_point
from workers.api import WorkerLostError
from events import schema as ev

log = structlog.get_logger("rl_controller.loop")


class WorkerLossHandling:
    """Mixed into ``controller.loop.Controller``; uses its writer, workers and pumps."""

    def _generator(self, name: str) -> GeneratorClient:
        return next(g for g in self.generators if g.name == name)

    async def _replace_generator(
        self, gen: GeneratorClient, err: WorkerLostError, *, publish_all: bool = False
    ) -> None:
        """Record the loss, restart the generator, give it the current weights."""
        if gen.name in self._restarting:
            return  # another of its calls saw the same death first
        if self.restarter is None:
            raise err
        self._restarting.add(gen.name)
        try:
            self._append(self._worker_lost(err))
            crash_point("after_worker_lost", gen.name)
            await self.restarter.restart_generator(gen.name)
            while True:
                await self._trainer_ready()
                self._ensure_owner()
                try:
                    await recovery.publish_current(
                        self.w, self.publisher, only=None if publish_all else [gen.name]
                    )
                    self._progressed()
                    break
                except WorkerLostError as lost:
                    if lost.role != "trainer":
                        raise
                    await self._trainer_lost(lost)  # weights come from the trainer
        finally:
            self._restarting.discard(gen.name)
        self._wake.set()

    def _worker_lost(self, err: WorkerLostError) -> ev.WorkerLost:
        return self.w.make(
            ev.WorkerLost,
            event_id=f"worker:{err.worker}:lost:e{self.w.epoch}:p{self.w.position}",
            worker=err.worker,
            role=err.role,
            reason=err.reason[:500],
        )

    def _trainer_lost(self, err: WorkerLostError) -> asyncio.Task:
        """The one replacement of the dead trainer (whoever noticed first starts it)."""
        task = self._trainer_recovery
        if task is None or (task.done() and not self._failed_handle_is_current(err)):
            task = asyncio.create_task(self._replace_trainer(err), name="trainer-recovery")
            self._trainer_recovery = task
        return task

    def _failed_handle_is_current(self, err: WorkerLostError) -> bool:
        # A death reported by a call on an already replaced handle is old news.
        return getattr(self.trainer, "handle", None) is getattr(err, "handle", None)

    async def _trainer_ready(self) -> None:
        if self._trainer_recovery is not None and not self._trainer_recovery.done():
            await self._trainer_recovery

    async def _replace_trainer(self, err: WorkerLostError) -> None:
        """The trainer died: record it, restart it, rebuild its weights from the log."""
        if self.restarter is None:
            raise err
        events: list[ev.Event] = []
        if self.state.open_step is not None:
            step = self.state.open_step.step
            events.append(self.w.make(
                ev.StepAborted, event_id=ev.step_event_id(step, "aborted"), step=step,
                reason=f"worker lost: {err}"[:500],
            ))
        self._append(*events, self._worker_lost(err))
        if events:
            crash_point("after_step_aborted", events[0].step)
        crash_point("after_worker_lost", err.worker)
        log.warning("worker_lost", worker=err.worker, role=err.role, reason=err.reason)
        await self.restarter.restart_trainer()
        self._ensure_owner()
        await recovery.bring_trainer_to_log(self.w, self.trainer, self.payloads)
        self._progressed()
        if self.state.weight_version < self.state.trainer_version:
            await recovery.publish_current(self.w, self.publisher)
            self._progressed()

