"""``rl-controller trace`` through the real CLI entry, against a real redis-server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_readonly_cli import cli, write_log
from tests.trace_check import check_trace
from tests.unit.random_log import random_run

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _no_env_url(monkeypatch):
    monkeypatch.delenv("RLC_REDIS_URL", raising=False)


def test_trace_writes_a_well_formed_file(capsys, redis_url: str, tmp_path: Path) -> None:
    b = random_run(12, 20, p_abort=0.05, p_restart=0.05)
    write_log(redis_url, b)
    out = tmp_path / "run.json"
    code, stdout, err = cli(capsys, redis_url, "trace", "--run", b.run_id, "-o", str(out))
    assert code == 0, err
    assert f"from {b.last_position} events (positions 1..{b.last_position})" in stdout
    found = check_trace(json.loads(out.read_text()))
    assert len([n for *_, n in found.slices[(1, 1)] if n.startswith("step ")]) == len(b.fold().steps)
    code, stdout, err = cli(capsys, redis_url, "trace", "--run", b.run_id, "--steps", "5:6",
                            "-o", str(tmp_path / "w.json"))
    assert code == 0, err
    steps = {n for *_, n in check_trace(json.loads((tmp_path / "w.json").read_text()))
             .slices[(1, 1)] if n.startswith("step ")}
    assert steps == {"step 5", "step 6"}


def test_trace_mistakes_are_one_line(capsys, redis_url: str, tmp_path: Path) -> None:
    b = random_run(13, 5)
    write_log(redis_url, b, garbage_at={6: b"\x00garbage"})
    out = tmp_path / "bad.json"
    code, _, err = cli(capsys, redis_url, "trace", "--run", b.run_id, "--steps", "9:3", "-o", str(out))
    assert code == 2 and err.strip() == "rl-controller: error: --steps '9:3': expected 0 <= A <= B"
    code, _, err = cli(capsys, redis_url, "trace", "--run", b.run_id, "-o", str(tmp_path / "no" / "x.json"))
    assert code == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli(capsys, redis_url, "trace", "--run", b.run_id, "-o", str(out))
    assert code == 1 and "position 6" in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no partial file left behind


def test_a_window_past_the_runs_steps_is_refused_and_writes_nothing(
    capsys, redis_url: str, tmp_path: Path
) -> None:
    b = random_run(14, 6)
    write_log(redis_url, b)
    newest = max(b.fold().steps)
    out = tmp_path / "late.json"
    code, stdout, err = cli(capsys, redis_url, "trace", "--run", b.run_id,
                            "--steps", f"{newest + 1}:", "-o", str(out))
    assert code == 2 and stdout == "", stdout
    assert err.strip() == (f"rl-controller: error: --steps '{newest + 1}:': run {b.run_id} has "
                           f"no step in that range (its newest step is {newest}); nothing written")
    assert list(tmp_path.iterdir()) == []  # neither the file nor a temporary one
    code, _, err = cli(capsys, redis_url, "trace", "--run", b.run_id,
                       "--steps", str(newest), "-o", str(out))
    assert code == 0 and out.exists(), err  # its last step still is one
