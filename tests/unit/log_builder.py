"""Build event logs for tests: a fluent ``LogBuilder`` and a random-run simulator.

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

``random_run(seed, steps)`` simulates a realistic asynchronous run (admission ahead of
the trainer, out-of-order commits, failures and re-admission, evictions past the window,
aborted steps, controller restarts, checkpoints, releases, rewinds) with its own
bookkeeping -- independent of the reducer -- and returns the builder.
"""

from __future__ import annotations

import random
from typing import Any, Iterable, Iterator

from events import codec
from events.schema import (
    CheckpointRejected,
    CheckpointSaved,
    ControllerStarted,
    EnvCall,
    EnvResult,
    EnvStepsCompleted,
    EnvStepsRequested,
    EpisodesRestarted,
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
    Segment,
    SegmentsDropped,
    SegmentsRecorded,
    StepAborted,
    StepBegun,
    StepFinished,
    StoredEvent,
    WeightsPublished,
    WorkerLost,
    controller_started_id,
    env_steps_event_id,
    episodes_restarted_id,
    group_event_id,
    microbatch_event_id,
    run_started_id,
    segments_dropped_id,
    segments_event_id,
    step_event_id,
)


class LogBuilder:
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

    def flush(
        self,
        group_id: str,
        spans: dict[int, tuple[int, int]] | dict[int, tuple[int, int, bool]],
        *,
        version: int | None = 0,
        index: int | None = None,
        kind: str = "model",
        turn: int = 0,
        **overrides: Any,
    ) -> LogBuilder:
        """SegmentsRecorded: ``spans`` = {sample: (start, length[, stopped])}; the index
        counts this attempt's flushes unless given."""
        attempt = self.attempts.get(group_id, 1)
        counted = (group_id, attempt)
        index = self.flushes.get(counted, 0) if index is None else index
        self.flushes[counted] = index + 1
        segments = [
            Segment(sample=i, start=span[0], length=span[1], key=f"{group_id}/a{attempt}/s{i}/k{index}",
                    turn=turn, stopped=bool(span[2]) if len(span) > 2 else False)
            for i, span in spans.items()
        ]
        fields = dict(group_id=group_id, attempt=attempt, index=index, kind=kind,
                      weight_version=version, segments=segments)
        self._emit(SegmentsRecorded, segments_event_id(group_id, attempt, index), fields, overrides)
        return self

    def _env_index(self, group_id: str) -> tuple[int, int]:
        attempt = self.attempts.get(group_id, 1)
        index = self.env_events.get((group_id, attempt), 0)
        self.env_events[(group_id, attempt)] = index + 1
        return attempt, index

    def request(
        self, group_id: str, calls: dict[int, tuple[int, str]], *, env: str = "calc",
        dedupes: bool = True, restart: int = 0, **overrides: Any,
    ) -> LogBuilder:
        """EnvStepsRequested: ``calls`` = {sample: (turn, request fingerprint)}."""
        attempt, index = self._env_index(group_id)
        fields = dict(group_id=group_id, attempt=attempt, index=index, env=env,
                      dedupes_by_key=dedupes,
                      calls=[EnvCall(sample=i, turn=t, request=r, restart=restart)
                             for i, (t, r) in calls.items()])
        self._emit(EnvStepsRequested, env_steps_event_id(group_id, "requested", attempt, index),
                   fields, overrides)
        return self

    def complete(
        self, group_id: str, results: dict[int, tuple[int, float, bool, int]], *,
        restart: int = 0, **overrides: Any,
    ) -> LogBuilder:
        """EnvStepsCompleted: ``results`` = {sample: (turn, reward, ended, observation tokens)}."""
        attempt, index = self._env_index(group_id)
        fields = dict(group_id=group_id, attempt=attempt, index=index, results=[
            EnvResult(sample=i, turn=t, reward=r, ended=e, end_reason="done" if e else "",
                      observation_tokens=o, restart=restart)
            for i, (t, r, e, o) in results.items()])
        self._emit(EnvStepsCompleted, env_steps_event_id(group_id, "completed", attempt, index),
                   fields, overrides)
        return self

    def restart_episodes(self, group_id: str, samples: list[int], **overrides: Any) -> LogBuilder:
        attempt = self.attempts.get(group_id, 1)
        fields = dict(group_id=group_id, attempt=attempt, samples=samples, reason="test")
        self._emit(EpisodesRestarted, episodes_restarted_id(group_id, attempt), fields, overrides)
        return self

    def group(self, group_id: str, **commit_overrides: Any) -> LogBuilder:
        """admit + commit."""
        return self.admit(group_id).commit(group_id, **commit_overrides)

    def fail(self, group_id: str, reason: str = "generator lost", *, attempt: int | None = None, **overrides: Any) -> LogBuilder:
        attempt = self.attempts.get(group_id, 1) if attempt is None else attempt
        fields = dict(group_id=group_id, attempt=attempt, reason=reason)
        self._emit(GroupFailed, group_event_id(group_id, "failed", attempt), fields, overrides)
        return self

    def drop_segments(self, group_id: str, keys: list[str], **overrides: Any) -> LogBuilder:
        """SegmentsDropped by the group's current (failed) attempt."""
        attempt = self.attempts.get(group_id, 1)
        fields = dict(group_id=group_id, attempt=attempt, keys=keys, reason=f"missing {keys[:1]}")
        self._emit(SegmentsDropped, segments_dropped_id(group_id, attempt), fields, overrides)
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


