"""``rl-controller delete`` / ``stop-server`` and usage errors, through the installed command.

Runs are created directly in the embedded redis-server of a temporary ``--data-dir``
(``controller.startup.create_run``: RunStarted + ControllerStarted, no workers), which
is all ``delete`` looks at; this test process is the "controller" that holds them.
"""

from __future__ import annotations

import pytest

from controller.config import config_to_dict, load_config
from controller.startup import create_run
from events import schema as ev
from events.embedded import ensure_embedded_redis, stop_embedded_redis
from events.redis_store import RedisEventStore
from tests.integration.test_run_cli import assert_one_line_error, cli, runs

pytestmark = pytest.mark.integration


@pytest.fixture()
def data_dir(tmp_path):
    try:
        yield tmp_path
    finally:
        stop_embedded_redis(tmp_path)


def _make_run(data_dir, run_id: str, *, finished: bool) -> None:
    store = RedisEventStore(ensure_embedded_redis(data_dir).url)
    try:
        cfg = load_config(None, [])
        writer = create_run(
            store, run_id, config=config_to_dict(cfg), seed=0, code_version="test",
            window_versions=1, groups_per_step=16, samples_per_group=16,
        )
        if finished:
            writer.append(writer.make(ev.RunFinished, event_id="run:finished", reason="test"))
    finally:
        store.close()
    run_dir = data_dir / "runs" / run_id
    (run_dir / "spill").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")


def test_delete_removes_the_log_and_the_run_directory(data_dir):
    _make_run(data_dir, "old", finished=True)
    _make_run(data_dir, "keep", finished=True)
    proc = cli("delete", "--run", "old", "--yes", "--data-dir", str(data_dir))
    assert proc.returncode == 0, proc.stderr
    assert "deleted run old" in proc.stdout
    assert set(runs(data_dir)) == {"keep"}
    assert not (data_dir / "runs" / "old").exists() and (data_dir / "runs" / "keep").exists()


def test_delete_asks_first_and_refuses_without_a_terminal(data_dir):
    _make_run(data_dir, "old", finished=True)
    before = runs(data_dir)
    proc = cli("delete", "--run", "old", "--data-dir", str(data_dir))
    assert_one_line_error(proc, "--yes")
    assert runs(data_dir) == before and (data_dir / "runs" / "old").exists()


def test_delete_refuses_a_run_held_by_a_live_controller(data_dir):
    _make_run(data_dir, "live", finished=False)  # its ControllerStarted names this process
    before = runs(data_dir)
    proc = cli("delete", "--run", "live", "--yes", "--data-dir", str(data_dir))
    assert_one_line_error(proc, "live", "running controller")
    assert runs(data_dir) == before


def test_resume_refuses_a_run_held_by_a_live_controller_unless_told_to_take_over(data_dir):
    _make_run(data_dir, "live", finished=False)  # its ControllerStarted names this process
    before = runs(data_dir)
    proc = cli("run", "--resume", "--run-id", "live", "--no-progress", "--data-dir", str(data_dir))
    assert_one_line_error(proc, "live", "running controller", "--takeover")
    assert runs(data_dir) == before  # no new epoch: this "controller" is not fenced
    taken = cli("run", "--resume", "--run-id", "live", "--takeover", "--steps", "1",
                "--local-workers", "--no-progress", "--data-dir", str(data_dir), timeout_s=600)
    assert taken.returncode == 0, taken.stderr[-3000:]
    after = runs(data_dir)["live"]
    assert after["epoch"] == before["live"]["epoch"] + 1 and after["trainer_version"] == 1


def test_delete_of_an_unknown_run_names_the_known_ones(data_dir):
    _make_run(data_dir, "keep", finished=True)
    proc = cli("delete", "--run", "nope", "--yes", "--data-dir", str(data_dir))
    assert_one_line_error(proc, "nope", "keep")


def test_a_run_directory_without_a_log_is_listed_and_deleted(data_dir):
    _make_run(data_dir, "keep", finished=True)
    orphan = data_dir / "runs" / "failed-start"  # what a failed Ray start once left
    orphan.mkdir(parents=True)
    (orphan / "third_party.log").write_text("ray: cannot join\n")
    listed = cli("runs", "--data-dir", str(data_dir))
    assert listed.returncode == 0 and "without a log in this store: failed-start" in listed.stdout
    assert set(runs(data_dir)) == {"keep"}  # --json keeps its rows: runs with a log
    proc = cli("delete", "--run", "failed-start", "--yes", "--data-dir", str(data_dir))
    assert proc.returncode == 0, proc.stderr
    assert "no log of run failed-start" in proc.stdout
    assert not orphan.exists() and (data_dir / "runs" / "keep").exists()
    assert "without a log" not in cli("runs", "--data-dir", str(data_dir)).stdout


def test_stop_server_stops_the_embedded_server(data_dir):
    _make_run(data_dir, "keep", finished=True)
    proc = cli("stop-server", "--data-dir", str(data_dir))
    assert proc.returncode == 0 and "stopped" in proc.stdout, proc.stderr
    proc = cli("stop-server", "--data-dir", str(data_dir))
    assert proc.returncode == 0 and "no embedded redis-server" in proc.stdout
    assert set(runs(data_dir)) == {"keep"}  # the log survives a restart (AOF)


def test_stop_server_refuses_while_a_live_controller_uses_it(data_dir):
    """Seen beside a real run on the same --data-dir: stop-server stopped its server and
    the run stopped (its appends failed), as delete of that run would not have."""
    _make_run(data_dir, "keep", finished=True)
    _make_run(data_dir, "live", finished=False)  # its ControllerStarted names this process
    proc = cli("stop-server", "--data-dir", str(data_dir))
    assert_one_line_error(proc, "live (pid", "running on this host")
    assert set(runs(data_dir)) == {"keep", "live"}  # still answering: not stopped


@pytest.mark.parametrize("command", ["run", "runs", "audit", "delete"])
def test_a_typo_in_a_flag_shows_that_subcommands_usage(command):
    required = ["--run", "r1"] if command in ("audit", "delete") else []
    proc = cli(command, *required, "--no-such-flag")
    assert proc.returncode == 2
    assert f"usage: rl-controller {command} " in proc.stderr
    assert f"rl-controller {command}: error: unrecognized arguments: --no-such-flag" in proc.stderr
