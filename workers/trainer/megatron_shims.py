"""What megatron-core needs to run on the CPU, and its process-group setup.

megatron-core assumes CUDA in three places this backend reaches; for a trainer on the
CPU (a machine without CUDA, or ``device = "cpu"`` beside a GPU) each is replaced by a
small CPU equivalent, and nothing is replaced for a trainer on CUDA:

* the model-parallel RNG tracker (``tensor_parallel.get_cuda_rng_tracker``) forks CUDA
  RNG states around dropout; the CPU tracker's ``fork`` is a no-op context (the trainer
  keeps dropout off, so no random numbers are drawn inside it);
* the global memory buffer (``parallel_state.get_global_memory_buffer``), used by the
  local attention for its score matrix, allocates on ``torch.cuda.current_device()``;
  the CPU buffer allocates on the CPU;
* ``DistributedDataParallel`` allocates its contiguous gradient buffers on
  ``torch.cuda.current_device()``; :func:`buffers_on_cpu` points that call at the CPU
  only while the DDP wrapper is being built.

``ensure_parallel_state`` gives megatron its process groups: the default group if the
caller initialised one (gloo on CPU, NCCL on GPU), else a one-rank gloo group over an
in-memory store (no port), then ``initialize_model_parallel`` with tensor and
pipeline parallel size 1, so the data-parallel group is the whole world.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from workers.availability import BackendUnavailableError, MEGATRON_INSTALL_HINT


def require_megatron() -> None:
    """Import megatron-core or raise :class:`BackendUnavailableError` with the fix."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as err:
        raise BackendUnavailableError(
            f"train.backend = 'megatron' needs megatron-core, which is not installed "
            f"({err}); {MEGATRON_INSTALL_HINT}"
        ) from err


def cuda_available() -> bool:
    return torch.cuda.is_available()


def install_cpu_shims() -> None:
    """Replace megatron's CUDA-only RNG tracker and memory buffer (for a CPU trainer)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.utils import GlobalMemoryBuffer

    class CpuMemoryBuffer(GlobalMemoryBuffer):
        """``GlobalMemoryBuffer`` whose tensors live on the CPU."""

        def get_tensor(  # type: ignore[override]
            self, tensor_shape, dtype, name, mem_alloc_context=None
        ):
            n = math.prod(tensor_shape)
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < n:
                buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
            return buf[:n].view(*tensor_shape)

    class CpuRngTracker(mrandom.CudaRNGStatesTracker):
        """Records seeds; ``fork`` draws nothing (dropout is off in this trainer)."""

        def add(self, name, seed):  # type: ignore[override]
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = seed

        def fork(self, name="model-parallel-rng"):  # type: ignore[override]
            return contextlib.nullcontext()

    if not isinstance(parallel_state._GLOBAL_MEMORY_BUFFER, CpuMemoryBuffer):
        parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


@contextlib.contextmanager
def buffers_on_cpu(cpu: bool) -> Iterator[None]:
    """While building DDP for a CPU trainer, ``torch.cuda.current_device()`` means the CPU
    (also where CUDA is present: a CPU trainer's gradient buffers belong on the CPU)."""
    if not cpu:
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]


def ensure_parallel_state(timeout_s: float = 600.0, *, cpu: bool | None = None) -> None:
    """Default process group (one-rank gloo if none) + megatron's groups at TP = PP = 1;
    ``cpu``: the trainer runs on the CPU (default: when CUDA is absent)."""
    cpu = not cuda_available() if cpu is None else cpu
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1,
            timeout=timedelta(seconds=timeout_s),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1
        )
        if not cpu:
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(1234)
    if cpu:
        install_cpu_shims()
    if parallel_state.get_data_parallel_world_size() != dist.get_world_size():
        raise RuntimeError(
            "the megatron trainer supports data parallelism only (tensor and pipeline "
            "parallel size 1): the data-parallel group must be the whole world"
        )


def destroy_parallel_state() -> None:
    """Tear down megatron's groups (the default group is the caller's to destroy)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
