"""``run --run-id`` values that cannot name a run: one line, exit 2, before the embedded
server is started or anything is written. An empty one (``--run-id "$RUN"`` with RUN
unset) was silently replaced by a new time-stamped run."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import main


@pytest.mark.parametrize(("run_id", "says"), [
    ("", "invalid run id ''"),
    ("a b", "no whitespace"),
    ("../x", "names a directory under runs/"),
    ("a/b", "names a directory under runs/"),
    ("..", "names a directory under runs/"),
    ("-x", "names a directory under runs/"),
])
def test_a_run_id_that_cannot_name_a_run_is_one_line(
    capsys, tmp_path: Path, monkeypatch, run_id: str, says: str
) -> None:
    monkeypatch.delenv("RLC_REDIS_URL", raising=False)
    data_dir = tmp_path / "data"
    with pytest.raises(SystemExit) as exc:
        main(["run", "--local-workers", "--no-progress", "--steps", "1",
              "--data-dir", str(data_dir), f"--run-id={run_id}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("rl-controller: error: --run-id") and says in err, err
    assert not data_dir.exists()
