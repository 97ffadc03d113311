"""The read-only commands through the real CLI entry, against a real redis-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from events.codec import encode
from events.redis_store import RedisEventStore
from tests.foreground import popen_foreground
from tests.unit.log_builder import LogBuilder
from tests.unit.random_log import random_run

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def write_log(url: str, b: LogBuilder, garbage_at: dict[int, bytes] | None = None) -> None:
    """Append the builder's events raw (hand-built logs may be invalid on purpose)."""
    store = RedisEventStore(url)
    try:
        store.claim_epoch(b.run_id)
        for stored in b.events:
            data = (garbage_at or {}).get(stored.position) or encode(stored.event)
            store.append_raw(b.run_id, data, event_type=type(stored.event).__name__,
                             event_id=stored.event.event_id)
    finally:
        store.close()


@pytest.fixture(autouse=True)
def _no_env_url(monkeypatch):
    monkeypatch.delenv("RLC_REDIS_URL", raising=False)


def cli(capsys, url: str, *argv: str) -> tuple[int, str, str]:
    args = [argv[0], "--redis-url", url, *argv[1:]]
    try:
        code = main(args)
    except SystemExit as exc:  # run_command's one-line errors exit this way
        code = exc.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


@pytest.fixture
def run(redis_url: str) -> LogBuilder:
    b = random_run(11, 20, p_abort=0.05, p_restart=0.05)
    write_log(redis_url, b)
    return b


def test_runs_lists_the_run(capsys, redis_url, run):
    code, out, _ = cli(capsys, redis_url, "runs", "--json")
    assert code == 0
    [row] = json.loads(out)
    assert row["run_id"] == run.run_id and row["events"] == run.last_position
    assert row["finished"] is True and row["trainer_version"] == 20
    code, out, _ = cli(capsys, redis_url, "runs")
    assert code == 0 and run.run_id in out


def test_tail_prints_one_line_per_event(capsys, redis_url, run):
    code, out, _ = cli(capsys, redis_url, "tail", "--run", run.run_id, "--from", "3")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == run.last_position - 2
    assert lines[-1].split()[0] == str(run.last_position) and "RunFinished" in lines[-1]
    code, out, _ = cli(capsys, redis_url, "tail", "--run", run.run_id, "--json")
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["position"] for e in events] == list(range(1, run.last_position + 1))
    assert events[0]["type"] == "RunStarted"


def test_replay_at_and_step(capsys, redis_url, run):
    state = run.fold()
    step = state.steps[5]
    code, out, _ = cli(capsys, redis_url, "replay", "--run", run.run_id, "--step", "5", "--json")
    assert code == 0
    point = json.loads(out)
    assert point["position"] == step.ended_position
    # steps count from 0 and versions from 1: the output says which is which
    at_step = point.pop("at_step")
    assert (at_step["step"], at_step["trainer_version"]) == (5, step.trainer_version)
    assert f"after step 5" in at_step["text"] and f"-> {step.trainer_version}" in at_step["text"]
    code, out, _ = cli(capsys, redis_url, "replay", "--run", run.run_id, "--step", "5")
    assert code == 0 and "after step 5, which finished" in out
    code, out, _ = cli(capsys, redis_url, "replay", "--run", run.run_id, "--at", str(step.ended_position), "--json")
    assert json.loads(out) == point
    code, out, _ = cli(capsys, redis_url, "replay", "--run", run.run_id, "--until", "40")
    assert code == 0 and "at position 40" in out and "buffer" in out
    code, _, err = cli(capsys, redis_url, "replay", "--run", run.run_id, "--at", "999999")
    assert code == 2 and "past the end" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli(capsys, redis_url, "replay", "--run", run.run_id, "--until", "999999")
    assert code == 2 and err.startswith("rl-controller: error: --until 999999 is past the end"), err
    for command in ("staleness", "audit"):  # a negative N cut the oldest rows off
        code, _, err = cli(capsys, redis_url, command, "--run", run.run_id, "--last", "-1")
        assert code == 2 and err.strip() == "rl-controller: error: --last must be >= 0 (0 = all), got -1"


