"""Typed run configuration: one small Struct per component, validated at load.

Each table's Struct lives next to the component it configures (``[model]`` and
``[sampling]`` in ``workers.models.config``, ``[task]`` in ``workers.tasks.config``,
``[train]`` in ``workers.trainer.config``, ``[dataplane]`` in
``workers.dataplane.config``, ``[rollout]`` in ``controller.admission`` with its
``[rollout.vllm]`` in ``workers.generator.config``, ``[staleness]`` in
``controller.core.policies``, ...); ``Config`` only composes them, and the workers are
handed the very Structs they own (``controller.wiring.worker_spec``).

A config comes from defaults, then an optional TOML file, then ``--set key=value``
overrides (dotted keys, TOML literals: ``--set train.lr=3e-4``,
``--set staleness.selection=oldest_first``). Every error names the offending key.
The resolved config is written into ``RunStarted`` so a log describes its own run.
"""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path
from typing import Any

import msgspec

from controller.admission import RolloutSection
from controller.core.policies import StalenessSection
from controller.loop import ControllerSection
from controller.step_close import CheckpointSection
from events.redis_store.replication import StoreConfig
from workers.dataplane.config import DataPlaneSection
from workers.models.config import ModelSection, SamplingSection
from workers.tasks.config import TaskSection
from workers.trainer.config import TrainSection


class ConfigError(ValueError):
    """A bad configuration value; the message names the key."""


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class RunSection(_Section):
    seed: int = 0
    """Seed for prompt order, sampling seeds and model init."""
    steps: int = 150
    """Optimizer steps to train (trainer_version to reach)."""


class RayConfig(_Section):
    address: str = ""
    """Existing Ray cluster to join; empty = start a local one."""
    num_cpus: int = 8
    """Logical CPUs for a local Ray (TransferQueue needs >= 4)."""
    placement_timeout_s: float = 300.0
    """How long a worker may wait to be placed and built before the run stops and
    says what is pending (Ray itself waits forever)."""


class Config(_Section):
    run: RunSection = msgspec.field(default_factory=RunSection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    task: TaskSection = msgspec.field(default_factory=TaskSection)
    sampling: SamplingSection = msgspec.field(default_factory=SamplingSection)
    rollout: RolloutSection = msgspec.field(default_factory=RolloutSection)
    staleness: StalenessSection = msgspec.field(default_factory=StalenessSection)
    train: TrainSection = msgspec.field(default_factory=TrainSection)
    checkpoint: CheckpointSection = msgspec.field(default_factory=CheckpointSection)
    dataplane: DataPlaneSection = msgspec.field(default_factory=DataPlaneSection)
    controller: ControllerSection = msgspec.field(default_factory=ControllerSection)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)
    store: StoreConfig = msgspec.field(default_factory=StoreConfig)

    @property
    def buffer_capacity(self) -> int:
        return self.staleness.capacity(self.train.groups_per_step)


_POSITIVE = {
    "run.steps", "rollout.samples_per_group", "rollout.num_generators",
    "rollout.max_attempts", "rollout.groups_per_call", "train.groups_per_step", "train.groups_per_microbatch",
    "train.data_parallel", "train.tensor_parallel", "checkpoint.every_steps", "sampling.max_new_tokens",
    "model.d_model", "model.n_layers", "model.n_heads", "model.context_len",
    "task.num_prompts", "controller.snapshot_every_events", "ray.num_cpus",
    "ray.placement_timeout_s", "dataplane.storage_units", "dataplane.start_timeout_s",
    "rollout.refit_bucket_mib", "rollout.vllm.kv_cache_mib", "rollout.vllm.max_num_seqs",
    "rollout.partial.segment_tokens",
}
_NON_NEGATIVE = {
    "staleness.window_versions", "staleness.buffer_groups", "train.lr",
    "train.weight_decay", "train.warmup_steps", "train.loss.kl_coef",
    "train.loss.clip_low", "train.loss.clip_high", "controller.step_retries",
    "rollout.vllm.chunk_tokens",
}


