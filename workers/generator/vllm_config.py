"""Typed options of the vLLM generator (``rollout.backend = "vllm"``); no vLLM import.

Kept apart from ``vllm_backend`` so the controller's wiring and the worker spec can
carry them without importing vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

#: ``inprocess``: the engine core runs in the generator's own process
#: (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): starts in seconds and dies with it, so a
#: killed generator leaves nothing behind. ``multiprocess``: vLLM's default, the engine
#: core in a child process (what a GPU deployment uses to overlap scheduling).
EngineMode = Literal["inprocess", "multiprocess"]

MIB = 1024 * 1024


@dataclass(frozen=True)
class VllmOptions:
    engine_mode: EngineMode = "inprocess"
    #: KV cache size; explicit so the engine does not reserve a share of the machine
    kv_cache_bytes: int = 64 * MIB
    #: sequences the scheduler runs at once (a group of n samples needs n)
    max_num_seqs: int = 64
    #: None: an update landing mid-group waits for the group's end (start == end);
    #: k: the group is generated k tokens at a time and an update lands between chunks
    chunk_tokens: int | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: engine seed (per-request seeds make sampling deterministic on their own)
    seed: int = 0
    #: vLLM's prefix cache; off with partial rollouts (``vllm_decoder``: a cached block
    #: would outlive the weights that computed it)
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.engine_mode not in ("inprocess", "multiprocess"):
            raise ValueError(
                f"vllm engine_mode must be 'inprocess' or 'multiprocess', got {self.engine_mode!r}"
            )
        if self.kv_cache_bytes < MIB:
            raise ValueError(f"vllm kv_cache_bytes must be >= 1 MiB, got {self.kv_cache_bytes}")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError(f"vllm chunk_tokens must be >= 1 or None, got {self.chunk_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"vllm max_num_seqs must be >= 1, got {self.max_num_seqs}")

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` (besides the model path)."""
        return {
            "dtype": self.dtype,
            "kv_cache_memory_bytes": self.kv_cache_bytes,
            "max_num_seqs": self.max_num_seqs,
            "seed": self.seed,
            "enforce_eager": True,
            "enable_prefix_caching": self.prefix_caching,
            "skip_tokenizer_init": True,
            # the sampled token's logprob under the temperature-scaled distribution,
            # which is what the trainer recomputes (``workers.batch``)
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": "workers.generator.vllm_refit.RefitExtension",
        }
