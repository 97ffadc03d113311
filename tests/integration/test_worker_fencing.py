"""Fencing at the workers: the race the controller-side check cannot close, made exact.

Controller A passes its epoch check (``Journal.ensure_owner``, against the real
log) and is "paused" right there -- the test simply does not make A's call yet.
Controller B claims the run and makes its first call to the same worker objects
(its own handles, its own epoch). Then A makes the call it had checked for. The
worker must refuse it with ``StaleEpochError`` naming both epochs, and nothing A's
call would have changed -- trainer weights, data-plane rows, generator weight
versions -- may change. No sleeps, no timing: every ordering is forced.
One case per call type the controller makes; counts come from the worker handles
(the calls A issued) and the workers' fences (the calls they refused).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from workers.api import GenerationRequest, MicrobatchRef
from workers.calls import GeneratorCalls, TrainerCalls
from controller.startup import resume_run
from events.redis_store import RedisEventStore
from tests.integration.recovery_helpers import (
    controller_for,
    reconcile,
    start_local,
    tiny_config,
)
from tests.integration.test_fencing import _open
from workers.fencing import EpochToken, StaleEpochError
from workers.handles import GeneratorClientImpl, LocalHandle, PayloadStoreImpl, Publisher, TrainerClientImpl

pytestmark = pytest.mark.integration

RUN = "fenced"


class Race:
    """A (epoch 1) with real in-process workers, and B's handles over the same objects."""

    def __init__(self, redis_url: str, tmp_path) -> None:
        cfg = tiny_config(tmp_path)
        self.store_a, self.writer_a = _open(redis_url, cfg)
        self.a = start_local(cfg, RUN, tmp_path / "run")
        reconcile(self.a, self.writer_a)  # A's token = epoch 1; weights published
        self.controller_a = controller_for(self.a, self.writer_a)
        self.plane = self.a.workers.dataplane
        self.trainer_obj = self.a.workers.trainer.handle.obj
        self.gen_objs = [g.handle.obj for g in self.a.workers.generators]
        self.tmp = tmp_path
        self.store_b = RedisEventStore(redis_url)
        self.token_b = EpochToken()

    # -- A's side -------------------------------------------------------------

    def a_do(self, call: Callable[[], Any]) -> Any:
        """Run one of A's client calls (inside a loop: handles submit on the running one)."""

        async def run() -> Any:
            return await call()

        return asyncio.run(run())

    def rows_for(self, group: str) -> list[str]:
        req = GenerationRequest(group_id=group, attempt=0, prompt_index=3, n_samples=4, seed=7)
        [out] = self.a_do(lambda: self.a.workers.generators[0].generate([req]))
        return out.payload_keys

    # -- B's side -------------------------------------------------------------

    def b_handle(self, obj: Any, name: str) -> LocalHandle:
        handle = LocalHandle(obj, name=f"b-{name}")
        handle.token = self.token_b
        return handle

    def b_claims_and_contacts(self) -> int:
        """B claims the run, then its first call goes to every worker."""
        writer_b = resume_run(self.store_b, RUN)
        self.token_b.value = writer_b.epoch

        async def first_contact() -> None:
            await self.b_handle(self.trainer_obj, "trainer").call(TrainerCalls.version_and_digest)
            for i, obj in enumerate(self.gen_objs):
                await self.b_handle(obj, f"gen{i}").call(GeneratorCalls.weight_version)

        asyncio.run(first_contact())
        return writer_b.epoch

    # -- what must not change -------------------------------------------------

    def observe(self) -> dict[str, Any]:
        return {
            "trainer": self.trainer_obj.version_and_digest(),  # direct: no fence involved
            "rows": sorted(self.plane.list(RUN)),
            "generators": [g.generator.weight_version for g in self.gen_objs],
        }

    def refused(self) -> int:
        return self.trainer_obj.fence.refused + sum(g.fence.refused for g in self.gen_objs)

    def close(self) -> None:
        self.a.workers.close()
        self.store_a.close()
        self.store_b.close()


@pytest.fixture
def race(redis_url: str, tmp_path):
    r = Race(redis_url, tmp_path)
    yield r
    r.close()


