"""Backend selection: which trainer and which generator a run builds, by config.

================  =====================  ================================================
config key        value                  built by
================  =====================  ================================================
train.backend     ``"torch"`` (default)  ``trainer.torch_backend.parallelize_torch``
train.backend     ``"megatron"``         ``trainer.megatron_backend.parallelize_megatron``
train.backend     ``"fsdp2"``            ``trainer.fsdp2_backend.parallelize_fsdp2``
rollout.backend   ``"torch"`` (default)  ``generator.generator.Generator``
rollout.backend   ``"vllm"``             ``generator.vllm_backend.VllmGenerator``
================  =====================  ================================================

(modules under ``workers.``)

Every trainer backend is the one :class:`workers.trainer.rank.RankTrainer` with that
backend's parallelism applied (``workers.trainer.parallel``); ``make_trainer`` is the
only place that picks one, for the trainer worker and for each rank actor alike.

Optional backends are imported only when selected, so a run that never asks for them
needs neither package. A backend that cannot run here fails at construction with
:class:`BackendUnavailableError`, whose message names the missing piece (package or
GPU) and how to get it -- never a silent fall back to another backend. Each check is a
plain function of (package importable, CUDA available), so tests exercise every message
without the packages installed (``workers.availability``, which the backend modules
import instead of this table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args

from workers.availability import (
    MEGATRON_INSTALL_HINT,
    VLLM_INSTALL_HINT,
    BackendUnavailableError,
    check_megatron,
    check_vllm,
    cuda_available,
    package_available,
)
from workers.trainer.config import ModelFactory, TrainerBackend, TrainerRuntime, TrainSection
from workers.trainer.options import BackendOptions, Fsdp2Options, MegatronOptions

if TYPE_CHECKING:
    from workers.trainer.rank import RankTrainer

GeneratorBackend = Literal["torch", "vllm"]
_T = TypeVar("_T")

__all__ = [
    "MEGATRON_INSTALL_HINT", "VLLM_INSTALL_HINT", "BackendUnavailableError", "GeneratorBackend",
    "TrainerBackend", "check_megatron", "check_vllm", "cuda_available", "make_generator",
    "make_trainer", "package_available",
]


def _check_choice(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key} = {value!r}; expected one of {list(allowed)}")


def _checked(backend: str, options: object, kind: type[_T] | None) -> _T | None:
    """``options`` if the backend takes that type (None: it takes none)."""
    if options is None:
        return None
    if kind is None or not isinstance(options, kind):
        wanted = "no options" if kind is None else kind.__name__
        raise TypeError(f"train.backend = {backend!r} takes {wanted}, got {options!r}")
    return options


def make_trainer(
    backend: TrainerBackend,
    model_factory: ModelFactory,
    train: TrainSection | None = None,
    runtime: TrainerRuntime | None = None,
    options: BackendOptions | None = None,
) -> RankTrainer:
    """One trainer rank of the selected backend (call inside the rank's process): the
    ``[train]`` table as it is, the run's ``runtime`` beside it, and the backend's
    ``options`` (knobs no config key sets; None: its defaults)."""
    _check_choice("train.backend", backend, get_args(TrainerBackend))
    if backend == "torch":
        _checked(backend, options, None)
        from workers.trainer.torch_backend import TorchTrainer

        return TorchTrainer(model_factory, train, runtime)
    if backend == "fsdp2":  # torch.distributed only: nothing extra to install
        from workers.trainer.fsdp2_backend import Fsdp2Trainer

        return Fsdp2Trainer(model_factory, train, runtime, _checked(backend, options, Fsdp2Options))
    megatron = _checked(backend, options, MegatronOptions)
    check_megatron(installed=package_available("megatron.core"), cuda=cuda_available())
    from workers.trainer.megatron_backend import MegatronTrainer

    return MegatronTrainer(model_factory, train, runtime, megatron)


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
