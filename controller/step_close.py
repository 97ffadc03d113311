"""What the controller loop does as a step closes.

The step's metrics (written into ``StepFinished``), publishing the new weights to the
generators, and every ``checkpoint.every_steps`` a checkpoint plus the release of the
payloads it covers. Each side effect first checks the run's epoch (no append
immediately precedes it); each fact is appended after it.

With ``checkpoint.async_save`` the pump only waits for the trainer's snapshot
(``begin_checkpoint``); a background task polls until the write is durable, then appends
``CheckpointSaved`` and releases the payloads -- so neither the write nor the release
sits on the trainer's critical path. One checkpoint is in flight at a time; the next one
(and the end of the run) waits for it. A write lost with its trainer is logged and
dropped: no ``CheckpointSaved``, so nothing relies on it.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import structlog

from controller import effects
from controller.core.step_metrics import consumed_group_stats
from controller.crashpoints import crash_point
from controller.journal import Journal
from controller.settings import CheckpointSection
from events import schema as ev
from workers.api import PayloadStore, StepOutcome, TrainerClient, WeightPublisher, WorkerLostError

log = structlog.get_logger("rl_controller.loop")

#: how often a background checkpoint asks the trainer whether its write is durable
POLL_S = 0.05

#: called after every StepFinished with (step, trainer_version, metrics)
OnStep = Callable[[int, int, dict[str, float]], None]


class StepClosing:
    """Metrics, StepFinished, publishing, checkpoints and payload release."""

    def __init__(
        self,
        journal: Journal,
        *,
        trainer: TrainerClient,
        publisher: WeightPublisher,
        payloads: PayloadStore,
        checkpoint: CheckpointSection,
        checkpoint_dir: str,
        num_generators: int,
        on_step: OnStep | None = None,
    ) -> None:
        self.journal = journal
        self.trainer = trainer
        self.publisher = publisher
        self.payloads = payloads
        self.checkpoint = checkpoint
        self.checkpoint_dir = checkpoint_dir
        self.num_generators = num_generators
        self.on_step = on_step
        #: groups consumed by steps finished in this controller's lifetime
        self.consumed_groups = 0
        #: the background checkpoint in flight (async_save), and an error it left
        self._saving: asyncio.Task | None = None
        self._saving_error: BaseException | None = None

    async def close(self, step: int, result: StepOutcome, group_ids: list[str]) -> None:
        """The trainer finished ``step``: record it, publish, checkpoint every N."""
        await self.record(step, result, group_ids)
        await self.publish(result.trainer_version)
        if self.checkpoint_due(result.trainer_version):
            await self.checkpoint_and_release(result.trainer_version)

    def checkpoint_due(self, version: int) -> bool:
        return version % self.checkpoint.every_steps == 0

    async def record(self, step: int, result: StepOutcome, group_ids: list[str]) -> None:
        """Append ``StepFinished`` with the step's metrics (publishing is the caller's)."""
        j = self.journal
        metrics = {**result.metrics, **self.step_metrics(group_ids)}
        crash_point("before_step_finished", step)
        await j.append(
            j.make(
                ev.StepFinished,
                event_id=ev.step_event_id(step, "finished"),
                step=step,
                trainer_version=result.trainer_version,
                metrics=metrics,
                grad_norm=result.grad_norm,
                weights_digest=result.weights_digest,
            )
        )
        self.consumed_groups += len(group_ids)
        if self.on_step is not None:
            self.on_step(step, result.trainer_version, metrics)

    def step_metrics(self, group_ids: list[str]) -> dict[str, float]:
        j = self.journal
        now = j.clock()
        t = j.next_step_timers()
        wall = max(now - t.step_started, 1e-9)
        total = max(now - t.started, 1e-9)
        m = consumed_group_stats(j.state, group_ids)
        m.update({
            "groups/evicted": float(t.evicted),
            "groups/failed": float(t.failed),
            "groups/zero_variance": float(t.zero_variance),
            "perf/trainer_idle_frac": max(0.0, 1.0 - t.trainer_busy / wall),
            "perf/generator_idle_frac": max(
                0.0, 1.0 - t.generator_busy / (wall * max(1, self.num_generators))
            ),
            "perf/data_wait_s": t.data_wait,
            "perf/step_s": wall,
            # this step's groups are claimed, not yet consumed: count them in
            "perf/groups_per_s": (self.consumed_groups + len(group_ids)) / total,
            "buffer/groups": float(len(j.state.buffer)),
            "buffer/in_flight": float(len(j.state.admitted)),
        })
        return m

    async def publish(self, version: int) -> None:
        self.journal.ensure_owner()
        await effects.publish_current(self.journal, self.publisher)

    async def checkpoint_and_release(self, version: int) -> None:
        await self.wait_checkpoint()  # one in flight at a time
        self.journal.ensure_owner()
        if not self.checkpoint.async_save:
            await effects.save_checkpoint(self.journal, self.trainer, self.checkpoint_dir, version)
            await self._release(version)
            return
        crash_point("before_checkpoint_saved", version)
        directory = effects.checkpoint_path(self.journal, self.checkpoint_dir, version)
        await self.trainer.begin_checkpoint(directory)  # the snapshot: the trainer's own time
        self._saving = asyncio.create_task(self._finish(version, directory), name=f"checkpoint-v{version}")

    async def _release(self, version: int) -> None:
        if self.checkpoint.retain_payloads == "until_checkpoint":
            self.journal.ensure_owner()
            await effects.release_covered(self.journal, self.payloads, version)

    async def wait_checkpoint(self) -> None:
        """Until the background checkpoint (if any) is recorded; re-raises its error."""
        if self._saving is not None:
            await asyncio.wait([self._saving])
            self._saving = None
        err, self._saving_error = self._saving_error, None
        if err is not None:
            raise err

    async def _finish(self, version: int, directory: str) -> None:
        try:
            while (ck := await self.trainer.checkpoint_outcome(directory)) is None:
                await asyncio.sleep(POLL_S)
            await effects.record_checkpoint(self.journal, version, ck)
            await self._release(version)
        except asyncio.CancelledError:
            raise
        except (WorkerLostError, KeyError) as err:  # the trainer (and its write) is gone
            log.warning("checkpoint_lost", trainer_version=version, reason=str(err)[:300])
        except Exception as err:  # fenced, store gone: the pump raises it next
            self._saving_error = err
        finally:
            self.journal.wake()
