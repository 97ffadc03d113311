"""The controller loop: three pumps over one log.

::

      admission pump                          generators (Ray actors / in-process)
      waits on: gate (policies.admission),    +-------------------------------+
                a free generator              | generate_groups -> data plane |
      RolloutAdmitted x n -- one call ------->|  returns keys, rewards,       |
            ^                                 |  weight versions start/end    |
            | wake                            +---------------+---------------+
            |                                                 |
            +------ GroupCommitted / GroupFailed <------------+
            |
      train pump
      waits on: a full microbatch (policies.plan_microbatch: evict, select), the trainer
      StepBegun -> begin_train_step
      [evict stale: GroupEvicted] select -> train_microbatch(keys) -> MicrobatchTrained  (x k)
      finish_train_step -> StepFinished -> publish weights -> WeightsPublished
                           (controller.publish = "behind": during the next step's begin
                            and microbatches; that step's finish waits for it)
      [every N: save_checkpoint -> CheckpointSaved -> delete rows -> PayloadsReleased]
            |
      watchdog
      waits on: nothing; fires when no event was appended for stall_timeout_s:
      aborts the open step and stops with what was waiting on what.

      (n <= rollout.groups_per_call admissions share one append and one call)

      a worker dies (WorkerLostError from a call)
      trainer:   StepAborted + WorkerLost -> restart -> recovery.bring_trainer_to_log
      generator: GroupFailed + WorkerLost -> restart -> publish current weights to it

      a generator call fails (any other error, e.g. the task's reward raises)
      GroupFailed x groups -> retry later; that generator backs off before its next call;
      failures.max_in_row groups failed in a row -> RunStopped -> RunStoppedError (exit 4)

``Controller`` only wires its collaborators together and runs the pumps; each is
built with exactly what it needs and they share one ``controller.journal.Journal``
(the log writer, the pumps' wake-up, the step timers):

==============================  =====================================================
``admission.AdmissionSide``     the admission pump, generator calls, commits, retries
``training.TrainSide``          the train pump: select, begin, microbatches, finish, abort
``step_close.StepClosing``      step metrics, StepFinished, publish, checkpoint, release
``worker_loss.WorkerLossHandling``  WorkerLost, restarts, bringing a worker back to the log
``Controller._watchdog``        the stall watchdog (reads what the others wait on)
==============================  =====================================================

Every decision is appended to the log *before* the side effect it announces (intent)
or *after* the side effect returned (fact) -- see docs/DESIGN.md, write-ahead protocol. The
loop owns no state of its own beyond timers: everything it decides on is
``journal.state``, the fold of what the log acknowledged.

Fencing: a newer controller's claim makes this one's next append raise
``FencedError``. Side effects that no append immediately precedes (a microbatch,
finishing a step, publishing, checkpointing, deleting rows) first check the run's
epoch, so a fenced controller stops without touching a worker again; on
``FencedError`` every pump and in-flight generation task is cancelled at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Callable

from controller.admission import AdmissionSide, OnFailure, RunStoppedError
from controller.journal import Journal, Timers
from controller.log_writer import LogWriter
from controller.step_close import OnStep, StepClosing
from controller.training import StallError, StepRetriesExhausted, TrainSide
from controller.worker_loss import WorkerLossHandling
from workers.api import (
    GeneratorClient,
    PayloadStore,
    TrainerClient,
    WeightPublisher,
    WorkerRestarter,
)

if TYPE_CHECKING:
    from controller.config import Config

__all__ = ["Controller", "RunStoppedError", "StallError", "StepRetriesExhausted"]


class Controller:
    def __init__(
        self,
        writer: LogWriter,
        cfg: Config,
        trainer: TrainerClient,
        generators: list[GeneratorClient],
        publisher: WeightPublisher,
        payloads: PayloadStore,
        *,
        checkpoint_dir: str,
        on_step: OnStep | None = None,
        clock: Callable[[], float] = time.monotonic,
        restarter: WorkerRestarter | None = None,
        on_failure: OnFailure | None = None,
        on_trainer_replaced: Callable[[str], None] | None = None,
    ) -> None:
        self.journal = Journal(writer, clock)
        self.stall_timeout_s = cfg.controller.stall_timeout_s
        self.loss = WorkerLossHandling(
            self.journal, trainer=trainer, generators=generators, publisher=publisher,
            payloads=payloads, restarter=restarter, on_trainer_replaced=on_trainer_replaced,
        )
        self.closing = StepClosing(
            self.journal, trainer=trainer, publisher=publisher, payloads=payloads,
            checkpoint=cfg.checkpoint, checkpoint_dir=checkpoint_dir,
            num_generators=len(generators), on_step=on_step,
        )
        self.admission = AdmissionSide(
            self.journal, generators=generators, loss=self.loss, rollout=cfg.rollout,
            staleness=cfg.staleness, groups_per_step=cfg.train.groups_per_step,
            target_version=cfg.run.steps, num_prompts=cfg.task.num_prompts, seed=cfg.run.seed,
            failures=cfg.failures, on_failure=on_failure,
            payloads=payloads,
        )
        self.training = TrainSide(
            self.journal, trainer=trainer, closing=self.closing, loss=self.loss,
            staleness=cfg.staleness, groups_per_step=cfg.train.groups_per_step,
            groups_per_microbatch=cfg.train.groups_per_microbatch,
            target_version=cfg.run.steps, step_retries=cfg.controller.step_retries,
            overlap_publish=cfg.controller.publish == "behind",
        )

    @property
    def state(self):
        return self.journal.state

    @property
    def timers(self) -> Timers:
        """The current step's clocks and counters (a new object after each StepFinished)."""
        return self.journal.timers

    async def run(self) -> str:
        """Train until trainer_version reaches the target; returns the finish reason."""
        fatal = self.admission.start()
        pumps = [
            asyncio.create_task(self.admission.pump(), name="admission"),
            asyncio.create_task(self.training.pump(), name="train"),
            asyncio.create_task(self._watchdog(), name="watchdog"),
        ]
        try:
            done, _ = await asyncio.wait([*pumps, fatal], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise a pump's error
        finally:
            # after a stall the in-flight generations are what hung: waiting for them to
            # commit would only hold the error back (their groups are redone on resume)
            stalled = any(t.done() and not t.cancelled() and isinstance(t.exception(), StallError)
                          for t in pumps)
            if fatal.done():
                fatal.exception()  # retrieved (raised above, or a pump's error won)
            else:
                fatal.cancel()
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            if self.journal.fenced is not None:
                self.admission.cancel_all()
            else:
                await self.admission.drain(timeout_s=0.0 if stalled else 30.0)
        await self.closing.wait_checkpoint()  # the last CheckpointSaved, once durable
        return "completed"

    async def _watchdog(self) -> None:
        """Abort the open step and stop when no event was appended for stall_timeout_s."""
        j, limit = self.journal, self.stall_timeout_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            idle = j.clock() - j.timers.last_progress
            if idle < limit:
                continue
            busy = {name: n for name, n in self.admission.busy.items() if n}
            parts = [
                f"no event for {idle:.0f}s (stall_timeout_s={limit:g})",
                self.training.waiting_for or "train pump busy in a trainer call",
                f"admission gate: {self.admission.gate_reason or 'open'}",
                f"generators busy: {busy or 'none'}",
                f"trainer_version {j.state.trainer_version}, "
                f"published v{j.state.weight_version}",
            ]
            await self.training.abort_open_step("stall watchdog")
            raise StallError("; ".join(parts))
