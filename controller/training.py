"""The train side of the controller loop: one step after another.

For each step: wait for a full first microbatch (``policies.plan_microbatch``: evict
what is too stale, select, claim), append ``StepBegun`` (intent), begin the trainer's
step, then train microbatch after microbatch -- each recorded as ``MicrobatchTrained``
after the trainer returned -- until the step holds ``groups_per_step`` groups, finish
it and hand it to ``controller.step_close``. A failing step is aborted
(``StepAborted``) and retried up to ``controller.step_retries`` times in a row; a dead
trainer is replaced by ``controller.worker_loss``.

Publishing may overlap the next step::

    step k:   ... finish -> StepFinished(v) --+-- publish v to the generators --> WeightsPublished(v)
    step k+1:                                 +-- select, StepBegun, microbatches ...  | wait | finish

The trainer's weights change only in ``finish_train_step``, so version v can travel to
the generators while the next step begins and trains its microbatches; that step's
finish waits until v is published (one publish in flight at most, and the published
weights are exactly v's). A step that checkpoints, and the run's last step, publish in
line as before: the checkpoint is taken after the publish, and a run ends published.
That is ``controller.publish = "behind"``; the default, ``"in_line"``
(``overlap_publish=False`` here), publishes every version before the next step begins.
"""

from __future__ import annotations

import asyncio

import structlog

from controller.core import decisions, policies
from controller.core.policies import StalenessSection
from controller.crashpoints import crash_point
from controller.journal import Journal
from controller.step_close import StepClosing
from controller.worker_loss import WorkerLossHandling
from events import schema as ev
from events.errors import ConcurrencyError, FencedError, StoreUnavailableError
from workers.api import MicrobatchRef, StepOutcome, TrainerClient, WorkerLostError, error_line

log = structlog.get_logger("rl_controller.loop")


class StallError(RuntimeError):
    """No progress for stall_timeout_s; the message says what was waiting on what."""


class StepRetriesExhausted(RuntimeError):
    pass


class _StepLost(RuntimeError):
    """The open step was aborted under the train pump (its trainer died elsewhere)."""


