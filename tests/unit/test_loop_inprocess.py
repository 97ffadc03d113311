"""The controller loop end to end in one process: in-memory log, real in-process workers.

Every test drives the real ``Controller`` (admission, train and watchdog pumps) with a
``MemoryEventStore`` and real ``TrainerWorker`` / ``GeneratorWorker`` objects on their
own threads (tiny model, in-memory data plane, no spill). Failures come from fakes --
subclasses of the real workers that raise or block on a chosen call -- never mocks.
After each run the log is folded again from the store and audited.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from controller.config import Config, config_to_dict, load_config
from cli.run_cmd import checkpoint_dir
from controller.core.turns import expanded
from controller.journal import Journal
from controller.loop import Controller, StallError, StepRetriesExhausted
from controller.log_writer import LogWriter
from controller.core.policies import SELECTION_POLICIES
from controller.recovery import reconcile_workers
from controller.startup import create_run
from controller.core.state import GroupStatus
from controller.wiring import Workers, start_workers, worker_spec
from events import schema as ev
from events.memory_store import MemoryEventStore
from replay.audit import build_report
from controller.projector import Projector
from workers.service import GeneratorWorker, TrainerWorker
from workers.trainer.tensors import digest_parameters

RUN = "loop-test"


# -- fakes: real workers that fail on purpose ------------------------------------------


class FailingGenerator(GeneratorWorker):
    """Raises on the chosen (group_id, attempt) pairs; generates normally otherwise."""

    fail_on: frozenset[tuple[str, int]] = frozenset()

    def generate(self, req):
        if (req.group_id, req.attempt) in self.fail_on:
            raise RuntimeError(f"injected failure on {req.group_id} attempt {req.attempt}")
        return super().generate(req)


class BlockingGenerator(GeneratorWorker):
    """Holds every group until ``release`` is set (a hung worker: hung by construction,
    not for a while that a loaded machine could outlast)."""

    release: threading.Event

    def generate(self, req):
        self.release.wait()
        return super().generate(req)


class CallSizeGenerator(FailingGenerator):
    """Records how many groups each call carried (and may fail chosen groups)."""

    sizes: list[int]

    def generate_groups(self, reqs):
        self.sizes.append(len(reqs))
        return super().generate_groups(reqs)


class NanReward:
    """The run's task, but the first reward it gives for ``prompt`` is nan (a plugin's
    bad reward, which ``checked_reward`` refuses: that group's own error)."""

    def __init__(self, task: Any, prompt: str) -> None:
        self.task, self.name, self.prompt, self.spent = task, task.name, prompt, False

    def examples(self, count: int, seed: int) -> list[Any]:
        return self.task.examples(count, seed)

    def reward(self, example: Any, completion: str, stopped: bool) -> float:
        if example.prompt == self.prompt and not self.spent:
            self.spent = True
            return math.nan
        return self.task.reward(example, completion, stopped)


class NanRewardGenerator(GeneratorWorker):
    """The real generator, whose task's first reward for prompt ``nan_prompt`` is nan."""

    nan_prompt = 1

    def generate_groups(self, reqs):
        if not isinstance(self.generator.task, NanReward):
            prompt = self.prompts[self.nan_prompt].prompt
            assert self.prompts[1 - self.nan_prompt].prompt != prompt  # the call's other group
            self.generator.task = NanReward(self.generator.task, prompt)
        return super().generate_groups(reqs)


class SlowRefitGenerator(GeneratorWorker):
    """Takes ``refit_s`` over each refit bucket (a slow link), then records the digest of
    the weights it holds once a version is complete."""

    refit_s = 0.0
    held: dict[str, dict[int, str]]

    def receive_weight_bucket(self, version, index, count, bucket):
        time.sleep(self.refit_s)
        ack = super().receive_weight_bucket(version, index, count, bucket)
        if ack is not None:
            self.held.setdefault(self.name, {})[version] = digest_parameters(self.generator.model)
        return ack


