"""What the controller loop does as a step closes.

The step's metrics (written into ``StepFinished``), publishing the new weights to the
generators, and every ``checkpoint.every_steps`` a checkpoint plus the release of the
payloads it covers. Each side effect first checks the run's epoch (no append
immediately precedes it); each fact is appended after it.
"""

from __future__ import annotations

from typing import Callable

from controller import effects
from controller.core.step_metrics import consumed_group_stats
from controller.crashpoints import crash_point
from controller.journal import Journal
from controller.settings import CheckpointSection
from events import schema as ev
from workers.api import PayloadStore, StepOutcome, TrainerClient, WeightPublisher

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
        self.journal.ensure_owner()
        await effects.save_checkpoint(self.journal, self.trainer, self.checkpoint_dir, version)
        if self.checkpoint.retain_payloads == "until_checkpoint":
            self.journal.ensure_owner()
            await effects.release_covered(self.journal, self.payloads, version)
