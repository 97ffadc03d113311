"""Every flag that names a file to write (``--plot``, ``--csv``, ``-o``) and ``run
--data-dir`` refuse a path that cannot be written in one line, exit 2, before any work
and with nothing written; they were raw tracebacks (a plot under a file, an unknown
plot suffix after the whole fold, a CSV into a missing directory, ``-o`` naming a
directory, a data directory under a file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import main
from tests.e2e.test_readonly_cli import cli, write_log
from tests.unit.log_builder import LogBuilder
from tests.unit.random_log import random_run

pytestmark = pytest.mark.integration


@pytest.fixture
def logged(redis_url: str) -> LogBuilder:
    b = random_run(15, 6)
    write_log(redis_url, b)
    return b


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return blocker


def _refused(capsys, url: str, argv: list[str], *says: str) -> None:
    code, out, err = cli(capsys, url, *argv)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("rl-controller: error: "), err
    for text in says:
        assert text in err, err


@pytest.mark.parametrize("command", [["staleness"], ["simulate"]])
def test_a_plot_that_cannot_be_written_is_one_line(
    capsys, redis_url: str, logged: LogBuilder, a_file: Path, tmp_path: Path, command: list[str]
) -> None:
    run = [*command, "--run", logged.run_id, "--plot"]
    _refused(capsys, redis_url, run + [str(a_file / "p.png")], "--plot", "is a file, not a directory")
    _refused(capsys, redis_url, run + [str(tmp_path / "p.txt")], "--plot", ".png", ".svg")
    _refused(capsys, redis_url, run + [str(tmp_path / "p")], "--plot", ".png")
    _refused(capsys, redis_url, run + [str(tmp_path)], "--plot", "is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_csv_or_trace_that_cannot_be_written_is_one_line(
    capsys, redis_url: str, logged: LogBuilder, a_file: Path, tmp_path: Path
) -> None:
    for flag, argv in (("--csv", ["audit", "--run", logged.run_id, "--csv"]),
                       ("-o", ["trace", "--run", logged.run_id, "-o"])):
        _refused(capsys, redis_url, argv + [str(a_file / "x")], flag, "does not exist")
        _refused(capsys, redis_url, argv + [str(tmp_path / "no" / "x")], flag, "does not exist")
        _refused(capsys, redis_url, argv + [str(tmp_path)], flag, "is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_data_dir_under_a_file_is_one_line(capsys, a_file: Path, monkeypatch) -> None:
    monkeypatch.delenv("RLC_REDIS_URL", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["run", "--local-workers", "--no-progress", "--steps", "1",
              "--data-dir", str(a_file / "data")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--data-dir" in err and "is a file, not a directory" in err
    assert a_file.read_text() == "not a directory"


def test_stop_server_of_a_file_says_none_runs_there(capsys, a_file: Path) -> None:
    # it tried to make a lock directory inside the file: a FileExistsError traceback
    assert main(["stop-server", "--data-dir", str(a_file)]) == 0
    assert capsys.readouterr().out.startswith("no embedded redis-server is running for")
    assert a_file.read_text() == "not a directory"


# /proc refuses a new entry even to root, for whom os.access() said "writable": the
# check passed and the plot's mkdir (or the data directory's) was a traceback.
UNWRITABLE = Path("/proc")


@pytest.mark.skipif(not UNWRITABLE.is_dir(), reason="needs Linux /proc")
def test_a_directory_that_refuses_writes_is_one_line(
    capsys, redis_url: str, logged: LogBuilder, monkeypatch
) -> None:
    run = logged.run_id
    for flag, argv in (("--plot", ["staleness", "--run", run, "--plot", "/proc/rlc/p.png"]),
                       ("--plot", ["simulate", "--run", run, "--plot", "/proc/p.png"]),
                       ("--csv", ["audit", "--run", run, "--csv", "/proc/a.csv"]),
                       ("-o", ["trace", "--run", run, "-o", "/proc/t.json"])):
        _refused(capsys, redis_url, argv, flag, "'/proc' is not writable")
    monkeypatch.delenv("RLC_REDIS_URL", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["run", "--local-workers", "--no-progress", "--steps", "1",
              "--data-dir", "/proc/rlc-data"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--data-dir" in err and "'/proc' is not writable" in err
