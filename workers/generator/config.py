"""``[rollout.vllm]``: the vLLM generator's options as the user writes them.

The controller's ``Config`` composes this Struct (inside its ``[rollout]`` table, whose
other keys drive admission) and hands it, unchanged, to the generator workers; the
vLLM generator takes it as it is, with the run's ``VllmRuntime`` (seed, dtype, prefix
cache) beside it (``workers.generator.vllm_config``). No torch or vLLM import.
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from events.config_checks import non_negative, one_of, positive
from workers.models.config import KvOnRefit

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


class PartialSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[rollout.partial]``: in-flight refits and durable partial rollouts
    (``docs/segments.md``). Off is the behaviour before segments existed."""

    enabled: bool = False
    """A generator call returns at every flush point (a refit landed, or
    ``segment_tokens`` more tokens per sample); the controller records each flush, and a
    crash resumes every group from its last recorded flush instead of from the prompt."""
    segment_tokens: int = 64
    """Tokens per sample between two flushes: the most a crash can lose per sample."""
    flush_on_refit: bool = False
    """false: a refit closes a segment in memory, made durable at the next flush point
    (or in the group's final rows); true: a refit also ends the call with a flush, the
    cadence before (a call, a put and an event per group in flight at every refit, for
    no more durability: a crash loses at most ``segment_tokens`` per sample either way)."""
    kv_on_refit: KvOnRefit = "recompute"
    """A refit landing mid-group: ``recompute`` prefills prompt + tokens so far under the
    new weights (each token's logprob is exactly its version's); ``keep`` goes on with
    the KV cache of the old weights (no prefill). See bench/bench_inflight_kv.py."""

    record_linger_s: float = 0.005
    """How long the controller holds the first returned flush for others to share its
    append (group commit). Every pause of an episode is a flush; a fleet's calls return
    a few hundred microseconds apart, so a few milliseconds record several groups per
    store round trip and fold (bench/bench_episodes.py). Once another flush joined
    within it, the append waits ``record_linger_max`` times this in all (a large
    fleet's pauses then share fewer round trips). Each pause waits up to that long more
    before its group goes on; 0 batches only calls that return together."""
    record_linger_max: int = 4
    """Lingers an append waits in all once another flush joined within the first (1: one
    linger, whatever joins). A throughput-for-CPU trade for a large fleet: at 1024
    generators with 10-turn episodes, 8 records the same pauses in ~1.6 appends per
    group instead of ~2.6, for 10-13 % less controller CPU per group and 0.2-0.3 % fewer
    groups per second (docs/agents.md, "Cost"); a small fleet's lone pauses wait one
    linger either way."""
    record_linger_siblings: int = 8
    """The linger applies only while at least this many other generator calls are in
    flight (as PostgreSQL's ``commit_siblings`` gates its ``commit_delay``). With fewer,
    a pause rarely has company within a linger and its group would idle for nothing: a
    small fleet's pauses come hundreds of ms apart, and a refit's flushes come within a
    token step of each other or not at all. 0: always linger."""

    def __post_init__(self) -> None:
        positive("rollout.partial", self, "segment_tokens", "record_linger_max")
        non_negative("rollout.partial", self, "record_linger_s", "record_linger_siblings")
