"""The controller loop: three pumps over one log.

::

      admission pump                          generators (Ray actors / in-process)
      waits on: gate (policies.admission),    +-------------------------------+
                a free generator              | generate_group -> data plane  |
      RolloutAdmitted --- dispatch ---------->|  returns keys, rewards,       |
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

Every decision is appended to the log *before* the side effect it announces (intent)
or *after* the side effect returned (fact) -- see DESIGN.md, write-ahead protocol. The
loop owns no state of its own beyond timers: everything it decides on is
``writer.state``, the fold of what the log acknowledged.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

import structlog

from controller import policies
from controller.clients import (
    GenerationOutcome,
    GenerationRequest,
    GeneratorClient,
    MicrobatchRef,
    PayloadStore,
    TrainerClient,
    WeightPublisher,
)
from controller.crashpoints import crash_point
from controller.log_writer import LogWriter
from controller.state import GroupStatus
from controller.step_metrics import consumed_group_stats
from events import schema as ev
from events.errors import FencedError

log = structlog.get_logger("rl_controller.loop")


class StallError(RuntimeError):
    """No progress for stall_timeout_s; the message says what was waiting on what."""


class StepRetriesExhausted(RuntimeError):
    pass


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
    #: concurrent groups per generator
    generator_slots: int = 1


@dataclass
class _Timers:
    started: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    trainer_busy: float = 0.0
    data_wait: float = 0.0
    generator_busy: float = 0.0
    step_started: float = field(default_factory=time.monotonic)
    evicted: int = 0
    failed: int = 0
    zero_variance: int = 0


def sample_seed(run_seed: int, prompt_index: int, attempt: int) -> int:
    """Deterministic per-group sampling seed (no global RNG anywhere)."""
    return (run_seed * 1_000_003 + prompt_index * 7_919 + attempt * 104_729) % (2**31 - 1)


class Controller:
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
    ) -> None:
        self.w = writer
        self.s = settings
        self.trainer = trainer
        self.generators = generators
        self.publisher = publisher
        self.payloads = payloads
        self.on_step = on_step
        self.clock = clock
        self.t = _Timers()
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
        self.t.last_progress = self.clock()
        self._wake.set()

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
        pumps = [
            asyncio.create_task(self._admission_pump(), name="admission"),
            asyncio.create_task(self._train_pump(), name="train"),
            asyncio.create_task(self._watchdog(), name="watchdog"),
        ]
        try:
            done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise a pump's error
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await self._drain_generations()
        return "completed"

    async def _drain_generations(self, timeout_s: float = 30.0) -> None:
        """Let in-flight generations commit (their groups stay buffered for a resume)."""
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()

    # -- admission ----------------------------------------------------------------

    def _free_generator(self) -> GeneratorClient | None:
        for gen in self.generators:
            if self._busy[gen.name] < self.s.generator_slots:
                return gen
        return None

    async def _admission_pump(self) -> None:
        while True:
            gate = policies.admission(
                self.state,
                dispatch_version=self.state.weight_version,
                window=self.s.window_versions,
                groups_per_step=self.s.groups_per_step,
                capacity=self.s.capacity,
            )
            self._gate_reason = gate.reason
            gen = self._free_generator() if gate.allowed else None
            if gen is None or self.state.trainer_version >= self.s.target_version:
                await self._wait_wake()
                continue
            self._dispatch(gen, self._next_admission())

    def _next_admission(self) -> ev.RolloutAdmitted:
        if self._retry_queue:
            prev = self.state.groups[self._retry_queue.pop(0)]
            group_id, index, attempt = prev.group_id, prev.prompt_index, prev.attempt + 1
        else:
            index = len(self.state.groups)
            group_id, attempt = f"g{index:06d}", 1
        prompt_index = index % self.s.num_prompts
        return self.w.make(
            ev.RolloutAdmitted,
            event_id=ev.group_event_id(group_id, "admitted", attempt),
            group_id=group_id,
            attempt=attempt,
            prompt_index=prompt_index,
            prompt_ref=f"prompt:{prompt_index}",
            weight_version=self.state.weight_version,
            n_samples=self.s.samples_per_group,
            sample_seed=sample_seed(self.s.seed, index, attempt),
        )

    def _dispatch(self, gen: GeneratorClient, admitted: ev.RolloutAdmitted) -> None:
        self._append(admitted)  # intent before the side effect
        crash_point("after_rollout_admitted", admitted.group_id)
        request = GenerationRequest(
            group_id=admitted.group_id,
            attempt=admitted.attempt,
            prompt_index=admitted.prompt_index,
            n_samples=admitted.n_samples,
            seed=admitted.sample_seed,
        )
        self._busy[gen.name] += 1
        task = asyncio.create_task(self._generate(gen, request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _generate(self, gen: GeneratorClient, req: GenerationRequest) -> None:
        started = self.clock()
        try:
            outcome = await gen.generate(req)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a worker failure is data, not a crash
            self._busy[gen.name] -= 1
            self._on_generation_failed(req, f"{gen.name}: {type(err).__name__}: {err}")
            return
        self._busy[gen.name] -= 1
        self.t.generator_busy += self.clock() - started
        self._commit(req, outcome)

    def _commit(self, req: GenerationRequest, out: GenerationOutcome) -> None:
        crash_point("before_group_committed", req.group_id)
        self._append(
            self.w.make(
                ev.GroupCommitted,
                event_id=ev.group_event_id(req.group_id, "committed", req.attempt),
                group_id=req.group_id,
                attempt=req.attempt,
                weight_version_start=out.weight_version_start,
                weight_version_end=out.weight_version_end,
                payload_keys=list(out.payload_keys),
                rewards=list(out.rewards),
                lengths=list(out.lengths),
            )
        )
        crash_point("after_group_committed", req.group_id)

    def _on_generation_failed(self, req: GenerationRequest, reason: str) -> None:
        log.warning("generation_failed", group_id=req.group_id, attempt=req.attempt, reason=reason)
        self._append(
            self.w.make(
                ev.GroupFailed,
                event_id=ev.group_event_id(req.group_id, "failed", req.attempt),
                group_id=req.group_id,
                attempt=req.attempt,
                reason=reason[:500],
            )
        )
        self.t.failed += 1
        if req.attempt < self.s.max_attempts:
            self._retry_queue.append(req.group_id)

    # -- training -----------------------------------------------------------------

    async def _train_pump(self) -> None:
        while self.state.trainer_version < self.s.target_version:
            try:
                await self._train_one_step()
                self._aborts_in_row = 0
            except (FencedError, StallError, asyncio.CancelledError):
                raise
            except Exception as err:
                await self._abort_open_step(f"worker error: {type(err).__name__}: {err}")
                self._aborts_in_row += 1
                if self._aborts_in_row > self.s.step_retries:
                    raise StepRetriesExhausted(
                        f"{self._aborts_in_row} steps in a row aborted; last error: {err}"
                    ) from err

    async def _train_one_step(self) -> None:
        first = await self._select_microbatch()
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
        index = len(self.state.open_step.microbatches)
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
        group_ids = [g for mb in self.state.open_step.microbatches for g in mb]
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

    def _step_metrics(self, group_ids: list[str]) -> dict[str, float]:
        now = self.clock()
        wall = max(now - self.t.step_started, 1e-9)
        total = max(now - self.t.started, 1e-9)
        m = consumed_group_stats(self.state, group_ids)
        m.update({
            "groups/evicted": float(self.t.evicted),
            "groups/failed": float(self.t.failed),
            "groups/zero_variance": float(self.t.zero_variance),
            "perf/trainer_idle_frac": max(0.0, 1.0 - self.t.trainer_busy / wall),
            "perf/generator_idle_frac": max(
                0.0, 1.0 - self.t.generator_busy / (wall * max(1, len(self.generators)))
            ),
            "perf/data_wait_s": self.t.data_wait,
            "perf/step_s": wall,
            # this step's groups are claimed, not yet consumed: count them in
            "perf/groups_per_s": (self._consumed_groups + len(group_ids)) / total,
            "buffer/groups": float(len(self.state.buffer)),
            "buffer/in_flight": float(len(self.state.admitted)),
        })
        self.t = _Timers(started=self.t.started, last_progress=self.t.last_progress)
        return m

    async def _timed_trainer(self, call):
        started = self.clock()
        try:
            return await call
        finally:
            self.t.trainer_busy += self.clock() - started

    async def _publish(self, version: int) -> None:
        crash_point("before_weights_published", version)
        acked = await self.publisher.publish(version)
        self._append(
            self.w.make(
                ev.WeightsPublished,
                event_id=f"weights:{version}:published:e{self.w.epoch}",
                weight_version=version,
                generators=acked,
            )
        )
        crash_point("after_weights_published", version)

    async def checkpoint_and_release(self, version: int) -> None:
        crash_point("before_checkpoint_saved", version)
        ck = await self.trainer.save_checkpoint(f"{self.s.checkpoint_dir}/v{version:06d}")
        self._append(
            self.w.make(
                ev.CheckpointSaved,
                event_id=f"checkpoint:{version}:saved:e{self.w.epoch}",
                trainer_version=ck.trainer_version,
                uri=ck.uri,
                sha256=ck.sha256,
            )
        )
        crash_point("after_checkpoint_saved", version)
        if self.s.retain_payloads == "until_checkpoint":
            await self.release_covered(version)

    async def release_covered(self, version: int) -> None:
        groups = [
            g for g in self.state.groups.values()
            if g.status is GroupStatus.CONSUMED
            and self.state.steps[g.consumed_step].trainer_version <= version
        ]
        if not groups:
            return
        await self.payloads.delete([k for g in groups for k in g.payload_keys])
        crash_point("before_payloads_released", version)
        self._append(
            self.w.make(
                ev.PayloadsReleased,
                event_id=f"payloads:released:v{version}:e{self.w.epoch}",
                group_ids=[g.group_id for g in groups],
            )
        )
        crash_point("after_payloads_released", version)

    async def _abort_open_step(self, reason: str) -> None:
        open_step = self.state.open_step
        try:
            await self.trainer.abort_train_step()
        except Exception as err:  # the trainer is gone; the log still gets the fact
            log.error("abort_failed", error=str(err))
        if open_step is not None:
            self._append(
                self.w.make(
                    ev.StepAborted,
                    event_id=ev.step_event_id(open_step.step, "aborted"),
                    step=open_step.step,
                    reason=reason[:500],
                )
            )
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
