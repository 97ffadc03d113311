"""Ray actor shell over :class:`workers.generator.generator.Generator`.

The actor builds its model, task and data plane from plain configs (so nothing large
or unpicklable crosses at construction) and forwards calls. It runs with
``max_concurrency=2`` so that ``update_weights`` can arrive while ``generate_group``
is running; the update is then applied at the next token-step boundary. ``on_step``
(called at every token-step boundary) is for tracing and for tests that need a group
to take a while.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import ray
import torch

from workers.dataplane import DataPlaneConfig, make_dataplane
from workers.generator.generator import Generator, GroupResult
from workers.models.factory import ModelConfig, build_model
from workers.models.sampling import SamplingConfig
from workers.tasks import Example, make_task
from workers.weight_sync import WeightsAck


class GeneratorActor:
    def __init__(
        self,
        model: ModelConfig,
        task: str,
        dataplane: DataPlaneConfig,
        run_id: str,
        name: str,
        task_options: Mapping[str, Any] | None = None,
        weight_version: int = 0,
        torch_threads: int = 1,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        torch.set_num_threads(torch_threads)
        net, tokenizer = build_model(model)
        self.generator = Generator(
            net,
            tokenizer,
            make_task(task, **dict(task_options or {})),
            make_dataplane(dataplane),
            run_id,
            name=name,
            weight_version=weight_version,
            on_step=on_step,
        )

    def generate_group(
        self,
        group_id: str,
        prompt: Example,
        n: int,
        sampling: SamplingConfig,
        seed: int,
        attempt: int = 0,
    ) -> GroupResult:
        return self.generator.generate_group(group_id, prompt, n, sampling, seed, attempt)

    def update_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> WeightsAck:
        return self.generator.update_weights(version, state_dict)

    def weight_version(self) -> int:
        return self.generator.weight_version


def spawn_generator(*args: Any, num_cpus: float = 1, **kwargs: Any) -> Any:
    """Start a :class:`GeneratorActor` (same arguments) and return its handle."""
    cls = ray.remote(GeneratorActor)
    return cls.options(max_concurrency=2, num_cpus=num_cpus).remote(*args, **kwargs)
