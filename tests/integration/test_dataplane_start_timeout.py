"""TransferQueue's own start is bounded: an unplaceable TransferQueue is reported, not waited on;
a process that only joins waits for it (bounded too) and never starts one.

A real local Ray with 4 logical CPUs, all held by a placeholder actor: TransferQueue's
controller cannot be placed (and so its storage units are never created). The adapter
must give up after ``start_timeout_s``, say what is pending, and leave nothing behind:
once the CPUs are free, TransferQueue starts in the same process and moves a row.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration

ray = pytest.importorskip("ray")

from workers.dataplane.api import DataPlaneUnavailable  # noqa: E402
from workers.dataplane.config import DataPlaneRuntime, DataPlaneSection  # noqa: E402
from workers.dataplane.transferqueue import TransferQueueDataPlane  # noqa: E402


@pytest.fixture
def small_ray():
    if ray.is_initialized():
        pytest.skip("needs its own Ray (one is already initialised in this process)")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote(num_cpus=4)
class _Hog:
    def ping(self) -> bool:
        return True


def test_unplaceable_transferqueue_is_refused_with_what_is_pending(small_ray):
    hog = _Hog.remote()
    assert ray.get(hog.ping.remote(), timeout=120)  # every CPU is held from here on
    with pytest.raises(DataPlaneUnavailable) as caught:
        TransferQueueDataPlane(DataPlaneSection(storage_units=2, start_timeout_s=2))
    message = str(caught.value)
    assert "dataplane.start_timeout_s = 2 s" in message, message
    assert "its controller" in message, message
    assert "storage unit(s) 0, 1 (not created yet)" in message, message
    assert "0 of 4 CPUs free" in message, message

    # The killed actors are gone and the adapter forgot them: with the CPUs back,
    # TransferQueue starts in this process and works.
    ray.kill(hog)
    plane = TransferQueueDataPlane(DataPlaneSection(storage_units=1, start_timeout_s=300))
    try:
        plane.put("p", ["k"], {"x": [torch.arange(3, dtype=torch.float64)]})
        (row,) = plane.get("p", ["k"])
        assert torch.equal(row["x"], torch.arange(3, dtype=torch.float64))
    finally:
        plane.close()


@ray.remote(num_cpus=1)
class _Joiner:
    """A worker's side: joins the TransferQueue the driver starts (created before it)."""

    def __init__(self, timeout_s: float) -> None:
        self.plane = TransferQueueDataPlane(
            DataPlaneSection(start_timeout_s=timeout_s), DataPlaneRuntime(join=True)
        )

    def get(self, partition: str, key: str) -> list[float]:
        (row,) = self.plane.get(partition, [key])
        return row["x"].tolist()


def test_a_joiner_created_first_waits_for_transferqueue_then_joins_it(small_ray):
    joiner = _Joiner.remote(300)  # its process starts (and waits) while TQ starts below
    plane = TransferQueueDataPlane(DataPlaneSection(storage_units=1, start_timeout_s=300))
    try:
        plane.put("p", ["k"], {"x": [torch.arange(3, dtype=torch.float64)]})
        assert ray.get(joiner.get.remote("p", "k"), timeout=300) == [0.0, 1.0, 2.0]
    finally:
        ray.kill(joiner)
        plane.close()


def test_a_joiner_never_starts_transferqueue_and_says_what_it_waited_for(small_ray):
    with pytest.raises(DataPlaneUnavailable) as caught:
        TransferQueueDataPlane(DataPlaneSection(start_timeout_s=1), DataPlaneRuntime(join=True))
    assert str(caught.value) == (
        "no TransferQueue to join within dataplane.start_timeout_s = 1 s "
        "(waiting for its controller)"
    )
    with pytest.raises(ValueError):  # nothing was started
        ray.get_actor("TransferQueueController", namespace="transfer_queue")
