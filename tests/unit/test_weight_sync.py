"""Versioned weight sync: ordering, mid-group updates, and publishing through Ray's
object store to generator actors."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import torch

from workers.dataplane import MemoryDataPlane
from workers.generator import Generator
from workers.models.config import ModelSection, SamplingSection
from workers.models.factory import build_model
from workers.service import GeneratorWorker
from workers.tasks import Example, make_task
from workers.weight_sync import StaleWeightsError, VersionedWeights, cpu_state_dict

CFG = ModelSection(context_len=64, d_model=32, n_heads=2)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    model, _ = build_model(CFG, seed)
    return cpu_state_dict(model)


def test_idle_update_loads_now_and_acks():
    model, _ = build_model(CFG)
    w = VersionedWeights(model, "gen-a")
    new = _weights(7)
    ack = w.update(1, new)
    assert (ack.generator, ack.version, w.version) == ("gen-a", 1, 1)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in new.items())


def test_older_version_is_refused_and_weights_untouched():
    model, _ = build_model(CFG)
    w = VersionedWeights(model, "gen-a", version=4)
    before = cpu_state_dict(model)
    with pytest.raises(StaleWeightsError, match="refusing older version 3"):
        w.update(3, _weights(1))
    assert w.version == 4
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_update_from_another_thread_waits_for_a_step_boundary():
    model, _ = build_model(CFG)
    w = VersionedWeights(model, "gen-a")
    assert w.begin_group() == 0
    acks = []
    t = threading.Thread(target=lambda: acks.append(w.update(2, _weights(2))))
    t.start()
    assert w.wait_for_pending(timeout_s=30) == 2  # the update is waiting for a boundary
    assert w.version == 0 and not acks  # not applied mid-step
    w.at_step_boundary()
    t.join(timeout=5)
    assert w.version == 2 and acks[0].version == 2
    assert w.end_group() == 2


def test_pending_update_is_applied_after_the_end_version_is_read():
    model, _ = build_model(CFG)
    w = VersionedWeights(model, "gen-a")
    w.begin_group()
    t = threading.Thread(target=w.update, args=(1, _weights(1)))
    t.start()
    assert w.wait_for_pending(timeout_s=30) == 1
    assert w.end_group() == 0  # the group never saw version 1
    t.join(timeout=5)
    assert w.version == 1


def test_concurrent_update_during_generation_makes_versions_differ():
    model, tok = build_model(CFG)
    started = threading.Event()

    def held_first_step(step: int) -> None:  # the update arrives while the group runs
        if step == 0:
            started.set()
            gen.weights.wait_for_pending(timeout_s=60)

    gen = Generator(
        model, tok, make_task("reverse"), MemoryDataPlane(), "r", on_step=held_first_step
    )
    results = []
    worker = threading.Thread(
        target=lambda: results.append(
            gen.generate_group("g", Example("abc>", "cba"), 32, SamplingSection(max_new_tokens=40), 0)
        )
    )
    worker.start()
    assert started.wait(timeout=30)
    ack = gen.update_weights(1, _weights(5))  # blocks until loaded at a boundary
    worker.join(timeout=60)
    assert ack.version == 1
    assert (results[0].weight_version_start, results[0].weight_version_end) == (0, 1)


REPO_ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:  # the actors below are defined in this module: let Ray's workers import it
        path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield ray
    if started:
        ray.shutdown()


class HeldGeneratorWorker(GeneratorWorker):
    """The production generator worker, whose groups hold their first token step until
    a weight update waits for the step boundary: an update published while a group
    generates lands mid-group by construction, not by timing."""

    def __init__(self, spec, name: str) -> None:
        super().__init__(spec, name)
        self.started = threading.Event()
        self.generator.on_step = self._on_step

    def _on_step(self, step: int) -> None:
        if step == 0:
            self.started.set()
            self.generator.weights.wait_for_pending(timeout_s=120)

    def wait_started(self, timeout_s: float) -> bool:
        """True once a group is generating (test-only call, straight to the actor)."""
        return self.started.wait(timeout_s)


@pytest.mark.integration
def test_publish_through_object_store_and_mid_group_update_on_actors(ray_local, tmp_path):
    """The run's own path: ``Publisher`` hands the trainer actor's exported weights (one
    object in the store) to every generator actor; versions never go back; an update
    lands mid-group and is recorded."""
    from controller.config import load_config
    from controller.wiring import worker_spec
    from workers.api import GenerationRequest
    from workers.handles import GeneratorClientImpl, Publisher, RayHandle, TrainerClientImpl
    from workers.service import TrainerWorker

    cfg = load_config(None, [
        "dataplane.kind=memory", "dataplane.spill=false", "model.d_model=32",
        "model.n_heads=2", "model.context_len=64", "sampling.max_new_tokens=60",
    ])
    spec = worker_spec(cfg, "run", tmp_path)
    remote = ray_local.remote
    trainer = TrainerClientImpl(RayHandle(
        remote(TrainerWorker).options(num_cpus=0.5).remote(spec), name="trainer", role="trainer"
    ))
    actors = [
        remote(HeldGeneratorWorker).options(num_cpus=0.5, max_concurrency=2).remote(spec, name)
        for name in ("gen-0", "gen-1")
    ]
    gens = [
        GeneratorClientImpl(name, RayHandle(actor, name=name, role="generator"))
        for name, actor in zip(("gen-0", "gen-1"), actors)
    ]
    publisher = Publisher(trainer, gens)

    async def scenario():
        assert [await g.weight_version() for g in gens] == [0, 0]
        assert await publisher.publish(1) == ["gen-0", "gen-1"]
        assert [await g.weight_version() for g in gens] == [1, 1]
        with pytest.raises(StaleWeightsError):
            try:
                await publisher.publish(0, ["gen-0"])
            except ray_local.exceptions.RayTaskError as err:
                raise err.cause from None
        # a long group on gen-0; version 2 is published while it runs
        request = GenerationRequest(group_id="g", attempt=1, prompt_index=0, n_samples=64, seed=0)
        pending = gens[0].generate([request])
        assert await actors[0].wait_started.remote(120), "the group did not start"
        await publisher.publish(2)  # lands while gen-0's group is held at a step
        return (await pending)[0]

    try:
        result = asyncio.run(scenario())
    finally:
        for client in (trainer, *gens):
            client.handle.close()
    assert result.weight_version_start == 1
    assert result.weight_version_end == 2, "the update must land mid-group and be recorded"
