"""``examples/run.toml`` loads, and names every key of the config (so it stays complete)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec

from controller.config import Config, config_to_dict, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "run.toml"


def _keys(data: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in data.items():
        out |= _keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
    return out


def test_example_config_loads_and_equals_the_defaults():
    assert load_config(EXAMPLE) == Config()


def test_example_config_names_every_key():
    written = _keys(tomllib.loads(EXAMPLE.read_text()))
    assert written == _keys(config_to_dict(Config()))
    assert isinstance(msgspec.to_builtins(load_config(EXAMPLE)), dict)
