"""Build event logs for tests: a fluent ``LogBuilder`` (``tests.unit.random_log`` builds a
whole random run with it).

    log = (
        LogBuilder(run_id="r1", window=1, groups_per_step=2)
        .start()                                  # RunStarted + ControllerStarted (epoch 1)
        .admit("g1").commit("g1", start=0, end=0)
        .admit("g2").commit("g2")
        .begin_step().microbatch(["g1", "g2"]).finish_step()
        .publish()
        .build()                                  # list[StoredEvent], positions 1..n
    )

The builder keeps just enough bookkeeping (epoch, trainer/weight version, next step,
open step, microbatch index, attempts, prompt index) to fill every field with a value
that makes a *valid* log by default; any field can be overridden by keyword
(``.commit("g1", epoch=0)`` makes a stale-epoch event), so invalid logs are one argument
away. Timestamps are ``t0 + position * dt``: deterministic. ``append(event)`` adds any
hand-made event.

"""

from __future__ import annotations

from typing import Any, Iterable

from events import codec
from events.schema import (
    CheckpointRejected,
    CheckpointSaved,
    ControllerStarted,
    Event,
    GroupCommitted,
    GroupEvicted,
    GroupFailed,
    MicrobatchTrained,
    PayloadsReleased,
    RolloutAdmitted,
    RunFinished,
    RunRewound,
    RunStarted,
    StepAborted,
    StepBegun,
    StepFinished,
    StoredEvent,
    WeightsPublished,
    WorkerLost,
    controller_started_id,
    group_event_id,
    microbatch_event_id,
    run_started_id,
    step_event_id,
)
from tests.unit.log_builder_segments import SegmentEvents


