"""Typed run configuration: the tables of the components, composed and loaded.

Each table's type lives next to the component it configures, in a module that runs
nothing on import, and checks its own fields (``__post_init__``, errors naming the
dotted key):

    [run] [rollout] [checkpoint] [controller] [ray]   controller.settings
    [staleness]                                         controller.core.policies
    [failures]                                          controller.core.failures
    [model] [sampling]                                  workers.models.config
    [task]                                              workers.tasks.config
    [train] (with [train.loss])                         workers.trainer.config
    [dataplane]                                         workers.dataplane.config
    [rollout.vllm]                                      workers.generator.config
    [store]                                             events.store_config

``Config`` only composes them and checks what spans tables; the workers are handed
the very types they own (``controller.wiring.worker_spec``). Loading a config imports
none of the loop, asyncio, structlog, redis, Ray or torch
(``tests/unit/test_architecture.py``).

A config comes from defaults, then the settings its task is tuned for (a built-in
task's ``run_defaults``, e.g. the calculator's alphabet), then an optional TOML file,
then ``--set key=value`` overrides (dotted keys, TOML literals: ``--set train.lr=3e-4``,
``--set staleness.selection=oldest_first``). Every error names the offending key.
The resolved config is written into ``RunStarted`` so a log describes its own run.
"""

from __future__ import annotations

import enum
import tomllib
import typing
from pathlib import Path
from typing import Any

import msgspec

from controller.core.failures import FailuresSection
from controller.core.policies import StalenessSection, min_capacity
from controller.prometheus import MetricsSection
from controller.settings import (
    CheckpointSection, ControllerSection, RayConfig, RolloutSection, RunSection,
)
from events.store_config import StoreConfig
from workers.dataplane.config import DataPlaneSection
from workers.models.config import ModelSection, SamplingSection
from workers.tasks.config import TaskSection, with_task_defaults
from workers.trainer.config import TrainSection

__all__ = [
    "Config", "ConfigError", "RayConfig", "RolloutSection", "RunSection", "config_from_dict",
    "config_to_dict", "load_config",
]


class ConfigError(ValueError):
    """A bad configuration value; the message names the key."""


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    run: RunSection = msgspec.field(default_factory=RunSection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    task: TaskSection = msgspec.field(default_factory=TaskSection)
    sampling: SamplingSection = msgspec.field(default_factory=SamplingSection)
    rollout: RolloutSection = msgspec.field(default_factory=RolloutSection)
    staleness: StalenessSection = msgspec.field(default_factory=StalenessSection)
    failures: FailuresSection = msgspec.field(default_factory=FailuresSection)
    train: TrainSection = msgspec.field(default_factory=TrainSection)
    checkpoint: CheckpointSection = msgspec.field(default_factory=CheckpointSection)
    dataplane: DataPlaneSection = msgspec.field(default_factory=DataPlaneSection)
    controller: ControllerSection = msgspec.field(default_factory=ControllerSection)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)
    store: StoreConfig = msgspec.field(default_factory=StoreConfig)
    metrics: MetricsSection = msgspec.field(default_factory=MetricsSection)

    def __post_init__(self) -> None:
        """The rules that span tables (each table checked its own fields already)."""
        if self.rollout.backend == "vllm" and self.model.kind != "hf":
            raise ValueError(
                'rollout.backend = "vllm" needs model.kind = "hf" (a local HF model '
                "directory vLLM can load; write a small one with python -m workers.models.hf_tiny DIR)"
            )
        if (self.rollout.partial.enabled and self.rollout.backend == "vllm"
                and self.rollout.vllm.engine_mode != "inprocess"):
            raise ValueError(
                'rollout.partial.enabled with rollout.backend = "vllm" needs '
                'rollout.vllm.engine_mode = "inprocess" (a separate engine process steps on '
                "its own and cannot pause at a token boundary)"
            )
        st = self.staleness
        need = min_capacity(self.train.groups_per_step, st.window_versions, st.budget_basis)
        # A smaller buffer deadlocks: the admission gate would close before a step fills.
        if st.buffer_groups and st.buffer_groups < need:
            rule = ("train.groups_per_step (staleness.budget_basis = \"per_version\")"
                    if st.budget_basis == "per_version"
                    else "train.groups_per_step * (staleness.window_versions + 1)")
            raise ValueError(
                f"staleness.buffer_groups = {st.buffer_groups} is too small; it "
                f"must be >= {rule} = {need}"
            )

    @property
    def buffer_capacity(self) -> int:
        return self.staleness.capacity(self.train.groups_per_step)


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
        if _names_a_key(msg):  # a table's own check (``__post_init__``) named the key
            raise ConfigError(f"config ({source}): {msg}") from None
        if msg.startswith("Object contains unknown field"):
            field = msg.split("`")[1]
            key = f"{key}.{field}" if key else field
            raise ConfigError(f"config ({source}): unknown key {key!r}") from None
        if msg.startswith("Invalid enum value") and key:
            msg += f" (choose one of: {', '.join(_choices(key))})"
        raise ConfigError(f"config ({source}): {key or 'root'}: {msg}") from None


def _names_a_key(msg: str) -> bool:
    first = msg.split(" ", 1)[0]
    return "." in first and first.split(".", 1)[0] in Config.__struct_fields__


def _choices(dotted: str) -> tuple[str, ...]:
    owner: Any = Config
    for part in dotted.split("."):
        hint = typing.get_type_hints(owner)[part]
        owner = hint
    if isinstance(owner, type) and issubclass(owner, enum.Enum):
        return tuple(str(e.value) for e in owner)
    return typing.get_args(owner)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- TOML file <- ``--set`` overrides, then validated."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} "
                              + ("is not a regular file" if p.exists() else "does not exist"))
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {err}") from None
        except UnicodeDecodeError as err:  # TOML is UTF-8 by definition
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {err.start}): "
                              "save it as UTF-8") from None
        source = str(p)
    if overrides:
        data = apply_overrides(data, overrides)
        source = f"{source} + --set"
    # under both: the settings the named task is tuned for (e.g. the calculator's
    # small alphabet); anything the file or --set says wins
    return _convert(with_task_defaults(data), source)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


def config_from_dict(data: dict[str, Any]) -> Config:
    return _convert(data, "log")
