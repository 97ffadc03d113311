"""``[rollout.vllm]``: the vLLM generator's options as the user writes them.

The controller's ``Config`` composes this Struct (inside its ``[rollout]`` table, whose
other keys drive admission) and hands it, unchanged, to the generator workers; the
vLLM generator takes it as it is, with the run's ``VllmRuntime`` (seed, dtype) beside
it (``workers.generator.vllm_config``). No torch or vLLM import.
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from events.config_checks import non_negative, one_of, positive

MIB = 1024 * 1024

#: ``inprocess``: the engine core runs in the generator's own process
#: (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): starts in seconds and dies with it, so a
#: killed generator leaves nothing behind. ``multiprocess``: vLLM's default, the engine
#: core in a child process (what a GPU deployment uses to overlap scheduling).
EngineMode = Literal["inprocess", "multiprocess"]


class VllmSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[rollout.vllm]``: the vLLM generator (``workers.generator.vllm_backend``)."""

    engine_mode: EngineMode = "inprocess"
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
        one_of("rollout.vllm.engine_mode", self.engine_mode, get_args(EngineMode))
        positive("rollout.vllm", self, "kv_cache_mib", "max_num_seqs")
        non_negative("rollout.vllm", self, "chunk_tokens")
