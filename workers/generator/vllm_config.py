"""What the vLLM engine is built with (``rollout.backend = "vllm"``); no vLLM import.

The user's ``[rollout.vllm]`` table (``workers.generator.config.VllmSection``) is what
the generator takes; the run adds :class:`VllmRuntime`, the values no config key holds.
Kept apart from ``vllm_backend`` so the controller's wiring and the worker spec can
carry them without importing vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from workers.generator.config import MIB, VllmSection


@dataclass(frozen=True)
class VllmRuntime:
    """The engine's values that come from the run, not from ``[rollout.vllm]``."""

    #: engine seed, the run's (per-request seeds make sampling deterministic on their own)
    seed: int = 0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: vLLM's prefix cache; off with partial rollouts (``vllm_decoder``: a cached block
    #: would outlive the weights that computed it)
    prefix_caching: bool = True


def llm_kwargs(options: VllmSection, runtime: VllmRuntime) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` (besides the model path)."""
    return {
        "dtype": runtime.dtype,
        # explicit, so the engine does not reserve a share of the machine
        "kv_cache_memory_bytes": options.kv_cache_mib * MIB,
        "max_num_seqs": options.max_num_seqs,
        "seed": runtime.seed,
        "enforce_eager": True,
        "enable_prefix_caching": runtime.prefix_caching,
        "skip_tokenizer_init": True,
        # the sampled token's logprob under the temperature-scaled distribution,
        # which is what the trainer recomputes (``workers.batch``)
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": "workers.generator.vllm_refit.RefitExtension",
    }
