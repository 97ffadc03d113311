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
      waits on: enough selectable groups (policies.select), the trainer
      StepBegun -> begin_train_step
      [evict stale: GroupEvicted] select -> train_microbatch(keys) -> MicrobatchTrained  (x k)
      finish_train_step -> StepFinished -> publish weights -> WeightsPublished
      [every N: save_checkpoint -> CheckpointSaved -> delete rows -> PayloadsReleased]
            |
      watchdog
      waits on: nothing; fires when no event was appended for stall_timeout_s:
      aborts the open step and stops with what was waiting on what.

      (n <= rollout.groups_per_call admissions share one append and one call)

      a worker dies (WorkerLostError from a call)
      trainer:   StepAborted + WorkerLost -> restart -> recovery.bring_trainer_to_log
      generator: GroupFailed + WorkerLost -> restart -> publish current weights to it

The admission side (pump, generator calls, commits) is in ``controller.admission``;
step metrics, publishing and checkpoints in ``controller.step_close``; what happens
when a worker dies in ``controller.worker_loss``.

Every decision is appended to the log *before* the side effect it announces (intent)
or *after* the side effect returned (fact) -- see DESIGN.md, write-ahead protocol. The
loop owns no state of its own beyond timers: everything it decides on is
``writer.state``, the fold of what the log acknowledged.

Fencing: a newer controller's claim makes this one's next append raise
``FencedError``. Side effects that no append immediately precedes (a microbatch,
finishing a step, publishing, checkpointing, deleting rows) first check the run's
epoch, so a fenced controller stops without touching a worker again; on
``FencedError`` every pump and in-flight generation task is cancelled at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import structlog

from controller.core import policies
from workers.api import (
    GeneratorClient,
    MicrobatchRef,
    PayloadStore,
    TrainerClient,
    WeightPublisher,
)
from controller.admission import AdmissionSide
from controller.step_close import StepClosing, Timers
from controller.crashpoints import crash_point
from controller.log_writer import LogWriter
from workers.api import WorkerLostError, WorkerRestarter
from controller.core.state import GroupStatus
from controller.worker_loss import WorkerLossHandling
from events import schema as ev
from events.errors import FencedError

log = structlog.get_logger("rl_controller.loop")


class StallError(RuntimeError):
    """No progress for stall_timeout_s; the message says what was waiting on what."""


class StepRetriesExhausted(RuntimeError):
    pass


class _StepLost(RuntimeError):
    """The open step was aborted under the train pump (its trainer died elsewhere)."""


@dataclass(frozen=True)
class LoopSettings:
    target_version: int
    window_versions: int
    groups_per_step: int
    groups_per_microbatch: int
    samples_per_group: int
    selection: policies.SelectionPolicy
    capacity: int
    max_attempts: int
    num_prompts: int
    seed: int
    stall_timeout_s: float
    step_retries: int
    checkpoint_every: int
    retain_payloads: str
    checkpoint_dir: str
    #: concurrent calls per generator
    generator_slots: int = 1
    #: groups one generator call carries
    groups_per_call: int = 1