class FlakyTrainer(TrainerWorker):
    """Raises inside ``train_microbatch`` of the chosen steps (every step if None),
    after ``fail_after`` microbatches of that step succeeded."""

    fail_steps: frozenset[int] | None = frozenset()
    fail_after = 0
    step = -1
    done_in_step = 0

    def begin_train_step(self, step: int) -> None:
        self.step, self.done_in_step = step, 0
        super().begin_train_step(step)

    def train_microbatch(self, ref):
        chosen = self.fail_steps is None or self.step in self.fail_steps
        if chosen and self.done_in_step >= self.fail_after:
            raise RuntimeError(f"injected trainer failure in step {self.step}")
        self.done_in_step += 1
        return super().train_microbatch(ref)


# -- harness ----------------------------------------------------------------------------


def make_config(*overrides: str) -> Config:
    return load_config(None, [
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.context_len=16",
        "sampling.max_new_tokens=4", "task.num_prompts=64",
        "rollout.samples_per_group=4", "rollout.num_generators=2", "rollout.groups_per_call=1",
        "train.groups_per_step=2", "train.groups_per_microbatch=1",
        "dataplane.kind=memory", "dataplane.spill=false",
        "checkpoint.every_steps=1000", "checkpoint.retain_payloads=all",
        "controller.stall_timeout_s=20",
        *overrides,
    ])


class Harness:
    """One run: store, writer, workers (with fakes swapped in) and the controller."""

    def __init__(
        self,
        cfg: Config,
        tmp_path: Path,
        *,
        generator: type[GeneratorWorker] | None = None,
        trainer: type[TrainerWorker] | None = None,
        **fake_attrs: Any,
    ) -> None:
        self.cfg = cfg
        self.store = MemoryEventStore()
        spec = worker_spec(cfg, RUN, tmp_path)
        self.workers: Workers = start_workers(cfg, spec, local=True)
        # Swap the real workers behind their handles for the fakes (same constructor).
        if generator is not None:
            for gen in self.workers.generators:
                gen.handle.obj = self._fake(generator(spec, gen.name, self.workers.dataplane), fake_attrs)
        if trainer is not None:
            self.workers.trainer.handle.obj = self._fake(trainer(spec, self.workers.dataplane), fake_attrs)
        self.writer: LogWriter = create_run(
            self.store, RUN, config=config_to_dict(cfg), seed=cfg.run.seed, code_version="test",
            window_versions=cfg.staleness.window_versions,
            groups_per_step=cfg.train.groups_per_step,
            samples_per_group=cfg.rollout.samples_per_group,
        )
        self.checkpoint_dir = checkpoint_dir(tmp_path)

    @staticmethod
    def _fake(worker: Any, attrs: dict[str, Any]) -> Any:
        for name, value in attrs.items():
            setattr(worker, name, value)
        return worker

    def run(self) -> str:
        try:
            asyncio.run(reconcile_workers(
                self.writer, self.workers, self.cfg.checkpoint, checkpoint_dir=self.checkpoint_dir
            ))
            w = self.workers
            controller = Controller(
                self.writer, self.cfg, w.trainer, w.generators, w.publisher, w.payloads,
                checkpoint_dir=self.checkpoint_dir,
            )
            return asyncio.run(controller.run())
        finally:
            self.workers.close()

    def events(self, kind: type | None = None) -> list[Any]:
        """The log as readers see it: a pause as the events it stands for."""
        out = list(expanded(e.event for e in self.store.read(RUN)))
        return out if kind is None else [e for e in out if isinstance(e, kind)]

    def check_log(self) -> None:
        """The stored log folds without a problem to the writer's state and audits clean."""
        result = Projector(self.store).get(RUN)
        assert result.problem is None, result.problem
        report = build_report(result)
        assert report.ok, report.problem
        folded, live = result.state, self.writer.state
        assert folded.position == live.position == self.store.last_position(RUN)
        assert folded.trainer_version == live.trainer_version
        assert folded.groups == live.groups

    def consumed(self) -> list[Any]:
        return [g for g in self.writer.state.groups.values() if g.status is GroupStatus.CONSUMED]


