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

    def options(self, seed: int) -> VllmOptions:
        """The engine's options; ``seed`` is the run's (per-request seeds make sampling
        deterministic on their own)."""
        return VllmOptions(
            engine_mode=self.engine_mode,
            kv_cache_bytes=self.kv_cache_mib * MIB,
            max_num_seqs=self.max_num_seqs,
            chunk_tokens=self.chunk_tokens or None,
            seed=seed,
        )
