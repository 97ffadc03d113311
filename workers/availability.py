"""Can an optional backend run here? Plain checks with messages that say how to fix it.

The selected backend's module imports these at construction; ``workers.backends``
(the selection table) re-exports them. Kept apart from the table so that the backend
modules and the table do not import each other. Each check is a plain function of
(package importable, CUDA available), so tests exercise every message without the
packages installed.
"""

from __future__ import annotations

import importlib.util

MEGATRON_INSTALL_HINT = (
    "install it with `pip install 'rl-controller[megatron]'` (megatron-core; on CPU it "
    "runs data parallel over gloo with small shims, on GPU over NCCL)"
)
VLLM_INSTALL_HINT = (
    "install it with `pip install 'rl-controller[vllm]'` on a machine with a CUDA GPU, "
    "or the CPU build with `bash scripts/setup.sh --vllm` (see docs/backends.md)"
)


class BackendUnavailableError(RuntimeError):
    """The selected backend cannot run here (package or GPU missing); says how to fix it."""


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
            "train.backend = 'megatron' needs megatron-core, which is not installed; "
            + MEGATRON_INSTALL_HINT
        )
    if require_gpu and not cuda:
        raise BackendUnavailableError(
            "train.backend = 'megatron' with the distributed optimizer needs a CUDA GPU, "
            "and none is visible; use megatron.use_distributed_optimizer = false on CPU"
        )


def check_vllm(*, installed: bool, cuda: bool, cpu_build: bool = False) -> None:
    """Raise if the vLLM generator cannot run: vLLM needs a GPU unless it is the CPU build."""
    if not installed:
        raise BackendUnavailableError(
            "rollout.backend = 'vllm' needs vLLM, which is not installed; " + VLLM_INSTALL_HINT
        )
    if not cuda and not cpu_build:
        raise BackendUnavailableError(
            "rollout.backend = 'vllm' needs a CUDA GPU and none is visible (this vLLM "
            "build is not the CPU build); use rollout.backend = 'torch' here, or install "
            "the CPU build (docs/backends.md)"
        )
