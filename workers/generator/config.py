"""``[rollout.vllm]``: the vLLM generator's options as the user writes them.

The controller's ``Config`` composes this Struct (inside its ``[rollout]`` table, whose
other keys drive admission) and hands it, unchanged, to the generator workers, which
derive the engine's ``VllmOptions`` from it here. No torch or vLLM import.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from events.config_checks import non_negative, positive
from workers.generator.vllm_config import MIB, VllmOptions
from workers.models.config import KvOnRefit


class VllmSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[rollout.vllm]``: the vLLM generator (``workers.generator.vllm_config.VllmOptions``)."""

    engine_mode: Literal["inprocess", "multiprocess"] = "inprocess"
    """inprocess: the engine core in the generator's process (starts fast, dies with it);
    multiprocess: vLLM's default, the engine core in a child process."""
    kv_cache_mib: int = 64
    """KV cache size, explicit (vLLM would otherwise reserve a share of the machine)."""
    max_num_seqs: int = 64
    """Sequences the engine schedules at once (a group of n samples needs n)."""
    chunk_tokens: int = 0
    """0: an update landing mid-group waits for the group's end; k: generate k tokens at
    a time and apply an update between chunks (the group is tagged start != end)."""

    def __post_init__(self) -> None:
        positive("rollout.vllm", self, "kv_cache_mib", "max_num_seqs")
        non_negative("rollout.vllm", self, "chunk_tokens")

    def options(self, seed: int, prefix_caching: bool = True) -> VllmOptions:
        """The engine's options; ``seed`` is the run's (per-request seeds make sampling
        deterministic on their own)."""
        return VllmOptions(
            prefix_caching=prefix_caching,
            engine_mode=self.engine_mode,
            kv_cache_bytes=self.kv_cache_mib * MIB,
            max_num_seqs=self.max_num_seqs,
            chunk_tokens=self.chunk_tokens or None,
            seed=seed,
        )


class PartialSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[rollout.partial]``: in-flight refits and durable partial rollouts
    (``docs/segments.md``). Off is the behaviour before segments existed."""

    enabled: bool = False
    """A generator call returns at every flush point (a refit landed, or
    ``segment_tokens`` more tokens per sample); the controller records each flush, and a
    crash resumes every group from its last recorded flush instead of from the prompt."""
    segment_tokens: int = 64
    """Tokens per sample between two flushes: the most a crash can lose per sample."""
    kv_on_refit: KvOnRefit = "recompute"
    """A refit landing mid-group: ``recompute`` prefills prompt + tokens so far under the
    new weights (each token's logprob is exactly its version's); ``keep`` goes on with
    the KV cache of the old weights (no prefill). See bench/bench_inflight_kv.py."""

    def __post_init__(self) -> None:
        positive("rollout.partial", self, "segment_tokens")