# -- a realistic random run ------------------------------------------------------------------


class _Sim:
    """Bookkeeping of ``random_run``: what a correct controller would know."""

    def __init__(self, b: LogBuilder, rng: random.Random, microbatch_groups: int) -> None:
        self.b, self.rng, self.mb = b, rng, microbatch_groups
        self.in_flight: list[str] = []
        self.buffer: list[str] = []
        self.commit_seq: dict[str, int] = {}
        self.start: dict[str, int] = {}
        self.uncovered: list[tuple[int, list[str]]] = []  # (trainer_version, groups)
        self.ckpt_version = -1
        self.n_groups = 0
        self.finished_steps = 0

    def admit_up_to(self, capacity: int) -> None:
        while len(self.in_flight) + len(self.buffer) < capacity:
            gid = f"g{self.n_groups:07d}"
            self.n_groups += 1
            self.b.admit(gid, generator=_generator(gid))
            self.in_flight.append(gid)

    def complete_some(self, p_fail: float) -> None:
        rng, b = self.rng, self.b
        if not self.in_flight:
            return
        k = rng.randint(1, len(self.in_flight))
        for gid in rng.sample(self.in_flight, k):
            self.in_flight.remove(gid)
            if rng.random() < p_fail:
                b.fail(gid)
                if rng.random() < 0.5:
                    b.release([gid])
                b.admit(gid, generator=_generator(gid))
                self.in_flight.append(gid)
            else:
                b.commit(gid)
                self.start[gid] = b.dispatch_versions[gid]
                self.commit_seq[gid] = b.last_position
                self.buffer.append(gid)

    def evict_stale(self) -> None:
        b = self.b
        for gid in list(self.buffer):
            lag = b.trainer_version - self.start[gid]
            if lag > b.window or lag < 0:
                self.buffer.remove(gid)
                b.evict(gid, lag=lag).release([gid])

    def step(self, p_abort: float, p_restart: float) -> None:
        b, rng = self.b, self.rng
        picked = self.buffer[: b.groups_per_step]
        del self.buffer[: b.groups_per_step]
        b.begin_step()
        chunks = [picked[i : i + self.mb] for i in range(0, len(picked), self.mb)]
        restart = rng.random() < p_restart
        abort = restart or rng.random() < p_abort
        if abort:
            chunks = chunks[: rng.randint(0, len(chunks) - 1)]
        for chunk in chunks:
            b.microbatch(chunk)
        if not abort:
            b.finish_step()
            self.finished_steps += 1
            self.uncovered.append((b.trainer_version, picked))
            b.publish()
            return
        if restart:
            b.restart()
        b.abort_step("restart" if restart else "trainer error")
        self.buffer = sorted(self.buffer + picked, key=self.commit_seq.__getitem__)
        if restart:
            for gid in list(self.in_flight):
                b.fail(gid, "controller restart").admit(gid, generator=_generator(gid))
            b.publish()

    def checkpoint(self) -> None:
        b = self.b
        b.checkpoint()
        self.ckpt_version = b.trainer_version
        covered = [g for v, gs in self.uncovered if v <= b.trainer_version for g in gs]
        self.uncovered = [(v, gs) for v, gs in self.uncovered if v > b.trainer_version]
        if covered:
            b.release(covered)

    def rewind(self) -> None:
        b = self.b
        lost = [g for _, gs in self.uncovered for g in gs]
        b.rewind(self.ckpt_version)
        self.uncovered = []
        if lost:
            b.release(lost)
        b.publish()


