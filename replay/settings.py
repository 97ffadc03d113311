"""A recorded run's settings, typed, and the one vocabulary of what-if changes to them.

Both what-ifs speak it: ``rl-controller staleness --what-if`` (the policies re-run over
the recorded log, ``replay.whatif``) and ``rl-controller simulate --what-if`` (the whole
controller re-run in virtual time, ``sim.whatif``). A change is ``key=value``: a short
name from :data:`KEYS` or any dotted config key, applied to the run's recorded config
and validated by the config's own loader, so a bad value is refused with the message
any ``--set`` of it gets, naming the key.

The recorded config is read typed (:func:`recorded_config`): RunStarted's config as the
run resolved it, with the fields RunStarted carries on its own (window, groups per step,
samples per group: what the reducer checked) taking precedence.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from controller.config import Config, ConfigError, config_from_dict, config_to_dict, load_config
from controller.core.state import RunState
from events.config_checks import flatten

#: short names accepted by --what-if, and the config key each sets
KEYS: dict[str, str] = {
    "window": "staleness.window_versions",
    "window_versions": "staleness.window_versions",
    "policy": "staleness.selection",
    "selection": "staleness.selection",
    "buffer": "staleness.buffer_groups",
    # not "basis" (the window's, kept for old command lines): verl's budget is a what-if
    # of its own -- ``budget_basis=per_version,buffer=...`` (docs/scale.md)
    "budget_basis": "staleness.budget_basis",
    "basis": "staleness.window_basis",
    "window_basis": "staleness.window_basis",
    "async_checkpoint": "checkpoint.async_save",
    "microbatch": "train.groups_per_microbatch",
    "groups_per_microbatch": "train.groups_per_microbatch",
    "generators": "rollout.num_generators",
    "groups_per_call": "rollout.groups_per_call",
}


class WhatIfError(ConfigError):
    """A bad ``--what-if``; the message names the key (one line, exit status 2)."""


def parse_changes(items: Iterable[str], *, allowed: Iterable[str] | None = None) -> dict[str, str]:
    """``["window=2,generators=16", ...]`` -> {dotted config key: value}.

    ``allowed``: the dotted keys this what-if can vary (None: any config key).
    """
    allowed = None if allowed is None else set(allowed)
    short = sorted({k for k, v in KEYS.items() if allowed is None or v in allowed})
    out: dict[str, str] = {}
    for text in items:
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = (part.strip() for part in item.partition("="))
            dotted = KEYS.get(key, key if "." in key else None)
            if sep and dotted is not None and allowed is not None and dotted not in allowed:
                raise WhatIfError(
                    f"--what-if {item!r}: {dotted} is not replayed by this what-if (it changes "
                    f"who runs when, not only the policies); `rl-controller simulate --run RUN "
                    f"--what-if {item}` re-runs the log in virtual time with it"
                )
            if not sep or dotted is None:
                raise WhatIfError(
                    f"--what-if {item!r}: expected key=value with key one of {', '.join(short)}"
                    + (" or a dotted config key" if allowed is None else "")
                )
            if out.get(dotted, value) != value:  # last-one-wins would hide a typo
                raise WhatIfError(f"--what-if: {dotted} is given twice ({out[dotted]} and "
                                  f"{value}); give each key once per scenario")
            out[dotted] = value
    return out


def with_changes(cfg: Config, changes: Mapping[str, str] | Iterable[str]) -> Config:
    """``cfg`` with ``changes`` ({key: value} or ``key=value`` items), validated."""
    items = [f"{k}={v}" for k, v in changes.items()] if isinstance(changes, Mapping) else list(changes)
    recorded = [f"{key}={json.dumps(value)}" for key, value in flatten(config_to_dict(cfg))]
    return load_config(None, recorded + items)


def recorded_config(state: RunState) -> Config:
    """The run's config as RunStarted recorded it (see the module docstring)."""
    data: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in state.config.items()}
    # A table that is not one (a tampered log) is left as it is: the loader names it.
    for table, key, value in (("staleness", "window_versions", state.window_versions),
                              ("train", "groups_per_step", state.groups_per_step),
                              ("rollout", "samples_per_group", state.samples_per_group)):
        if isinstance(section := data.setdefault(table, {}), dict):
            section[key] = value
    # a run recorded before async checkpoints saved them in line: keep that
    if isinstance(section := data.setdefault("checkpoint", {}), dict):
        section.setdefault("async_save", False)
    try:
        return config_from_dict(data)
    except ConfigError as err:
        raise ConfigError(f"run {state.run_id!r}: its recorded config does not load: {err}") from None


def apply_changes(state: RunState, changes: Mapping[str, str], item_text: str = "") -> Config:
    """The recorded config with ``changes`` (a bad value: :class:`WhatIfError`)."""
    recorded = recorded_config(state)
    try:
        return with_changes(recorded, changes)
    except ConfigError as err:
        raise what_if_error(changes, err, item_text) from None


def what_if_error(changes: Mapping[str, str], err: ConfigError, item_text: str = "") -> WhatIfError:
    """A config error of what-if ``changes``, naming them: the loader's own source
    ("config (defaults + --set): ...") would point at a flag nobody gave."""
    text = str(err)
    reason = text.split("): ", 1)[1] if text.startswith("config (") else text
    what = item_text or ", ".join(f"{k}={v}" for k, v in changes.items())
    return WhatIfError(f"--what-if {what}: {reason}")