# -- the happy path -----------------------------------------------------------------------


def test_runs_n_steps_with_lag_within_the_window(tmp_path):
    cfg = make_config("run.steps=4", "staleness.window_versions=1")
    h = Harness(cfg, tmp_path)
    assert h.run() == "completed"
    h.check_log()
    state = h.writer.state
    assert state.trainer_version == 4
    finished = h.events(ev.StepFinished)
    assert [e.trainer_version for e in finished] == [1, 2, 3, 4]
    consumed = h.consumed()
    assert len(consumed) == 4 * cfg.train.groups_per_step
    assert all(0 <= g.lag <= 1 for g in consumed), [(g.group_id, g.lag) for g in consumed]
    # lag as the design defines it: trainer_version at consumption - start version
    for g in consumed:
        base = state.steps[g.consumed_step].trainer_version - 1
        assert g.lag == base - g.weight_version_start
    published = [e.weight_version for e in h.events(ev.WeightsPublished)]
    assert published == [0, 1, 2, 3, 4]


def test_a_publish_behind_the_next_step_delivers_exactly_its_version(tmp_path):
    # Each refit takes 0.3 s (one bucket per generator), far longer than a microbatch of
    # the tiny model: the next step's finish must wait for it, or it would change the
    # weights while they travel and a StepFinished would overtake its predecessor's publish.
    cfg = make_config("run.steps=5", "staleness.window_versions=1", "controller.publish=behind")
    held: dict[str, dict[int, str]] = {}
    h = Harness(cfg, tmp_path, generator=SlowRefitGenerator, refit_s=0.3, held=held)
    assert h.run() == "completed"
    h.check_log()
    events = h.events()
    at = {("finished", e.trainer_version): i for i, e in enumerate(events) if isinstance(e, ev.StepFinished)}
    at.update({("published", e.weight_version): i for i, e in enumerate(events) if isinstance(e, ev.WeightsPublished)})
    for v in range(1, 5):
        assert at[("finished", v)] < at[("published", v)] < at[("finished", v + 1)]
    assert at[("finished", 5)] < at[("published", 5)]
    # every generator got each version's weights exactly as the trainer finished them
    digests = {e.trainer_version: e.weights_digest for e in h.events(ev.StepFinished)}
    assert set(held) == {g.name for g in h.workers.generators}
    for name, versions in held.items():
        assert {v: versions[v] for v in digests} == digests, name


def test_window_zero_is_on_policy(tmp_path):
    cfg = make_config("run.steps=2", "staleness.window_versions=0")
    h = Harness(cfg, tmp_path)
    h.run()
    h.check_log()
    assert h.writer.state.trainer_version == 2
    consumed = h.consumed()
    assert len(consumed) == 4
    assert [g.lag for g in consumed] == [0] * 4
    # on-policy: every group was dispatched and generated with the weights it is trained on
    for g in consumed:
        version = h.writer.state.steps[g.consumed_step].trainer_version - 1
        assert g.dispatch_weight_version == g.weight_version_start == g.weight_version_end == version


@pytest.mark.parametrize("selection", SELECTION_POLICIES)
def test_each_selection_policy_runs(tmp_path, selection):
    cfg = make_config("run.steps=2", "staleness.window_versions=1", f"staleness.selection={selection}")
    h = Harness(cfg, tmp_path)
    h.run()
    h.check_log()
    assert h.writer.state.trainer_version == 2
    assert all(g.lag <= 1 for g in h.consumed())
    if selection == "in_order":  # strict admission order, whatever finished first
        trained = [gid for e in h.events(ev.MicrobatchTrained) for gid in e.group_ids]
        assert trained == sorted(trained)


# -- failures ----------------------------------------------------------------------------