def test_replay_point_has_ages_and_lags(capsys, redis_url):
    b = LogBuilder(run_id="pt", window=1, groups_per_step=2, dt=1.0, t0=100.0).start()
    b.group("g1").admit("g2")
    write_log(redis_url, b)
    code, out, _ = cli(capsys, redis_url, "replay", "--run", "pt", "--json")
    point = json.loads(out)
    assert point["buffer"][0]["group_id"] == "g1" and point["buffer"][0]["age_s"] == 1.0
    assert point["buffer"][0]["lag"] == 0
    assert point["in_flight"][0]["group_id"] == "g2" and point["in_flight"][0]["age_s"] == 0.0


def test_audit_clean_and_csv(capsys, redis_url, run, tmp_path):
    code, out, err = cli(capsys, redis_url, "audit", "--run", run.run_id)
    assert code == 0 and "all hold" in out and err == ""
    csv_file = tmp_path / "history.csv"
    code, _, _ = cli(capsys, redis_url, "audit", "--run", run.run_id, "--csv", str(csv_file))
    assert code == 0 and len(csv_file.read_text().splitlines()) == 21
    code, out, _ = cli(capsys, redis_url, "audit", "--run", run.run_id, "--json")
    assert json.loads(out)["problem"] is None


def test_tables_keep_values_by_their_names_and_paths_whole(capsys, redis_url):
    b = random_run(4, 6)
    long_dir = "/srv/" + "a-rather-long-directory-name/" * 4 + "runs/tables/checkpoints"
    b.checkpoint(uri=f"{long_dir}/v{b.trainer_version:06d}-e1")
    b.run_id = "tables"
    write_log(redis_url, b)
    code, out, _ = cli(capsys, redis_url, "audit", "--run", "tables")
    assert code == 0 and f"checkpoints in {long_dir}/" in out and "…" not in out
    assert f"v{b.trainer_version:06d}-e1" in out
    code, out, _ = cli(capsys, redis_url, "staleness", "--run", "tables")
    value = next(line for line in out.splitlines() if "│ lag_mean " in line).split("│")[2]
    # the value right after its name's column, not pushed to the far right
    assert value.startswith(" 0.") and len(value) < 20, value


def test_audit_violation_exits_1_naming_the_position(capsys, redis_url):
    b = LogBuilder(run_id="bad", window=1, groups_per_step=2).start().group("g1").group("g2")
    b.train_step(["g1", "g2"]).begin_step().microbatch(["g1"])  # g1 consumed twice
    bad = b.last_position
    write_log(redis_url, b)
    code, out, err = cli(capsys, redis_url, "audit", "--run", "bad")
    assert code == 1
    assert f"position {bad}" in err and "Traceback" not in err
    code, out, _ = cli(capsys, redis_url, "audit", "--run", "bad", "--json")
    assert code == 1 and json.loads(out)["problem"]["position"] == bad


@pytest.mark.parametrize("url", ["http://localhost:6379", "localhost:6379",
                                 "redis://127.0.0.1:notaport/0"])
@pytest.mark.parametrize("command", [["runs"], ["audit", "--run", "r"], ["tail", "--run", "r"]])
def test_a_malformed_redis_url_is_one_line_and_exit_2(capsys, url, command):
    code, out, err = cli(capsys, url, *command)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("rl-controller: error: --redis-url: "), err
    assert "Traceback" not in err


def test_malformed_entry_named_without_traceback(capsys, redis_url):
    b = LogBuilder(run_id="junk").start().group("g1").group("g2")
    write_log(redis_url, b, garbage_at={4: b"\x00garbage"})
    for command in ("audit", "replay", "staleness"):
        code, _, err = cli(capsys, redis_url, command, "--run", "junk")
        assert code == 1, command
        assert "position 4" in err and "Traceback" not in err
    code, out, err = cli(capsys, redis_url, "tail", "--run", "junk")
    assert code == 1 and "position 4" in err and len(out.splitlines()) == b.last_position - 1


