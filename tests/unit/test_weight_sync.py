"""Versioned weight sync: ordering, mid-group updates, and Ray object-store publish."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from workers.dataplane import DataPlaneConfig, MemoryDataPlane
from workers.generator import Generator
from workers.models.factory import ModelConfig, build_model
from workers.models.sampling import SamplingConfig
from workers.tasks import Example, make_task
from workers.weight_sync import StaleWeightsError, VersionedWeights, cpu_state_dict

CFG = ModelConfig(context_len=64, d_model=32, n_heads=2, init_seed=0)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    model, _ = build_model(ModelConfig(context_len=64, d_model=32, n_heads=2, init_seed=seed))
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
    time.sleep(0.2)
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
    time.sleep(0.2)
    assert w.end_group() == 0  # the group never saw version 1
    t.join(timeout=5)
    assert w.version == 1


def test_concurrent_update_during_generation_makes_versions_differ():
    model, tok = build_model(CFG)
    started = threading.Event()

    def slow_steps(step: int) -> None:
        if step == 0:
            started.set()
        time.sleep(0.05)

    gen = Generator(model, tok, make_task("reverse"), MemoryDataPlane(), "r", on_step=slow_steps)
    results = []
    worker = threading.Thread(
        target=lambda: results.append(
            gen.generate_group("g", Example("abc>", "cba"), 32, SamplingConfig(max_new_tokens=40), 0)
        )
    )
    worker.start()
    assert started.wait(timeout=30)
    ack = gen.update_weights(1, _weights(5))  # blocks until loaded at a boundary
    worker.join(timeout=60)
    assert ack.version == 1
    assert (results[0].weight_version_start, results[0].weight_version_end) == (0, 1)


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.integration
def test_publish_through_object_store_and_mid_group_update_on_actors(ray_local):
    from workers.generator.actor import spawn_generator
    from workers.weight_sync import publish_weights

    plane = DataPlaneConfig(kind="memory")
    gens = [
        spawn_generator(
            CFG, "reverse", plane, "run", f"gen-{i}", num_cpus=0.5,
            on_step=lambda step: time.sleep(0.02),  # ~1 s per 60-token group
        )
        for i in range(2)
    ]
    assert ray_local.get([g.weight_version.remote() for g in gens]) == [0, 0]
    acks = publish_weights(1, _weights(1), gens, timeout_s=60)
    assert [(a.generator, a.version) for a in acks] == [("gen-0", 1), ("gen-1", 1)]
    with pytest.raises(StaleWeightsError):
        try:
            publish_weights(0, _weights(0), gens[:1], timeout_s=60)
        except ray_local.exceptions.RayTaskError as err:
            raise err.cause from None

    # a long group on gen-0; version 2 is published while it runs
    sampling = SamplingConfig(max_new_tokens=60)
    pending = gens[0].generate_group.remote("g", Example("abc>", "cba"), 64, sampling, 0)
    time.sleep(0.4)
    publish_weights(2, _weights(2), gens, timeout_s=60)
    result = ray_local.get(pending, timeout=120)
    assert result.weight_version_start == 1
    assert result.weight_version_end == 2, "the update must land mid-group and be recorded"