def test_failed_generation_is_readmitted_as_attempt_two(tmp_path):
    cfg = make_config("run.steps=2", "rollout.max_attempts=2")
    h = Harness(cfg, tmp_path, generator=FailingGenerator, fail_on=frozenset({("g000001", 1)}))
    h.run()
    h.check_log()
    [failed] = h.events(ev.GroupFailed)
    assert (failed.group_id, failed.attempt) == ("g000001", 1)
    assert "injected failure on g000001 attempt 1" in failed.reason
    admitted = [(e.group_id, e.attempt) for e in h.events(ev.RolloutAdmitted)]
    assert ("g000001", 2) in admitted
    committed = [e for e in h.events(ev.GroupCommitted) if e.group_id == "g000001"]
    assert [e.attempt for e in committed] == [2]
    group = h.writer.state.groups["g000001"]
    assert group.attempt == 2 and group.status is GroupStatus.CONSUMED
    assert h.writer.state.trainer_version == 2


def test_one_generator_call_carries_groups_per_call_groups(tmp_path):
    cfg = make_config(
        "run.steps=3", "rollout.groups_per_call=3", "train.groups_per_step=4",
        "train.groups_per_microbatch=2", "rollout.num_generators=1",
    )
    sizes: list[int] = []
    h = Harness(cfg, tmp_path, generator=CallSizeGenerator, sizes=sizes)
    assert h.run() == "completed"
    h.check_log()
    assert h.writer.state.trainer_version == 3
    # every group still has its own admission and commit, in dispatch order
    admitted = [e.group_id for e in h.events(ev.RolloutAdmitted)]
    committed = [e.group_id for e in h.events(ev.GroupCommitted)]
    assert len(set(admitted)) == len(admitted) and sorted(committed) == sorted(admitted)
    assert sum(sizes) == len(admitted)
    assert max(sizes) == 3 and len(sizes) < len(admitted), sizes
    assert all(g.lag is not None and 0 <= g.lag <= 1 for g in h.consumed())


def test_a_failed_call_fails_every_group_it_carried(tmp_path):
    cfg = make_config(
        "run.steps=2", "rollout.groups_per_call=2", "rollout.num_generators=1",
        "rollout.max_attempts=2",
    )
    sizes: list[int] = []
    h = Harness(cfg, tmp_path, generator=CallSizeGenerator, sizes=sizes,
                fail_on=frozenset({("g000001", 1)}))
    h.run()
    h.check_log()
    assert sizes[0] == 2  # g000000 and g000001 in one call
    failed = sorted((e.group_id, e.attempt) for e in h.events(ev.GroupFailed))
    assert failed == [("g000000", 1), ("g000001", 1)]
    for gid in ("g000000", "g000001"):
        group = h.writer.state.groups[gid]
        assert group.attempt == 2 and group.status is GroupStatus.CONSUMED
    assert h.writer.state.trainer_version == 2


@pytest.mark.parametrize("partial", ["false", "true"])
@pytest.mark.parametrize("bad", [0, 1])
def test_a_groups_own_failure_fails_only_that_group(tmp_path, partial, bad):
    # g000000 and g000001 (prompts 0 and 1) ride in one call; group ``bad``'s first
    # reward is nan. With partial rollouts a call runs its groups in order up to a
    # flush: g000000 failing leaves g000001 flushed or done in the same call
    cfg = make_config(
        "run.steps=2", "rollout.groups_per_call=2", "rollout.num_generators=1",
        "rollout.max_attempts=2", f"rollout.partial.enabled={partial}",
        "rollout.partial.segment_tokens=2",
    )
    h = Harness(cfg, tmp_path, generator=NanRewardGenerator, nan_prompt=bad)
    assert h.run() == "completed"
    h.check_log()
    failing, other = f"g00000{bad}", f"g00000{1 - bad}"
    [failed] = h.events(ev.GroupFailed)
    assert (failed.group_id, failed.attempt) == (failing, 1)
    assert failed.reason == ("generator-0: RewardValueError: task 'reverse' returned a reward "
                             "of nan; expected a finite number")
    committed = {(e.group_id, e.attempt) for e in h.events(ev.GroupCommitted)}
    assert (other, 1) in committed and (failing, 2) in committed
    assert h.writer.state.trainer_version == 2


