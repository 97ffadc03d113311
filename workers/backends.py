"""Backend selection: which trainer and which generator a run builds, by config.

==================  =======================  =========================================
config key          value                    built by
==================  =======================  =========================================
train.backend       ``"torch"`` (default)    ``workers.trainer.torch_backend.TorchTrainer``
train.backend       ``"megatron"``           ``workers.trainer.megatron_backend.MegatronTrainer``
train.backend       ``"fsdp2"``              ``workers.trainer.fsdp2_backend.Fsdp2Trainer``
rollout.backend     ``"torch"`` (default)    ``workers.generator.generator.Generator``
rollout.backend     ``"vllm"``               ``workers.generator.vllm_backend.VllmGenerator``
==================  =======================  =========================================

Optional backends are imported only when selected, so a run that never asks for them
needs neither package. A backend that cannot run here fails at construction with
:class:`BackendUnavailableError`, whose message names the missing piece (package or
GPU) and how to get it -- never a silent fall back to another backend. Each check is a
plain function of (package importable, CUDA available), so tests exercise every message
without the packages installed (``workers.availability``, which the backend modules
import instead of this table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, get_args

from workers.availability import (
    MEGATRON_INSTALL_HINT,
    VLLM_INSTALL_HINT,
    BackendUnavailableError,
    check_megatron,
    check_vllm,
    cuda_available,
    package_available,
)
from workers.trainer.config import TrainerBackend

if TYPE_CHECKING:
    from workers.trainer.api import Trainer

GeneratorBackend = Literal["torch", "vllm"]

__all__ = [
    "MEGATRON_INSTALL_HINT", "VLLM_INSTALL_HINT", "BackendUnavailableError", "GeneratorBackend",
    "TrainerBackend", "check_megatron", "check_vllm", "cuda_available", "make_generator",
    "make_trainer", "package_available",
]

def _check_choice(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key} = {value!r}; expected one of {list(allowed)}")


def make_trainer(
    backend: TrainerBackend, model_factory: Any, config: Any = None, **options: Any
) -> "Trainer":
    """One trainer rank of the selected backend (call inside the rank's process)."""
    _check_choice("train.backend", backend, get_args(TrainerBackend))
    if backend == "torch":
        if options:
            raise TypeError(f"train.backend = 'torch' takes no options, got {sorted(options)}")
        from workers.trainer.torch_backend import TorchTrainer

        return TorchTrainer(model_factory, config)
    if backend == "fsdp2":  # torch.distributed only: nothing extra to install
        from workers.trainer.fsdp2_backend import Fsdp2Trainer

        return Fsdp2Trainer(model_factory, config, **options)
    check_megatron(installed=package_available("megatron.core"), cuda=cuda_available())
    from workers.trainer.megatron_backend import MegatronTrainer

    return MegatronTrainer(model_factory, config, **options)


def make_generator(backend: GeneratorBackend, **kwargs: Any) -> Any:
    """A rollout generator of the selected backend.

    ``torch``: ``Generator(model, tokenizer, task, dataplane, run_id, ...)`` keyword
    arguments. ``vllm``: ``VllmGenerator(model_path, tokenizer, task, dataplane, run_id,
    ...)`` keyword arguments (vLLM loads the model itself from a local directory).
    """
    _check_choice("rollout.backend", backend, get_args(GeneratorBackend))
    if backend == "torch":
        from workers.generator.generator import Generator

        return Generator(**kwargs)
    from workers.generator.vllm_backend import VllmGenerator, vllm_is_cpu_build

    installed = package_available("vllm")
    cpu_build = installed and vllm_is_cpu_build()
    check_vllm(installed=installed, cuda=cuda_available(), cpu_build=cpu_build)
    return VllmGenerator(**kwargs)
