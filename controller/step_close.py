"""What the controller loop does as a step closes (a part of ``Controller``).

The step's metrics (written into ``StepFinished``), publishing the new weights to the
generators, and every ``checkpoint.every_steps`` a checkpoint plus the release of the
payloads it covers. Each side effect first checks the run's epoch (no append
immediately precedes it); each fact is appended after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from controller import recovery
from controller.crashpoints import crash_point
from controller.core.step_metrics import consumed_group_stats
from events import schema as ev


@dataclass
class Timers:
    """The loop's clocks and counters; all but ``started`` and ``last_progress`` start
    again at every StepFinished."""

    started: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    trainer_busy: float = 0.0
    data_wait: float = 0.0
    generator_busy: float = 0.0
    step_started: float = field(default_factory=time.monotonic)
    evicted: int = 0
    failed: int = 0
    zero_variance: int = 0


class StepClosing:
    """Mixed into ``controller.loop.Controller``; uses its writer, workers and timers."""

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
        self.t = Timers(started=self.t.started, last_progress=self.t.last_progress)
        return m

    async def _publish(self, version: int) -> None:
        self._ensure_owner()
        await recovery.publish_current(self.w, self.publisher)
        self._progressed()

    async def checkpoint_and_release(self, version: int) -> None:
        crash_point("before_checkpoint_saved", version)
        self._ensure_owner()
        # The epoch in the name: a version may be checkpointed again after a crash
        # between the save and its CheckpointSaved, or after a RunRewound.
        ck = await self.trainer.save_checkpoint(
            f"{self.s.checkpoint_dir}/v{version:06d}-e{self.w.epoch}"
        )
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
        self._ensure_owner()
        await recovery.release_covered(self.w, self.payloads, version)
        self._progressed()
