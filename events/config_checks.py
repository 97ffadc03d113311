"""The checks every config type runs on itself, in its ``__post_init__``.

A config type validates itself where it is defined (next to its component), whichever
way it was built: from a TOML file, ``--set``, the config recorded in a run's log, or
Python. Each check raises ``ValueError`` whose message starts with the full dotted key
(``train.lr``, ``rollout.vllm.kv_cache_mib``), so the user reads the key they set;
``controller.config`` turns it into a ``ConfigError`` naming the source.

Pure: no I/O, nothing imported beyond the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flatten(tables: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested config tables as ``(dotted key, value)`` pairs, leaves only, in order."""
    out: list[tuple[str, Any]] = []
    for key, value in tables.items():
        if isinstance(value, Mapping):
            out += flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def require(ok: bool, key: str, rule: str, value: Any) -> None:
    """Raise ``ValueError("<key> must be <rule> (got <value>)")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{key} must be {rule} (got {value!r})")


def positive(section: str, obj: Any, *names: str) -> None:
    """Each field ``names`` of ``obj`` (the ``[section]`` table) is > 0."""
    for name in names:
        value = getattr(obj, name)
        require(value > 0, f"{section}.{name}", "> 0", value)


def non_negative(section: str, obj: Any, *names: str) -> None:
    """Each field ``names`` of ``obj`` (the ``[section]`` table) is >= 0."""
    for name in names:
        value = getattr(obj, name)
        require(value >= 0, f"{section}.{name}", ">= 0", value)


def one_of(key: str, value: Any, choices: tuple[Any, ...]) -> None:
    """``value`` (of the dotted ``key``) is one of ``choices`` (a Literal's arguments):
    msgspec checks that when it loads a table, this when Python builds one."""
    require(value in choices, key, f"one of {list(choices)}", value)
