"""``audit --chain-key-file`` errors name that flag: they named the config key
``store.chain_key_file``, which the user of ``audit`` never typed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_readonly_cli import cli, write_log
from tests.unit.log_builder import LogBuilder

pytestmark = pytest.mark.integration


def test_a_bad_key_file_names_the_flag(capsys, redis_url: str, tmp_path: Path) -> None:
    b = LogBuilder("keyed").start()
    write_log(redis_url, b)
    short = tmp_path / "short.key"
    short.write_text("abc")
    for path, says in ((tmp_path / "missing.key", "No such file"), (short, "need at least 16")):
        code, out, err = cli(capsys, redis_url, "audit", "--run", "keyed", "--chain-key-file", str(path))
        assert code == 2 and err.count("\n") == 1, (out, err)
        assert err.startswith(f"rl-controller: error: --chain-key-file {str(path)!r}: "), err
        assert says in err, err