def test_staleness_json_plot_and_what_if(capsys, redis_url, run, tmp_path):
    png = tmp_path / "s.png"
    code, out, _ = cli(capsys, redis_url, "staleness", "--run", run.run_id, "--json", "--plot", str(png),
                       "--what-if", "policy=ready_first")
    assert code == 0 and png.stat().st_size > 10_000
    data = json.loads(out)
    assert data["summary"]["steps_finished"] == 20
    assert len(data["steps"]) == 20
    # random_run trains whatever committed first: ready_first reproduces it exactly
    assert data["what_if"]["steps"]["identical"] == 20
    assert data["what_if"]["assumptions"]
    code, out, _ = cli(capsys, redis_url, "staleness", "--run", run.run_id, "--what-if", "window=0")
    assert code == 0 and "what-if assumptions" in out
    code, _, err = cli(capsys, redis_url, "staleness", "--run", run.run_id, "--what-if", "speed=2")
    assert code == 2 and "speed=2" in err


def test_wrong_run_id_lists_the_runs(capsys, redis_url, run):
    for command in ("tail", "replay", "staleness", "audit"):
        code, out, err = cli(capsys, redis_url, command, "--run", "nope")
        assert code == 2, command
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "nope" in lines[0] and run.run_id in lines[0]


def test_unreachable_redis_is_one_clear_line(capsys):
    from events.embedded import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    code, _, err = cli(capsys, url, "runs")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "unavailable" in lines[0]


def test_no_embedded_log_in_data_dir(capsys, tmp_path):
    try:
        code = main(["audit", "--data-dir", str(tmp_path), "--run", "r"])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and "no runs in" in err


def test_embedded_default_is_found_without_flags(capsys, tmp_path, monkeypatch):
    from events.embedded import ensure_embedded_redis, stop_embedded_redis

    data_dir = tmp_path / "rlc-data"
    server = ensure_embedded_redis(data_dir)
    try:
        write_log(server.url, random_run(2, 3))
        monkeypatch.chdir(tmp_path)
        assert main(["audit", "--run", "sim-2"]) == 0
        assert "sim-2" in capsys.readouterr().out
    finally:
        stop_embedded_redis(data_dir)


def test_help_has_examples(capsys):
    for command in ("runs", "tail", "replay", "staleness", "audit"):
        with pytest.raises(SystemExit) as exc:
            main([command, "--help"])
        assert exc.value.code == 0
        assert "examples:" in capsys.readouterr().out


def test_subprocess_entry_point(redis_url, run):
    env = {**os.environ, "RLC_REDIS_URL": redis_url}
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "audit", "--run", run.run_id, "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["summary"]["trainer_version"] == 20
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "replay", "--run", "missing"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and run.run_id in proc.stderr