def _prepare(race: Race, case: str) -> Callable[[], Any]:
    """Set up what A's call needs (as epoch 1, before any takeover); return the call."""
    w = race.a.workers
    trainer: TrainerClientImpl = w.trainer
    gen: GeneratorClientImpl = w.generators[0]
    keys = race.rows_for("g-prep")
    ref = MicrobatchRef(payload_keys=keys, advantages=[1.0, -1.0, 0.5, -0.5])

    async def train_one_step() -> None:
        await trainer.begin_train_step(1)
        await trainer.train_microbatch(ref)
        await trainer.finish_train_step()

    if case in ("train_microbatch", "finish_train_step", "abort_train_step"):
        race.a_do(lambda: trainer.begin_train_step(1))
        if case == "finish_train_step":
            race.a_do(lambda: trainer.train_microbatch(ref))
    ckpt = race.tmp / "ckpt-v0"
    if case == "load_checkpoint":
        saved = race.a_do(lambda: trainer.save_checkpoint(str(ckpt)))
    if case in ("load_checkpoint", "reset", "publish", "update_weights"):
        race.a_do(train_one_step)  # trainer at v1: a load, reset or publish would show
    weights = race.trainer_obj.export_weights() if case == "update_weights" else None

    calls: dict[str, Callable[[], Any]] = {
        "begin_train_step": lambda: trainer.begin_train_step(2),
        "train_microbatch": lambda: trainer.train_microbatch(ref),
        "finish_train_step": lambda: trainer.finish_train_step(),
        "abort_train_step": lambda: trainer.abort_train_step(),
        "save_checkpoint": lambda: trainer.save_checkpoint(str(race.tmp / "ckpt-zombie")),
        "load_checkpoint": lambda: trainer.load_checkpoint(str(ckpt), saved.sha256),
        "reset": lambda: trainer.reset(),
        "generate": lambda: gen.generate([GenerationRequest(
            group_id="g-zombie", attempt=0, prompt_index=5, n_samples=4, seed=9)]),
        "update_weights": lambda: gen.handle.call(GeneratorCalls.update_weights, 1, weights),
        "publish": lambda: Publisher(trainer, w.generators).publish(1),
        "delete_payloads": lambda: PayloadStoreImpl(race.plane, RUN, trainer).delete(keys),
    }
    return calls[case]


CASES = [
    "begin_train_step", "train_microbatch", "finish_train_step", "abort_train_step",
    "save_checkpoint", "load_checkpoint", "reset", "generate", "update_weights", "publish",
    "delete_payloads",
]


@pytest.mark.parametrize("case", CASES)
def test_zombie_call_after_its_check_is_refused_by_the_worker(race: Race, case: str) -> None:
    a_call = _prepare(race, case)
    race.controller_a.journal.ensure_owner()  # A's check passes: epoch 1 is still current
    # ---- A is paused here, between its check and its call ----
    issued_before = len(race.a.calls.calls)
    epoch_b = race.b_claims_and_contacts()
    assert epoch_b == 2
    before, refused_before = race.observe(), race.refused()
    # ---- A is released: it makes the call it checked for ----
    with pytest.raises(StaleEpochError) as info:
        race.a_do(a_call)
    assert (info.value.epoch, info.value.current_epoch) == (1, 2)
    assert "epoch 1" in str(info.value) and "epoch 2" in str(info.value)
    assert race.observe() == before
    assert race.refused() == refused_before + 1
    assert len(race.a.calls.calls) == issued_before + 1  # A's call did reach a handle
    if case == "save_checkpoint":
        assert not (race.tmp / "ckpt-zombie").exists()


def test_a_generation_in_flight_cannot_write_its_rows_after_a_takeover(race: Race) -> None:
    """A's generate was admitted before B's first contact; its rows land after it: refused."""
    gen_obj = race.gen_objs[0]
    writes = gen_obj.generator.dataplane
    reached, release = threading.Event(), threading.Event()
    original_put = writes.put

    def paused_put(*args: Any, **kwargs: Any) -> None:
        reached.set()
        assert release.wait(60)
        original_put(*args, **kwargs)

    writes.put = paused_put
    outcome: dict[str, BaseException | None] = {}

    def a_generates() -> None:
        req = GenerationRequest(group_id="g-flight", attempt=0, prompt_index=1, n_samples=4, seed=3)
        try:
            race.a_do(lambda: race.a.workers.generators[0].generate([req]))
            outcome["error"] = None
        except BaseException as err:  # noqa: BLE001 - reported below
            outcome["error"] = err

    thread = threading.Thread(target=a_generates)
    thread.start()
    assert reached.wait(60), "A's generation never reached its row write"
    race.b_claims_and_contacts()
    before = race.observe()
    release.set()
    thread.join(60)
    assert isinstance(outcome["error"], StaleEpochError), outcome
    assert race.observe() == before
    assert not any("g-flight" in k for k in race.plane.list(RUN))
