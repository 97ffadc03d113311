"""Knobs of the optional trainer backends (``workers.backends.make_trainer``'s ``options``).

Kept apart from the backend modules, which import torch.distributed, FSDP and
megatron-core: choosing options (the trainer worker derives them from ``[train]``)
loads none of that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Fsdp2Options:
    """Knobs of the FSDP2 backend no config key sets (tests choose them); the mesh's
    tensor-parallel degree and where gradients are reduce-scattered are the ``[train]``
    table's ``tensor_parallel`` and ``fsdp2_grad_reduce``."""

    #: FSDP's gradient divide factor. 1.0 = raw sums (correct for the split API);
    #: None = FSDP's default, the average over dp ranks -- wrong, kept for the tests
    gradient_divide_factor: float | None = 1.0
    #: free each block's gathered parameters after its forward (memory over time)
    reshard_after_forward: bool = True
    #: cast the model's parameters after building it; None = ``TrainerRuntime.dtype``
    param_dtype: Literal["float32", "float64"] | None = None


@dataclass(frozen=True)
class MegatronOptions:
    """Knobs of the megatron backend (``trainer.megatron.*``)."""

    #: bucketed async reduction (mcore ``overlap_grad_reduce``); finish then dispatches it
    overlap_grad_reduce: bool = False
    #: megatron's distributed optimizer; None = on when the trainer runs on CUDA
    use_distributed_optimizer: bool | None = None
    #: accumulate and reduce gradients in fp32 whatever the parameter dtype
    grad_reduce_in_fp32: bool = True
    #: elements per bucket with overlap on; None = mcore's default
    bucket_size: int | None = None


#: the options type each backend takes (None: the backend takes none)
BackendOptions = Fsdp2Options | MegatronOptions