def test_trainer_error_aborts_the_step_and_the_run_continues(tmp_path):
    cfg = make_config("run.steps=3", "controller.step_retries=2")
    # step 1 fails in its second microbatch: the first one's group was already claimed
    h = Harness(cfg, tmp_path, trainer=FlakyTrainer, fail_steps=frozenset({1}), fail_after=1)
    h.run()
    h.check_log()
    [aborted] = h.events(ev.StepAborted)
    assert aborted.step == 1
    assert "injected trainer failure in step 1" in aborted.reason
    state = h.writer.state
    assert state.trainer_version == 3
    # step numbers are never reused; the aborted step's groups went to the next one
    assert [e.step for e in h.events(ev.StepFinished)] == [0, 2, 3]
    returned = state.steps[1].group_ids
    assert len(returned) == 1 and state.groups[returned[0]].consumed_step == 2


def test_step_retries_exhausted_stops_the_run(tmp_path):
    cfg = make_config("run.steps=3", "controller.step_retries=1")
    h = Harness(cfg, tmp_path, trainer=FlakyTrainer, fail_steps=None)
    with pytest.raises(StepRetriesExhausted, match="2 steps in a row aborted"):
        h.run()
    h.check_log()
    assert [e.step for e in h.events(ev.StepAborted)] == [0, 1]
    assert h.events(ev.StepFinished) == []
    assert h.writer.state.trainer_version == 0 and h.writer.state.open_step is None


def _stalled(tmp_path, generator: type[GeneratorWorker]) -> tuple[Harness, str]:
    """A one-generator run whose ``generator`` hangs on ``release``; the watchdog's line."""
    cfg = make_config(
        "run.steps=2", "rollout.num_generators=1", "controller.stall_timeout_s=0.3"
    )
    release = threading.Event()
    h = Harness(cfg, tmp_path, generator=generator, release=release)
    try:
        with pytest.raises(StallError) as info:
            h.run()
    finally:
        release.set()  # let the worker thread go
    return h, str(info.value)


def test_stall_watchdog_says_what_waited_on_what(tmp_path):
    h, message = _stalled(tmp_path, BlockingGenerator)
    assert "stall_timeout_s=0.3" in message
    assert "train pump waiting for 1 selectable groups" in message
    assert "generators busy: {'generator-0': 1}" in message
    h.check_log()
    assert h.writer.state.trainer_version == 0


def test_window_zero_admits_as_soon_as_weights_are_published(tmp_path, monkeypatch):
    # At window 0 the admission gate opens only on WeightsPublished: that append must
    # wake the admission pump, not leave it to its wake-up timeout every step. With the
    # pumps' timeout taken away, a wake that never comes stalls the run (the watchdog
    # raises StallError) instead of being hidden by a timer.
    async def wait_for_wake_only(self, timeout_s: float = 0.5) -> None:
        self._wake.clear()
        await self._wake.wait()

    monkeypatch.setattr(Journal, "wait_wake", wait_for_wake_only)
    cfg = make_config("run.steps=3", "staleness.window_versions=0")
    h = Harness(cfg, tmp_path)
    h.run()
    h.check_log()
    events = h.events()
    admitted_after = []
    for i, e in enumerate(events):
        if isinstance(e, ev.WeightsPublished) and 0 < e.weight_version < 3:
            nxt = next(x for x in events[i + 1:] if isinstance(x, ev.RolloutAdmitted))
            admitted_after.append(nxt.weight_version)
    assert admitted_after == [1, 2]



class HungRefitGenerator(GeneratorWorker):
    """Holds every refit bucket after the start's publish (of v0) until ``release`` is
    set: the first step's publish never lands."""

    release: threading.Event

    def receive_weight_bucket(self, version, index, count, bucket):
        if version > 0:
            self.release.wait()
        return super().receive_weight_bucket(version, index, count, bucket)


def test_stall_watchdog_names_a_hung_in_line_publish(tmp_path):
    _, message = _stalled(tmp_path, HungRefitGenerator)
    assert "train pump publishing v1 in line" in message  # not "busy in a trainer call"
    assert "trainer_version 1, published v0" in message