def _lookup(cfg: Config, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def validate(cfg: Config) -> Config:
    """Range and cross-field checks that types alone cannot express."""
    for key in _POSITIVE:
        if _lookup(cfg, key) <= 0:
            raise ConfigError(f"config: {key} must be > 0 (got {_lookup(cfg, key)})")
    for key in _NON_NEGATIVE:
        if _lookup(cfg, key) < 0:
            raise ConfigError(f"config: {key} must be >= 0 (got {_lookup(cfg, key)})")
    if not 0 < cfg.sampling.temperature:
        raise ConfigError("config: sampling.temperature must be > 0")
    if not 0 < cfg.sampling.top_p <= 1:
        raise ConfigError("config: sampling.top_p must be in (0, 1]")
    if cfg.train.loss.is_cap < 1:
        raise ConfigError("config: train.loss.is_cap must be >= 1")
    if cfg.train.grad_clip <= 0:
        raise ConfigError("config: train.grad_clip must be > 0")
    if cfg.train.tensor_parallel > 1 and cfg.train.backend != "fsdp2":
        raise ConfigError("config: train.tensor_parallel > 1 needs train.backend = \"fsdp2\"")
    if cfg.model.kind == "hf" and not cfg.model.path:
        raise ConfigError("config: model.path is required when model.kind = \"hf\"")
    try:
        cfg.store.check()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.rollout.backend == "vllm" and cfg.model.kind != "hf":
        raise ConfigError(
            "config: rollout.backend = \"vllm\" needs model.kind = \"hf\" (a local HF model "
            "directory vLLM can load; write a small one with python -m workers.models.hf_tiny DIR)"
        )
    if (cfg.rollout.partial.enabled and cfg.rollout.backend == "vllm"
            and cfg.rollout.vllm.engine_mode != "inprocess"):
        raise ConfigError(
            "config: rollout.partial.enabled with rollout.backend = \"vllm\" needs "
            "rollout.vllm.engine_mode = \"inprocess\" (a separate engine process steps on its "
            "own and cannot pause at a token boundary)"
        )
    need = cfg.train.groups_per_step * (cfg.staleness.window_versions + 1)
    if cfg.staleness.buffer_groups and cfg.staleness.buffer_groups < need:
        # A smaller buffer deadlocks: the admission gate would close before a step fills.
        raise ConfigError(
            f"config: staleness.buffer_groups = {cfg.staleness.buffer_groups} is too small; "
            f"it must be >= train.groups_per_step * (staleness.window_versions + 1) = {need}"
        )
    return cfg


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word: treat as a string (e.g. selection=oldest_first)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value (e.g. train.lr=1e-3)")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(raw.strip())
    return data


def _convert(data: dict[str, Any], source: str) -> Config:
    try:
        return msgspec.convert(data, Config)
    except msgspec.ValidationError as err:
        # msgspec says "... - at `$.train.lr`"; turn the path into the dotted key.
        text = str(err)
        msg, _, where = text.partition(" - at `$.")
        key = where.rstrip("`") if where else ""
        if msg.startswith("Object contains unknown field"):
            field = msg.split("`")[1]
            key = f"{key}.{field}" if key else field
            raise ConfigError(f"config ({source}): unknown key {key!r}") from None
        if msg.startswith("Invalid enum value") and key:
            msg += f" (choose one of: {', '.join(_choices(key))})"
        raise ConfigError(f"config ({source}): {key or 'root'}: {msg}") from None


def _choices(dotted: str) -> tuple[str, ...]:
    owner: Any = Config
    for part in dotted.split("."):
        hint = typing.get_type_hints(owner)[part]
        owner = hint
    return typing.get_args(owner)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- TOML file <- ``--set`` overrides, then validated."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {err}") from None
        source = str(p)
    if overrides:
        data = apply_overrides(data, overrides)
        source = f"{source} + --set"
    return validate(_convert(data, source))


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


def config_from_dict(data: dict[str, Any]) -> Config:
    return validate(_convert(data, "log"))