def _following(redis_url: str, run_id: str) -> tuple[LogBuilder, subprocess.Popen]:
    """A started run's log, and ``tail --follow`` of it once it printed both events."""
    b = LogBuilder(run_id=run_id).start()
    write_log(redis_url, b)
    env = {**os.environ, "RLC_REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
    proc = popen_foreground(
        [sys.executable, "-m", "cli.main", "tail", "--run", run_id, "--follow"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert "RunStarted" in proc.stdout.readline()
    assert "ControllerStarted" in proc.stdout.readline()
    return b, proc


def test_tail_follow_prints_new_events_and_exits_cleanly(redis_url):
    b, proc = _following(redis_url, "live")
    try:
        store = RedisEventStore(redis_url)
        b.admit("g1")
        store.append_raw("live", encode(b.events[-1].event), event_type="RolloutAdmitted")
        store.close()
        line = proc.stdout.readline()
        assert line.split()[0] == "3" and "RolloutAdmitted" in line
        import signal

        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
        assert proc.returncode in (0, 130)
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_tail_follow_ends_with_the_run(capsys, redis_url):
    b, proc = _following(redis_url, "ending")
    try:
        b.finish_run()
        store = RedisEventStore(redis_url)
        store.append_raw("ending", encode(b.events[-1].event), event_type="RunFinished")
        store.close()
        out, err = proc.communicate(timeout=60)  # no signal: it ends by itself
        # nothing on stderr: it said "Task was destroyed but it is pending!" and the
        # abandoned read's repr (its stream reader was never closed)
        assert proc.returncode == 0 and "RunFinished" in out and err == "", err
    finally:
        if proc.poll() is None:
            proc.kill()
    # a log that already ends with RunFinished: printed, then done (no wait at all)
    code, out, _ = cli(capsys, redis_url, "tail", "--run", "ending", "--follow")
    assert code == 0 and out.strip().splitlines()[-1].split()[0] == "3"


def _append_by_hand(redis_url: str, b: LogBuilder, *entries: tuple[str, bytes]) -> None:
    """XADD ``(stream id, data)`` entries in one transaction (the follow reads them in one
    batch); data None: the builder's last event, as the store writes it."""
    import redis

    from events.redis_store import events_key

    client = redis.Redis.from_url(redis_url)
    try:
        pipe = client.pipeline()
        for entry_id, data in entries:
            event = b.events[-1].event
            pipe.xadd(events_key(b.run_id), {"type": type(event).__name__, "id": event.event_id,
                                             "data": encode(event) if data is None else data},
                      id=entry_id)
        pipe.execute()
    finally:
        client.close()


@pytest.mark.parametrize(("entries", "printed", "says"), [
    # a malformed entry at the next position: named, and the follow goes on to the next
    # (the run's end: the follow ends there)
    ([("0-3", b"{"), ("0-4", None)], ["4"],
     "at position 3: not a JSON object: Input data was truncated"),
    # an entry XADDed by hand with an id after every 0-N one: the follow's XREAD from any
    # position returns it again, and the store can append nothing after it (XADD ids
    # only grow). It was named at position 3, 4, 5, ... hundreds of times a second.
    ([("5-124", b"{}")], [],
     "at position 3: stream entry id '5-124' is not a log position (0-N); nothing can be "
     "appended after it: following stopped"),
    ([("0-3", None), ("5-124", b"{}")], ["3"],
     "at position 4: stream entry id '5-124' is not a log position (0-N); nothing can be "
     "appended after it: following stopped"),
], ids=["bad-data", "bad-id", "event-then-bad-id"])
def test_tail_follow_names_a_malformed_entry_once_where_it_is(redis_url, entries, printed, says):
    b, proc = _following(redis_url, f"malformed-{len(entries)}-{entries[-1][0]}")
    try:
        # the event appended whole (data None): the run's end when it is the last entry
        b.finish_run() if entries[-1][1] is None else b.admit("g1")
        _append_by_hand(redis_url, b, *entries)
        out, err = proc.communicate(timeout=60)  # it stops by itself, with one line
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [line.split()[0] for line in out.splitlines()] == printed, (out, err)
    assert proc.returncode == 1 and err == f"rl-controller: malformed entry {says}\n", err


@pytest.mark.parametrize("command", [["audit", "--json"], ["staleness", "--json"],
                                     ["replay", "--json"]])
def test_long_folds_report_progress_on_stderr_only(capsys, redis_url, run, monkeypatch, command):
    """Progress lines (here every 100 events, on 50-entry pages) go to stderr, one per
    multiple passed, and leave stdout's JSON whole."""
    from controller import projector

    monkeypatch.setattr(projector, "PROGRESS_EVERY", 100)
    monkeypatch.setattr(projector, "PAGE_ENTRIES", 50)
    code, out, err = cli(capsys, redis_url, command[0], "--run", run.run_id, *command[1:],
                         *(["--no-snapshot"] if command[0] == "replay" else []))
    assert code == 0, err
    json.loads(out)
    end = len(run.events)
    lines = [line for line in err.splitlines() if line.startswith(f"{command[0]}: ")]
    assert [int(line.split()[1].replace(",", "")) for line in lines] == [
        100 * k for k in range(1, end // 100 + 1)
    ]
    assert end // 100 >= 3 and all(f"of {end:,} events" in line for line in lines)
