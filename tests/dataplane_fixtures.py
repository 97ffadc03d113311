"""Data plane fixtures: one contract suite runs over every implementation.

``transferqueue`` really starts Ray (4 logical CPUs -- fewer makes TransferQueue's
init hang) and TransferQueue once per module and shuts both down at the end; each
test writes to its own partition, which is cleared afterwards.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from workers.batch import ROW_FIELDS
from workers.dataplane import DataPlane, MemoryDataPlane, SpillDataPlane

PLANE_KINDS = [
    "memory",
    "spill",
    pytest.param("transferqueue", marks=pytest.mark.integration),
]


@pytest.fixture(scope="module")
def tq_plane() -> Iterator[DataPlane]:
    ray = pytest.importorskip("ray")
    from workers.dataplane.transferqueue import TransferQueueDataPlane

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    plane = TransferQueueDataPlane()
    try:
        yield plane
    finally:
        plane.close()
        if started_ray:
            ray.shutdown()


@pytest.fixture
def partition(request: pytest.FixtureRequest) -> str:
    return "t-" + re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)


@pytest.fixture(params=PLANE_KINDS)
def plane(request: pytest.FixtureRequest, tmp_path, partition: str) -> Iterator[DataPlane]:
    if request.param == "memory":
        impl: DataPlane = MemoryDataPlane()
    elif request.param == "spill":
        impl = SpillDataPlane(MemoryDataPlane(), tmp_path / "spill")
    else:
        impl = request.getfixturevalue("tq_plane")
    try:
        yield impl
    finally:
        impl.clear(partition)


def grpo_rows(
    groups: int, samples: int, prompt_len: int, max_completion: int, seed: int = 0
) -> tuple[list[str], list[dict[str, torch.Tensor]]]:
    """Rows shaped like the generator's (``ROW_FIELDS``), with jagged completions."""
    g = torch.Generator().manual_seed(seed)
    keys, rows = [], []
    for gi in range(groups):
        for si in range(samples):
            comp = int(torch.randint(1, max_completion + 1, (1,), generator=g))
            t = prompt_len + comp
            mask = torch.zeros(t, dtype=torch.bool)
            mask[prompt_len:] = True
            lp = torch.where(mask, -torch.rand(t, generator=g), torch.zeros(t))
            rows.append(
                {
                    "input_ids": torch.randint(2, 40, (t,), generator=g),
                    "loss_mask": mask,
                    "generator_logprobs": lp,
                    # two versions in some samples: a refit landed mid-completion
                    "token_versions": torch.where(
                        mask, torch.arange(t) // max(1, t - comp // 2) + 3, torch.full((t,), -1)
                    ),
                    "reward": torch.rand((), generator=g),
                    "prompt_len": torch.tensor(prompt_len),
                    "completion_len": torch.tensor(comp),
                }
            )
            keys.append(f"run/g{gi:04d}/a0/s{si}")
    assert set(rows[0]) == set(ROW_FIELDS)
    return keys, rows