class TrainSide:
    """The train pump: select, begin, train microbatches, finish; abort on failure."""

    def __init__(
        self,
        journal: Journal,
        *,
        trainer: TrainerClient,
        closing: StepClosing,
        loss: WorkerLossHandling,
        staleness: StalenessSection,
        groups_per_step: int,
        groups_per_microbatch: int,
        target_version: int,
        step_retries: int,
        overlap_publish: bool = False,
    ) -> None:
        self.journal = journal
        self.trainer = trainer
        self.closing = closing
        self.loss = loss
        self.staleness = staleness
        self.groups_per_step = groups_per_step
        self.groups_per_microbatch = min(groups_per_microbatch, groups_per_step)
        self.target_version = target_version
        self.step_retries = step_retries
        self.overlap_publish = overlap_publish
        #: what the pump waits for ("" while it is in a trainer call), for the watchdog
        self.waiting_for = ""
        self._aborts_in_row = 0
        #: the publish of the last finished version, while it runs behind the next step
        self._publishing: asyncio.Task | None = None

    async def pump(self) -> None:
        try:
            await self._pump()
        finally:
            if self._publishing is not None:  # the pump failed or was cancelled
                self._publishing.cancel()

    async def _pump(self) -> None:
        while self.journal.state.trainer_version < self.target_version:
            try:
                await self._train_one_step()
                self._aborts_in_row = 0
            except (FencedError, ConcurrencyError, StoreUnavailableError, StallError,
                    asyncio.CancelledError):
                # the log is another controller's, it lost what we appended, or the store
                # stayed away past the journal's retries (whose last batch may have
                # landed: an abort appended after it would be refused): final
                raise
            except _StepLost:
                continue  # already aborted and recorded by the trainer's replacement
            except WorkerLostError as err:
                await self._worker_lost(err)
            except Exception as err:
                await self.abort_open_step(f"worker error: {error_line(err)}")
                self._aborts_in_row += 1
                if self._aborts_in_row > self.step_retries:
                    raise StepRetriesExhausted(
                        f"{self._aborts_in_row} steps in a row aborted; last error: {err}"
                    ) from err

    async def _train_one_step(self) -> None:
        j = self.journal
        first = await self._select_microbatch()
        await self.loss.trainer_ready()
        step = j.state.next_step
        base = j.state.trainer_version
        await j.append(
            j.make(
                ev.StepBegun,
                event_id=ev.step_event_id(step, "begun"),
                step=step,
                base_trainer_version=base,
            )
        )
        await self._timed_trainer(self.trainer.begin_train_step(step))
        crash_point("after_begin_train_step", step)
        ids: list[str] = first
        while True:
            await self._train_microbatch(step, ids)
            if policies.claimed_count(j.state) >= self.groups_per_step:
                break
            ids = await self._select_microbatch()
        await self._finish_step(step, base)

    async def _select_microbatch(self) -> list[str]:
        """Evict what is too stale, then wait until a full microbatch is selectable."""
        j = self.journal
        waited_from = j.clock()
        while True:
            if self._publishing is not None and self._publishing.done():
                await self._publish_settled()  # re-raises what the publish could not handle
            plan = policies.plan_microbatch(
                j.state,
                window=self.staleness.window_versions,
                selection=self.staleness.selection,
                groups_per_step=self.groups_per_step,
                groups_per_microbatch=self.groups_per_microbatch,
                at=j.stamp(),
            )
            if plan.evictions:
                await j.append(*plan.evictions)
                j.timers.evicted += len(plan.evictions)
            if plan.ready:
                j.timers.data_wait += j.clock() - waited_from
                self.waiting_for = ""
                return list(plan.group_ids)
            self.waiting_for = (
                f"train pump waiting for {plan.want} selectable groups ({len(plan.group_ids)} "
                f"ready under '{self.staleness.selection}', {len(j.state.buffer)} buffered, "
                f"{len(j.state.admitted)} in flight)"
            )
            await j.wait_wake()

    async def _train_microbatch(self, step: int, ids: list[str]) -> None:
        j = self.journal
        keys, advantages, zero_variance = policies.microbatch_advantages(j.state, ids)
        j.timers.zero_variance += zero_variance
        open_step = j.state.open_step
        if open_step is None or open_step.step != step:
            raise _StepLost(step)
        index = len(open_step.microbatches)
        j.ensure_owner()
        versions = policies.microbatch_versions(j.state, ids)
        ref = MicrobatchRef(payload_keys=keys, advantages=advantages, versions=versions,
                            turn_advantages=policies.microbatch_turn_advantages(j.state, ids))
        out = await self._timed_trainer(self.trainer.train_microbatch(ref))
        crash_point("before_microbatch_trained", step)
        await j.append(
            j.make(
                ev.MicrobatchTrained,
                event_id=ev.microbatch_event_id(step, index),
                step=step,
                index=index,
                group_ids=ids,
                num_sequences=out.num_sequences,
                num_tokens=out.num_tokens,
            )
        )

    async def _finish_step(self, step: int, base: int) -> None:
        j = self.journal
        open_step = j.state.open_step
        if open_step is None or open_step.step != step:
            raise _StepLost(step)
        group_ids = [g for mb in open_step.microbatches for g in mb]
        if self._publishing is not None:
            # finish changes the weights: the version being published must be out first
            self.waiting_for = f"train pump waiting for the publish of v{j.state.trainer_version}"
            await self._publish_settled()
            self.waiting_for = ""
            open_step = j.state.open_step
            if open_step is None or open_step.step != step:
                raise _StepLost(step)  # a trainer loss seen by the publish aborted it
        j.ensure_owner()
        result = await self._timed_trainer(self.trainer.finish_train_step())
        if result.trainer_version != base + 1:
            raise RuntimeError(
                f"trainer reports version {result.trainer_version} after step {step}; "
                f"the log expects {base + 1}"
            )
        await self._close(step, result, group_ids)

    async def _close(self, step: int, result: StepOutcome, group_ids: list[str]) -> None:
        closing, version = self.closing, result.trainer_version
        behind = (
            self.overlap_publish
            and version < self.target_version
            and not closing.checkpoint_due(version)
        )
        if not behind:
            # not a trainer call: a stall here is a publish (or the checkpoint after it)
            self.waiting_for = f"train pump publishing v{version} in line (then a due checkpoint)"
            try:
                await closing.close(step, result, group_ids)  # record, publish, checkpoint
            finally:
                self.waiting_for = ""
            return
        await closing.record(step, result, group_ids)
        self._publishing = asyncio.create_task(
            self._publish_behind(version), name=f"publish-v{version}"
        )

    async def _publish_behind(self, version: int) -> None:
        """Publish ``version`` while the pump goes on; a lost worker is handled here, as
        the pump would have handled it had the publish been in line."""
        try:
            await self.closing.publish(version)
        except WorkerLostError as err:
            await self._worker_lost(err)
        finally:
            self.journal.wake()  # a pump waiting for data re-checks this task

    async def _worker_lost(self, err: WorkerLostError) -> None:
        if err.role == "trainer":
            await self.loss.trainer_lost(err)
        else:  # a generator died while weights were published to it
            await self.loss.replace_generator(
                self.loss.generator(err.worker), err, publish_all=True
            )

    async def _publish_settled(self) -> None:
        task, self._publishing = self._publishing, None
        if task is not None:
            await task

    async def _timed_trainer(self, call):
        j = self.journal
        started = j.clock()
        try:
            return await call
        finally:
            j.timers.trainer_busy += j.clock() - started

    async def abort_open_step(self, reason: str) -> None:
        # The fact first: if this controller is fenced the append raises and the
        # trainer (possibly the new owner's) is not touched.
        j = self.journal
        aborted = decisions.step_aborted(j.state, reason, j.stamp())
        if aborted is not None:
            await j.append(aborted)
        else:
            j.ensure_owner()
        try:
            await self.trainer.abort_train_step()
        except Exception as err:  # the trainer is gone; the log has the fact
            log.error("abort_failed", error=str(err))
        log.warning("step_aborted", reason=reason)