class LogBuilder(SegmentEvents):
    """Fluent builder of ``list[StoredEvent]``; every method returns ``self``."""

    def __init__(
        self,
        run_id: str = "run-test",
        window: int = 1,
        groups_per_step: int = 2,
        samples_per_group: int = 2,
        *,
        epoch: int = 1,
        seed: int = 0,
        t0: float = 1_000.0,
        dt: float = 0.25,
        host: str = "test-host",
        pid: int = 4242,
        first_position: int = 1,
    ) -> None:
        self.run_id = run_id
        self.window = window
        self.groups_per_step = groups_per_step
        self.samples_per_group = samples_per_group
        self.epoch = epoch
        self.seed = seed
        self.t0 = t0
        self.dt = dt
        self.host = host
        self.pid = pid
        self.events: list[StoredEvent] = []
        self.next_position = first_position
        # bookkeeping for defaults (assumes the events so far were valid)
        self.trainer_version = 0
        self.weight_version = 0
        self.next_step = 0
        self.open_step: int | None = None
        self.open_base = 0
        self.mb_index = 0
        self.attempts: dict[str, int] = {}
        #: flushes recorded per (group, attempt)
        self.flushes: dict[tuple[str, int], int] = {}
        #: env events (requested + completed) per (group, attempt)
        self.env_events: dict[tuple[str, int], int] = {}
        self.dispatch_versions: dict[str, int] = {}
        self.prompt_index = 0
        #: step -> (trainer_version, group ids) of finished steps, for rewind defaults
        self.finished: dict[int, tuple[int, list[str]]] = {}
        self.open_groups: list[str] = []

    # -- output ---------------------------------------------------------------------

    def build(self) -> list[StoredEvent]:
        return list(self.events)

    def encoded(self) -> list[tuple[int, bytes]]:
        """The log as raw store entries: (position, JSON bytes)."""
        return [(s.position, codec.encode(s.event)) for s in self.events]

    def fold(self) -> Any:
        """Fold the log so far with the real reducer (returns a ``RunState``)."""
        from controller.core.fold import fold

        return fold(self.events)

    @property
    def last_position(self) -> int:
        return self.next_position - 1

    def __len__(self) -> int:
        return len(self.events)

    # -- low level --------------------------------------------------------------------

    def append(self, event: Event) -> LogBuilder:
        """Append a hand-made event at the next position (no bookkeeping)."""
        self.events.append(StoredEvent(position=self.next_position, event=event))  # type: ignore[arg-type]
        self.next_position += 1
        return self

    def ts(self) -> float:
        return self.t0 + self.next_position * self.dt

    def _emit(self, cls: type[Event], event_id: str, fields: dict[str, Any], overrides: dict[str, Any]) -> None:
        fields = {"event_id": event_id, "epoch": self.epoch, "ts": self.ts(), **fields, **overrides}
        self.append(cls(**fields))

    # -- run and controller -------------------------------------------------------------

    def start(self, *, config: dict[str, Any] | None = None, **overrides: Any) -> LogBuilder:
        """RunStarted followed by ControllerStarted of the same epoch."""
        return self.run_started(config=config, **overrides).controller_started()

    def run_started(self, *, config: dict[str, Any] | None = None, **overrides: Any) -> LogBuilder:
        fields = dict(
            run_id=self.run_id,
            # a config the run's own loader accepts: tools read it typed
            config=config if config is not None else {"run": {"seed": self.seed}},
            seed=self.seed,
            code_version="0.1.0",
            window_versions=self.window,
            groups_per_step=self.groups_per_step,
            samples_per_group=self.samples_per_group,
        )
        self._emit(RunStarted, run_started_id(self.run_id), fields, overrides)
        return self

    def controller_started(self, epoch: int | None = None, **overrides: Any) -> LogBuilder:
        self.epoch = self.epoch if epoch is None else epoch
        fields = dict(host=self.host, pid=self.pid + self.epoch)
        self._emit(ControllerStarted, controller_started_id(self.epoch), fields, overrides)
        return self

    def restart(self, **overrides: Any) -> LogBuilder:
        """A new controller: ControllerStarted with epoch + 1."""
        return self.controller_started(self.epoch + 1, **overrides)

    def finish_run(self, reason: str = "budget reached", **overrides: Any) -> LogBuilder:
        self._emit(RunFinished, f"run:{self.run_id}:finished", dict(reason=reason), overrides)
        return self

    def worker_lost(self, worker: str = "generator-0", role: str = "generator", reason: str = "died", **overrides: Any) -> LogBuilder:
        fields = dict(worker=worker, role=role, reason=reason)
        self._emit(WorkerLost, f"worker:{worker}:lost:{self.next_position}", fields, overrides)
        return self

    # -- groups ---------------------------------------------------------------------------

    def admit(self, group_id: str, *, attempt: int | None = None, weight_version: int | None = None, **overrides: Any) -> LogBuilder:
        attempt = self.attempts.get(group_id, 0) + 1 if attempt is None else attempt
        version = self.weight_version if weight_version is None else weight_version
        self.attempts[group_id] = attempt
        self.dispatch_versions[group_id] = version
        fields = dict(
            group_id=group_id,
            attempt=attempt,
            prompt_index=self.prompt_index,
            prompt_ref=f"prompts.jsonl#{self.prompt_index}",
            weight_version=version,
            n_samples=self.samples_per_group,
            sample_seed=self.seed * 1_000_003 + self.prompt_index,
        )
        self.prompt_index += 1
        self._emit(RolloutAdmitted, group_event_id(group_id, "admitted", attempt), fields, overrides)
        return self

    def commit(
        self,
        group_id: str,
        *,
        start: int | None = None,
        end: int | None = None,
        attempt: int | None = None,
        n: int | None = None,
        **overrides: Any,
    ) -> LogBuilder:
        """GroupCommitted; start defaults to the dispatch version, end to the published one."""
        attempt = self.attempts.get(group_id, 1) if attempt is None else attempt
        start = self.dispatch_versions.get(group_id, self.weight_version) if start is None else start
        end = max(start, self.weight_version) if end is None else end
        n = self.samples_per_group if n is None else n
        fields = dict(
            group_id=group_id,
            attempt=attempt,
            weight_version_start=start,
            weight_version_end=end,
            payload_keys=[f"{group_id}/a{attempt}/{i}" for i in range(n)],
            rewards=[float(i % 2) for i in range(n)],
            lengths=[16 + i for i in range(n)],
        )
        self._emit(GroupCommitted, group_event_id(group_id, "committed", attempt), fields, overrides)
        return self

    def group(self, group_id: str, **commit_overrides: Any) -> LogBuilder:
        """admit + commit."""
        return self.admit(group_id).commit(group_id, **commit_overrides)

    def fail(self, group_id: str, reason: str = "generator lost", *, attempt: int | None = None, **overrides: Any) -> LogBuilder:
        attempt = self.attempts.get(group_id, 1) if attempt is None else attempt
        fields = dict(group_id=group_id, attempt=attempt, reason=reason)
        self._emit(GroupFailed, group_event_id(group_id, "failed", attempt), fields, overrides)
        return self

    def evict(self, group_id: str, reason: str = "lag past window", lag: int = 0, **overrides: Any) -> LogBuilder:
        fields = dict(group_id=group_id, reason=reason, lag=lag)
        self._emit(GroupEvicted, group_event_id(group_id, "evicted"), fields, overrides)
        return self

    def release(self, group_ids: Iterable[str], **overrides: Any) -> LogBuilder:
        ids = list(group_ids)
        fields = dict(group_ids=ids)
        self._emit(PayloadsReleased, f"release:{self.next_position}", fields, overrides)
        return self

    # -- steps ----------------------------------------------------------------------------

    def begin_step(self, step: int | None = None, *, base: int | None = None, **overrides: Any) -> LogBuilder:
        step = self.next_step if step is None else step
        base = self.trainer_version if base is None else base
        self.open_step, self.open_base, self.mb_index = step, base, 0
        self.open_groups = []
        self.next_step = step + 1
        fields = dict(step=step, base_trainer_version=base)
        self._emit(StepBegun, step_event_id(step, "begun"), fields, overrides)
        return self

    def microbatch(self, group_ids: Iterable[str], *, step: int | None = None, index: int | None = None, **overrides: Any) -> LogBuilder:
        ids = list(group_ids)
        step = self._step(step)
        index = self.mb_index if index is None else index
        self.mb_index = index + 1
        self.open_groups.extend(ids)
        n_seq = len(ids) * self.samples_per_group
        fields = dict(step=step, index=index, group_ids=ids, num_sequences=n_seq, num_tokens=n_seq * 17)
        self._emit(MicrobatchTrained, microbatch_event_id(step, index), fields, overrides)
        return self

    def finish_step(self, *, step: int | None = None, trainer_version: int | None = None, **overrides: Any) -> LogBuilder:
        step = self._step(step)
        version = self.open_base + 1 if trainer_version is None else trainer_version
        self.finished[step] = (version, list(self.open_groups))
        self.trainer_version, self.open_step = version, None
        fields = dict(
            step=step,
            trainer_version=version,
            metrics={"loss": 0.5 / (step + 1), "reward_mean": 0.5},
            grad_norm=1.0 + step / 10,
            weights_digest=f"sha256:{version:08x}",
        )
        self._emit(StepFinished, step_event_id(step, "finished"), fields, overrides)
        return self

    def abort_step(self, reason: str = "restart", *, step: int | None = None, **overrides: Any) -> LogBuilder:
        step = self._step(step)
        self.open_step = None
        self._emit(StepAborted, step_event_id(step, "aborted"), dict(step=step, reason=reason), overrides)
        return self

    def train_step(self, group_ids: Iterable[str], microbatch_groups: int = 1) -> LogBuilder:
        """begin_step + microbatches of ``microbatch_groups`` groups + finish_step."""
        ids = list(group_ids)
        self.begin_step()
        for i in range(0, len(ids), microbatch_groups):
            self.microbatch(ids[i : i + microbatch_groups])
        return self.finish_step()

    def _step(self, step: int | None) -> int:
        if step is not None:
            return step
        return self.open_step if self.open_step is not None else self.next_step - 1

    # -- weights, checkpoints, rewinds ------------------------------------------------------

    def publish(self, weight_version: int | None = None, **overrides: Any) -> LogBuilder:
        version = self.trainer_version if weight_version is None else weight_version
        self.weight_version = version
        fields = dict(weight_version=version, generators=["generator-0", "generator-1"])
        self._emit(WeightsPublished, f"weights:{version}:published:{self.next_position}", fields, overrides)
        return self

    def checkpoint(self, trainer_version: int | None = None, **overrides: Any) -> LogBuilder:
        version = self.trainer_version if trainer_version is None else trainer_version
        fields = dict(trainer_version=version, uri=f"ckpt/v{version}", sha256=f"{version:064x}")
        self._emit(CheckpointSaved, f"checkpoint:{version}:saved:{self.next_position}", fields, overrides)
        return self

    def reject_checkpoint(self, trainer_version: int, reason: str = "sha256 mismatch", **overrides: Any) -> LogBuilder:
        fields = dict(trainer_version=trainer_version, uri=f"ckpt/v{trainer_version}", reason=reason)
        self._emit(CheckpointRejected, f"checkpoint:{trainer_version}:rejected:{self.next_position}", fields, overrides)
        return self

    def rewind(
        self,
        to_trainer_version: int,
        *,
        lost_steps: list[int] | None = None,
        lost_group_ids: list[str] | None = None,
        reason: str = "payloads lost",
        **overrides: Any,
    ) -> LogBuilder:
        """RunRewound; lost steps/groups default to the finished steps after the version."""
        lost = sorted(s for s, (v, _) in self.finished.items() if v > to_trainer_version)
        steps = lost if lost_steps is None else lost_steps
        groups = [g for s in lost for g in self.finished[s][1]] if lost_group_ids is None else lost_group_ids
        for s in lost:
            del self.finished[s]
        self.trainer_version = min(self.trainer_version, to_trainer_version)
        self.weight_version = min(self.weight_version, to_trainer_version)
        fields = dict(to_trainer_version=to_trainer_version, lost_steps=steps, lost_group_ids=groups, reason=reason)
        self._emit(RunRewound, f"run:{self.run_id}:rewound:{self.next_position}", fields, overrides)
        return self


def assert_violation(events: list[StoredEvent], message: str) -> None:
    """Applying the last of ``events`` raises a violation matching ``message`` that names
    its position, and leaves the state folded from the others exactly as it was."""
    import pytest

    from controller.core.errors import InvariantViolation
    from controller.core.fold import fold
    from controller.core.reducer import apply

    before = fold(events[:-1])
    snapshot = before.copy()
    with pytest.raises(InvariantViolation, match=message) as info:
        apply(before, events[-1])
    assert info.value.position == events[-1].position
    assert before == snapshot
