"""Tensor parallelism for Hugging Face Llama/Qwen2-style decoder blocks (DTensor plan).

Per block (Megatron's split, as DTensor styles)::

    self_attn.q_proj / k_proj / v_proj   ColwiseParallel   heads split over tp ranks
    self_attn.o_proj                     RowwiseParallel   partial sums all-reduced
    mlp.gate_proj / up_proj              ColwiseParallel   intermediate split
    mlp.down_proj                        RowwiseParallel   partial sums all-reduced

Inputs and outputs of every block stay replicated (plain tensors), so embeddings,
norms and the LM head are untouched and FSDP shards them over "dp" alone. HF's
attention reshapes with ``-1`` heads, so each rank runs its local heads unchanged.
Only modules with exactly these names are parallelised; a model without them (the
built-in tiny model fuses q, k and v into one projection) is refused by name rather
than silently run replicated.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def apply_tensor_parallel(blocks: list[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Parallelise each of the model's transformer ``blocks`` in place over ``tp_mesh``."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {name: ColwiseParallel() for name in _COLWISE}
    plan.update({name: RowwiseParallel() for name in _ROWWISE})
    tp = tp_mesh.size()
    for i, block in enumerate(blocks):
        names = {n for n, _ in block.named_modules()}
        missing = sorted(set(plan) - names)
        if missing:
            raise ValueError(
                f"train.tensor_parallel = {tp}: block {i} ({type(block).__name__}) has no "
                f"{missing}; tensor parallelism supports HF Llama/Qwen2-style blocks only"
            )
        cfg = block.get_submodule("self_attn").config
        for attr in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(cfg, attr, None)
            if heads is not None and heads % tp:
                raise ValueError(f"{attr} = {heads} is not divisible by tensor_parallel = {tp}")
        parallelize_module(block, tp_mesh, plan)
