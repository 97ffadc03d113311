"""Config loading: defaults, TOML, --set overrides, and errors that name the key."""

from __future__ import annotations

import pytest

from controller.config import ConfigError, config_from_dict, config_to_dict, load_config


def test_defaults_are_valid_and_round_trip():
    cfg = load_config()
    assert cfg.buffer_capacity == cfg.train.groups_per_step * (cfg.staleness.window_versions + 1)
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nlr = 0.01\n[staleness]\nwindow_versions = 2\n')
    cfg = load_config(path, ["train.lr=1e-4", "staleness.selection=oldest_first"])
    assert cfg.train.lr == 1e-4
    assert cfg.staleness.window_versions == 2
    assert cfg.staleness.selection == "oldest_first"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.lr=abc"], "train.lr: Expected `float`, got `str`"),
        (["train.bogus=1"], "unknown key 'train.bogus'"),
        (["nosuch.key=1"], "unknown key 'nosuch'"),
        (
            ["staleness.selection=newest"],
            "staleness.selection: Invalid enum value 'newest' "
            "(choose one of: in_order, oldest_first, ready_first)",
        ),
        (["train.loss.aggregation=tokens"], "train.loss.aggregation"),
        (["run.steps=0"], "run.steps must be > 0"),
        (["rollout.groups_per_call=0"], "rollout.groups_per_call must be > 0"),
        (["staleness.window_versions=-1"], "staleness.window_versions must be >= 0"),
        (["controller.snapshot_events_per_mib=-1"], "controller.snapshot_events_per_mib must be >= 0"),
        (["staleness.buffer_groups=3"], "staleness.buffer_groups = 3 is too small"),
        (
            ["staleness.budget_basis=per_version", "staleness.buffer_groups=3"],
            'must be >= train.groups_per_step (staleness.budget_basis = "per_version") = 16',
        ),
        (
            ["staleness.budget_basis=per_sample"],
            "staleness.budget_basis: Invalid enum value 'per_sample' (choose one of: live, "
            "per_version)",
        ),
        (["sampling.top_p=1.5"], "sampling.top_p"),
        (["model.kind=hf"], "model.path is required"),
        (["train.tensor_parallel=2"], "train.tensor_parallel > 1 needs train.backend"),
        (["train.tensor_parallel=0"], "train.tensor_parallel must be > 0"),
        (["justakey"], "expected key=value"),
        (["train.lr.x=1"], "train.lr: Expected `float`, got `object`"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(overrides=overrides)
    assert message in str(err.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('[run]\nname = "caf\u00e9"\n'.encode("latin-1"))  # a traceback before
    with pytest.raises(ConfigError, match=r"latin1.toml' is not UTF-8 text \(byte 17\)"):
        load_config(latin1)
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_config(tmp_path)  # a directory: it exists, so "does not exist" was wrong


def _leaves(data, prefix=""):
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("which", ["defaults", "custom"])
def test_a_config_recorded_by_an_older_run_still_loads(which):
    """``--resume`` reloads the config a run recorded in its ``RunStarted``: the dicts
    in the fixture were written by ``config_to_dict`` before the config Structs moved
    next to their components, and must load and record again key for key, in order."""
    import json
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "recorded_config.json"
    recorded = json.loads(fixture.read_text())[which]
    again = dict(_leaves(config_to_dict(config_from_dict(recorded))))
    old = list(_leaves(recorded))
    assert [(key, again[key]) for key, _ in old] == old
    keys = list(again)
    assert [keys.index(key) for key, _ in old] == sorted(keys.index(key) for key, _ in old)


def test_a_per_version_budget_takes_verls_fractional_run_ahead():
    """verl's staleness_threshold 0.1 at 512 groups per sync is a budget of 563 groups per
    version, below the live basis' full capacity (1024 at window 1) but above one step."""
    overrides = ["train.groups_per_step=512", "train.groups_per_microbatch=128",
                 "staleness.window_versions=1", "staleness.buffer_groups=563"]
    with pytest.raises(ConfigError, match=r"must be >= train.groups_per_step \* "):
        load_config(overrides=overrides)
    cfg = load_config(overrides=[*overrides, "staleness.budget_basis=per_version"])
    assert cfg.buffer_capacity == 563 and cfg.staleness.budget_basis == "per_version"
