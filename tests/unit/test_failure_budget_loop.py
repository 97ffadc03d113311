"""The failure budget in the real controller loop (in-process workers, in-memory log).

Generators that fail on purpose -- every one, or one of two -- are real
``GeneratorWorker`` subclasses; the log each run leaves is folded again, audited, and
checked against the rules the pure core states: every call a backing-off generator got
came no earlier than ``failures.ready_at`` allowed, and the run stops (``RunStopped``,
then ``RunStoppedError``) after exactly the budget's failures, not one more call.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from controller.core import failures
from controller.core.reducer import apply
from controller.core.state import initial_state
from controller.loop import Controller, RunStoppedError
from controller.recovery import reconcile_workers
from controller.startup import resume_run
from controller.wiring import start_workers, worker_spec
from events import schema as ev
from tests.unit.test_loop_inprocess import RUN, Harness, make_config
from workers.service import GeneratorWorker

EMPTY = "cannot sample from an empty prompt"


class SickGenerator(GeneratorWorker):
    """Raises what the HF generator raised with a tokenizer that encodes to nothing,
    on the generators named in ``sick`` (every one when None). With a ``Tally`` the
    healthy ones generate only once the sick ones failed ``tally.needed`` calls: the
    run cannot end before a sick generator was called again after backing off."""

    sick: frozenset[str] | None = None
    tally: Tally | None = None

    def generate(self, req):
        if self.sick is None or self.name in self.sick:
            if self.tally is not None:
                self.tally.failed()
            raise ValueError(EMPTY)
        if self.tally is not None:
            assert self.tally.enough.wait(120), "the sick generator was not called again"
        return super().generate(req)


class Tally:
    """Failed calls of the sick generators, shared across the worker threads."""

    def __init__(self, needed: int) -> None:
        self.needed, self.count = needed, 0
        self.lock, self.enough = threading.Lock(), threading.Event()

    def failed(self) -> None:
        with self.lock:
            self.count += 1
            if self.count >= self.needed:
                self.enough.set()


def _calls_respect_the_back_off(h: Harness) -> int:
    """Fold the log again; every admission to a generator came at or after the time its
    failure streak allowed. Returns how many admissions had to wait."""
    cfg = h.cfg
    state, waited = initial_state(), 0
    for stored in h.store.read(RUN):
        event = stored.event
        if isinstance(event, ev.RolloutAdmitted) and event.generator:
            due = failures.ready_at(state.failures, event.generator, cfg.failures,
                                    cfg.rollout.groups_per_call)
            assert event.ts >= due, (stored.position, event.generator, event.ts, due)
            waited += due > 0
        apply(state, stored)
    return waited


def test_when_every_call_fails_the_run_stops_after_the_budget_naming_the_cause(tmp_path):
    cfg = make_config("run.steps=3", "failures.backoff_s=0.02")
    budget = cfg.failures.budget(cfg.rollout.num_generators, cfg.rollout.groups_per_call)
    h = Harness(cfg, tmp_path, generator=SickGenerator)
    with pytest.raises(RunStoppedError) as err:
        h.run()
    h.check_log()
    assert str(err.value).endswith(f"all with: ValueError: {EMPTY} (on generator-0)") or \
        str(err.value).endswith(f"all with: ValueError: {EMPTY} (on generator-1)")
    stops = h.events(ev.RunStopped)
    assert len(stops) == 1 and stops[0].cause == f"ValueError: {EMPTY}"
    # the budget's failures, then the stop; what was in flight then may still fail after it
    events = h.events()
    at = events.index(stops[0])
    assert sum(isinstance(e, ev.GroupFailed) for e in events[:at]) == budget
    assert sum(isinstance(e, ev.GroupFailed) for e in events[at:]) <= cfg.rollout.num_generators
    assert len(events) <= 2 + 2 * (budget + cfg.rollout.num_generators) + 1
    assert _calls_respect_the_back_off(h) > 0
    assert not h.events(ev.RunFinished) and h.writer.state.failures.stopped == stops[0].reason


def test_a_sick_generator_backs_off_while_the_healthy_one_trains(tmp_path):
    cfg = make_config("run.steps=4", "failures.backoff_s=0.05")
    h = Harness(cfg, tmp_path, generator=SickGenerator, sick=frozenset({"generator-0"}),
                tally=Tally(needed=3))
    assert h.run() == "completed"
    h.check_log()
    assert h.writer.state.trainer_version == 4 and not h.events(ev.RunStopped)
    # its second and third calls each waited for the back-off its failures set
    assert _calls_respect_the_back_off(h) >= 2
    failed = h.events(ev.GroupFailed)
    assert failed and all(f.reason == f"generator-0: ValueError: {EMPTY}" for f in failed)


def test_a_stopped_run_resumes_with_a_fresh_budget_once_fixed(tmp_path):
    cfg = make_config("run.steps=2", "failures.backoff_s=0.02")
    h = Harness(cfg, tmp_path, generator=SickGenerator)
    with pytest.raises(RunStoppedError):
        h.run()
    # the cause is fixed (the real generator), a new controller takes the run over
    writer = resume_run(h.store, RUN)
    assert writer.state.failures.stopped is None and writer.state.failures.in_row == 0
    workers = start_workers(cfg, worker_spec(cfg, RUN, tmp_path), local=True)
    try:
        asyncio.run(reconcile_workers(writer, workers, cfg.checkpoint,
                                      checkpoint_dir=h.checkpoint_dir))
        controller = Controller(writer, cfg, workers.trainer, workers.generators,
                                workers.publisher, workers.payloads,
                                checkpoint_dir=h.checkpoint_dir)
        assert asyncio.run(controller.run()) == "completed"
    finally:
        workers.close()
    h.writer = writer
    h.check_log()
    assert writer.state.trainer_version == 2