def _generator(group_id: str) -> str:
    """The simulated run's two generators (no random draw: other logs stay the same)."""
    return f"generator-{int(group_id[1:]) % 2}"


def random_run(
    seed: int,
    steps: int,
    *,
    window: int = 1,
    groups_per_step: int = 4,
    samples_per_group: int = 8,
    microbatch_groups: int = 2,
    p_fail: float = 0.02,
    p_abort: float = 0.02,
    p_restart: float = 0.01,
    p_rewind: float = 0.0,
    p_worker_lost: float = 0.005,
    checkpoint_every: int = 10,
    finish: bool = True,
) -> LogBuilder:
    """A valid log of a simulated run that finishes ``steps`` training steps."""
    options = dict(locals())
    *_, builder = _simulate(**options)  # the last yield holds the whole run
    return builder


def stream_random_run(seed: int, steps: int, **options: Any) -> Iterator[list[StoredEvent]]:
    """``random_run``'s events (the same ones, in order) in chunks, none kept after its
    chunk is handed over: logs of 10^7 events for benchmarks, in bounded memory."""
    for builder in _simulate(seed, steps, **options):
        if builder.events:
            chunk, builder.events = builder.events, []
            yield chunk


def _simulate(
    seed: int,
    steps: int,
    *,
    window: int = 1,
    groups_per_step: int = 4,
    samples_per_group: int = 8,
    microbatch_groups: int = 2,
    p_fail: float = 0.02,
    p_abort: float = 0.02,
    p_restart: float = 0.01,
    p_rewind: float = 0.0,
    p_worker_lost: float = 0.005,
    checkpoint_every: int = 10,
    finish: bool = True,
) -> Iterator[LogBuilder]:
    """The builder of ``random_run`` after each round of the simulation, then at the end
    (the simulation never reads ``builder.events``, so a caller may drain it)."""
    rng = random.Random(seed)
    b = LogBuilder(
        run_id=f"sim-{seed}",
        window=window,
        groups_per_step=groups_per_step,
        samples_per_group=samples_per_group,
        seed=seed,
    ).start(config={"run": {"seed": seed}, "train": {"groups_per_microbatch": microbatch_groups}})
    b.checkpoint()  # initial weights, version 0
    sim = _Sim(b, rng, microbatch_groups)
    sim.ckpt_version = 0
    capacity = groups_per_step * (window + 1)
    while sim.finished_steps < steps:
        yield b
        sim.admit_up_to(capacity)
        sim.complete_some(p_fail)
        sim.evict_stale()
        if rng.random() < p_worker_lost:
            b.worker_lost()
        if len(sim.buffer) < groups_per_step:
            continue
        before = sim.finished_steps
        sim.step(p_abort, p_restart)
        if sim.finished_steps > before and sim.finished_steps % checkpoint_every == 0:
            sim.checkpoint()
        elif sim.uncovered and rng.random() < p_rewind:
            sim.rewind()
    if finish:
        b.finish_run()
    yield b


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