class Controller(AdmissionSide, StepClosing, WorkerLossHandling):
    def __init__(
        self,
        writer: LogWriter,
        settings: LoopSettings,
        trainer: TrainerClient,
        generators: list[GeneratorClient],
        publisher: WeightPublisher,
        payloads: PayloadStore,
        *,
        on_step: Callable[[int, int, dict[str, float]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        restarter: WorkerRestarter | None = None,
    ) -> None:
        self.w = writer
        self.s = settings
        self.trainer = trainer
        self.generators = generators
        self.publisher = publisher
        self.payloads = payloads
        self.on_step = on_step
        self.clock = clock
        self.restarter = restarter
        #: generators being replaced after a WorkerLost (admission skips them)
        self._restarting: set[str] = set()
        self._fatal: asyncio.Future | None = None
        #: the one trainer replacement in progress (both pumps may see the death)
        self._trainer_recovery: asyncio.Task | None = None
        self.t = Timers()
        self._wake = asyncio.Event()
        self._busy: dict[str, int] = {g.name: 0 for g in generators}
        self._tasks: set[asyncio.Task] = set()
        self._retry_queue: list[str] = []
        self._aborts_in_row = 0
        self._gate_reason = ""
        self._waiting_for = ""
        #: groups consumed by steps finished in this controller's lifetime
        self._consumed_groups = 0

    # -- plumbing -------------------------------------------------------------

    @property
    def state(self):
        return self.w.state

    def _append(self, *events: ev.Event) -> None:
        self.w.append(*events)
        self._progressed()

    def _progressed(self) -> None:
        """Something was appended (here or by a ``recovery`` helper): wake the pumps."""
        self.t.last_progress = self.clock()
        self._wake.set()

    def _ensure_owner(self) -> None:
        """Raise FencedError if a newer controller claimed the run (before a side effect)."""
        if self.w.fenced is not None:
            raise self.w.fenced
        current = self.w.store.current_epoch(self.w.run_id)
        if current != self.w.epoch:
            self.w.fenced = FencedError(self.w.run_id, self.w.epoch, current)
            raise self.w.fenced

    def _stop_with(self, err: BaseException) -> None:
        """A task outside the pumps hit a fatal error: stop the run with it."""
        if self._fatal is not None and not self._fatal.done():
            self._fatal.set_exception(err)

    async def _wait_wake(self, timeout_s: float = 0.5) -> None:
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
        # that races with the event being set, and a pump would then never stop.
        self._wake.clear()
        try:
            async with asyncio.timeout(timeout_s):
                await self._wake.wait()
        except TimeoutError:
            pass

    # -- the run ----------------------------------------------------------------

    async def run(self) -> str:
        """Train until trainer_version reaches the target; returns the finish reason."""
        self._retry_queue = [
            g.group_id for g in self.state.groups.values()
            if g.status is GroupStatus.FAILED and g.attempt < self.s.max_attempts
        ]
        self._fatal = asyncio.get_running_loop().create_future()
        pumps = [
            asyncio.create_task(self._admission_pump(), name="admission"),
            asyncio.create_task(self._train_pump(), name="train"),
            asyncio.create_task(self._watchdog(), name="watchdog"),
        ]
        try:
            done, _ = await asyncio.wait([*pumps, self._fatal], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise a pump's error
        finally:
            if self._fatal.done():
                self._fatal.exception()  # retrieved (raised above, or a pump's error won)
            else:
                self._fatal.cancel()
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            if self.w.fenced is not None:
                # Fenced: nothing these generations return may be logged or acted on.
                for task in list(self._tasks):
                    task.cancel()
            else:
                await self._drain_generations()
        return "completed"

    async def _drain_generations(self, timeout_s: float = 30.0) -> None:
        """Let in-flight generations commit (their groups stay buffered for a resume)."""
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()

    # -- training -----------------------------------------------------------------

    async def _train_pump(self) -> None:
        while self.state.trainer_version < self.s.target_version:
            try:
                await self._train_one_step()
                self._aborts_in_row = 0
            except (FencedError, StallError, asyncio.CancelledError):
                raise
            except _StepLost:
                continue  # already aborted and recorded by the trainer's replacement
            except WorkerLostError as err:
                if err.role == "trainer":
                    await self._trainer_lost(err)
                else:  # a generator died while weights were published to it
                    await self._replace_generator(self._generator(err.worker), err, publish_all=True)
            except Exception as err:
                await self._abort_open_step(f"worker error: {type(err).__name__}: {err}")
                self._aborts_in_row += 1
                if self._aborts_in_row > self.s.step_retries:
                    raise StepRetriesExhausted(
                        f"{self._aborts_in_row} steps in a row aborted; last error: {err}"
                    ) from err

    async def _train_one_step(self) -> None:
        first = await self._select_microbatch()
        await self._trainer_ready()
        step = self.state.next_step
        base = self.state.trainer_version
        self._append(
            self.w.make(
                ev.StepBegun,
                event_id=ev.step_event_id(step, "begun"),
                step=step,
                base_trainer_version=base,
            )
        )
        crash_point("after_step_begun", step)
        await self._timed_trainer(self.trainer.begin_train_step(step))
        crash_point("after_begin_train_step", step)
        ids: list[str] | None = first
        while True:
            await self._train_microbatch(step, ids)
            if self._claimed_count() >= self.s.groups_per_step:
                break
            ids = await self._select_microbatch()
        await self._finish_step(step, base)

    def _claimed_count(self) -> int:
        open_step = self.state.open_step
        return 0 if open_step is None else sum(len(mb) for mb in open_step.microbatches)

    async def _select_microbatch(self) -> list[str]:
        """Evict what is too stale, then wait until a full microbatch is selectable."""
        want = min(self.s.groups_per_microbatch, self.s.groups_per_step - self._claimed_count())
        waited_from = self.clock()
        while True:
            self._evict_stale()
            ids = policies.select(self.state, self.s.selection, want)
            if len(ids) == want:
                self.t.data_wait += self.clock() - waited_from
                self._waiting_for = ""
                return ids
            self._waiting_for = (
                f"train pump waiting for {want} selectable groups ({len(ids)} ready under "
                f"'{self.s.selection}', {len(self.state.buffer)} buffered, "
                f"{len(self.state.admitted)} in flight)"
            )
            await self._wait_wake()

    def _evict_stale(self) -> None:
        stale = policies.to_evict(
            self.state, trainer_version=self.state.trainer_version, window=self.s.window_versions
        )
        for group_id, lag in stale:
            self._append(
                self.w.make(
                    ev.GroupEvicted,
                    event_id=ev.group_event_id(group_id, "evicted"),
                    group_id=group_id,
                    reason=f"lag {lag} > window {self.s.window_versions}",
                    lag=lag,
                )
            )
            crash_point("after_group_evicted", group_id)
            self.t.evicted += 1

    async def _train_microbatch(self, step: int, ids: list[str]) -> None:
        keys: list[str] = []
        advantages: list[float] = []
        for gid in ids:
            group = self.state.groups[gid]
            adv, zero_var = policies.group_advantages(group.rewards)
            self.t.zero_variance += zero_var
            keys.extend(group.payload_keys)
            advantages.extend(adv)
        if self.state.open_step is None or self.state.open_step.step != step:
            raise _StepLost(step)
        index = len(self.state.open_step.microbatches)
        self._ensure_owner()
        out = await self._timed_trainer(
            self.trainer.train_microbatch(MicrobatchRef(payload_keys=keys, advantages=advantages))
        )
        crash_point("before_microbatch_trained", step)
        self._append(
            self.w.make(
                ev.MicrobatchTrained,
                event_id=ev.microbatch_event_id(step, index),
                step=step,
                index=index,
                group_ids=ids,
                num_sequences=out.num_sequences,
                num_tokens=out.num_tokens,
            )
        )
        crash_point("after_microbatch_trained", step)

    async def _finish_step(self, step: int, base: int) -> None:
        if self.state.open_step is None or self.state.open_step.step != step:
            raise _StepLost(step)
        group_ids = [g for mb in self.state.open_step.microbatches for g in mb]
        self._ensure_owner()
        result = await self._timed_trainer(self.trainer.finish_train_step())
        if result.trainer_version != base + 1:
            raise RuntimeError(
                f"trainer reports version {result.trainer_version} after step {step}; "
                f"the log expects {base + 1}"
            )
        metrics = {**result.metrics, **self._step_metrics(group_ids)}
        crash_point("before_step_finished", step)
        self._append(
            self.w.make(
                ev.StepFinished,
                event_id=ev.step_event_id(step, "finished"),
                step=step,
                trainer_version=result.trainer_version,
                metrics=metrics,
                grad_norm=result.grad_norm,
                weights_digest=result.weights_digest,
            )
        )
        crash_point("after_step_finished", step)
        self._consumed_groups += len(group_ids)
        if self.on_step is not None:
            self.on_step(step, result.trainer_version, metrics)
        await self._publish(result.trainer_version)
        if result.trainer_version % self.s.checkpoint_every == 0:
            await self.checkpoint_and_release(result.trainer_version)

    async def _timed_trainer(self, call):
        started = self.clock()
        try:
            return await call
        finally:
            self.t.trainer_busy += self.clock() - started

    async def _abort_open_step(self, reason: str) -> None:
        # The fact first: if this controller is fenced the append raises and the
        # trainer (possibly the new owner's) is not touched.
        open_step = self.state.open_step
        if open_step is not None:
            self._append(
                self.w.make(
                    ev.StepAborted,
                    event_id=ev.step_event_id(open_step.step, "aborted"),
                    step=open_step.step,
                    reason=reason[:500],
                )
            )
            crash_point("after_step_aborted", open_step.step)
        else:
            self._ensure_owner()
        try:
            await self.trainer.abort_train_step()
        except Exception as err:  # the trainer is gone; the log has the fact
            log.error("abort_failed", error=str(err))
        log.warning("step_aborted", reason=reason)

    # -- watchdog -----------------------------------------------------------------

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.s.stall_timeout_s / 4))
            idle = self.clock() - self.t.last_progress
            if idle < self.s.stall_timeout_s:
                continue
            busy = {name: n for name, n in self._busy.items() if n}
            parts = [
                f"no event for {idle:.0f}s (stall_timeout_s={self.s.stall_timeout_s:g})",
                self._waiting_for or "train pump busy in a trainer call",
                f"admission gate: {self._gate_reason or 'open'}",
                f"generators busy: {busy or 'none'}",
                f"trainer_version {self.state.trainer_version}, "
                f"published v{self.state.weight_version}",
            ]
            await self._abort_open_step("stall watchdog")
            raise StallError("; ".join(parts))
