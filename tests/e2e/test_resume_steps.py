"""``run --resume --steps N`` with N below where the run is: one line, exit 2, the log
untouched. An unfinished run resumed so was marked finished (its loop saw the target
reached) with exit status 0 -- a typo in --steps ended a run meant to go on."""

from __future__ import annotations

import msgspec
import pytest

from events.redis_store import RedisEventStore
from tests.e2e.test_readonly_cli import cli, write_log
from tests.unit.log_builder import LogBuilder
from tests.unit.random_log import random_run

pytestmark = pytest.mark.integration


def _written(url: str, *, finished: bool) -> LogBuilder:
    b = random_run(7, 6)
    assert type(b.events[-1].event).__name__ == "RunFinished"
    if not finished:
        b.events = b.events[:-1]
    write_log(url, b)
    return b


def _last_position(url: str, run_id: str) -> int:
    store = RedisEventStore(url)
    try:
        return store.last_position(run_id)
    finally:
        store.close()


@pytest.mark.parametrize("finished", [False, True])
def test_steps_below_the_version_is_refused(capsys, redis_url: str, finished: bool) -> None:
    b = _written(redis_url, finished=finished)
    before = _last_position(redis_url, b.run_id)
    code, out, err = cli(capsys, redis_url, "run", "--resume", "--run-id", b.run_id,
                         "--steps", "2", "--local-workers", "--no-progress")
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("rl-controller: error: --steps 2 is below"), err
    assert f"run {b.run_id} is" in err and "trainer_version 6" in err, err
    assert ("N > 6 to train further" if finished else "N >= 6") in err, err
    assert _last_position(redis_url, b.run_id) == before  # no epoch claimed, nothing appended


def test_steps_at_the_version_of_a_finished_run_is_nothing_to_do(capsys, redis_url: str) -> None:
    b = _written(redis_url, finished=True)
    code, out, err = cli(capsys, redis_url, "run", "--resume", "--run-id", b.run_id,
                         "--steps", "6", "--local-workers", "--no-progress")
    assert code == 0 and "nothing to do" in out, (out, err)


def _resumed_past_its_target(url: str, *, finished: bool) -> LogBuilder:
    """A run started with run.steps 3 that a resume's ``--steps 6`` took to trainer_version
    6: the log holds the target 3 (a resume's --steps is not recorded)."""
    b = random_run(7, 6)
    started = b.events[0]
    config = {**started.event.config, "run": {**started.event.config["run"], "steps": 3}}
    b.events[0] = msgspec.structs.replace(
        started, event=msgspec.structs.replace(started.event, config=config))
    if not finished:
        b.events = b.events[:-1]
    write_log(url, b)
    return b


def test_resume_without_steps_past_the_logged_target_names_the_cause(capsys, redis_url: str) -> None:
    """Killed (or interrupted) after a resume with a higher --steps, the run was resumed
    with no --steps as recovery.md says, and was refused for "--steps 3", a flag never
    given, with "leave --steps out to go on to its 3" -- what had just been done."""
    b = _resumed_past_its_target(redis_url, finished=False)
    before = _last_position(redis_url, b.run_id)
    code, out, err = cli(capsys, redis_url, "run", "--resume", "--run-id", b.run_id,
                         "--local-workers", "--no-progress")
    assert code == 2, (out, err)
    assert err == (f"rl-controller: error: run {b.run_id} is at trainer_version 6, past its "
                   "logged run.steps 3 (an earlier resume's --steps is not in the log); pass "
                   "--steps N >= 6\n"), err
    assert _last_position(redis_url, b.run_id) == before


def test_resume_without_steps_of_a_finished_run_past_its_target_is_nothing_to_do(
        capsys, redis_url: str) -> None:
    b = _resumed_past_its_target(redis_url, finished=True)
    code, out, err = cli(capsys, redis_url, "run", "--resume", "--run-id", b.run_id,
                         "--local-workers", "--no-progress")
    assert code == 0 and "finished at trainer_version 6: nothing to do" in out, (out, err)


def test_steps_below_a_passed_target_offers_no_way_back_to_it(capsys, redis_url: str) -> None:
    b = _resumed_past_its_target(redis_url, finished=False)
    code, out, err = cli(capsys, redis_url, "run", "--resume", "--run-id", b.run_id,
                         "--steps", "4", "--local-workers", "--no-progress")
    assert code == 2 and "pass --steps N >= 6" in err, (out, err)
    assert "leave --steps out" not in err, err


def test_resume_with_a_data_dir_where_the_run_never_ran_is_refused(capsys, redis_url: str,
                                                                   tmp_path) -> None:
    """With --redis-url the log is found whatever --data-dir says; a resume given the
    wrong one found no spill there and evicted every buffered group as "payload lost",
    on the log for good (seen pasting a resume command that had dropped --data-dir)."""
    b = random_run(7, 6)
    b.events = b.events[:-1]  # unfinished
    write_log(redis_url, b)
    before = _last_position(redis_url, b.run_id)
    elsewhere = tmp_path / "other-data"
    code, out, err = cli(capsys, redis_url, "run", "--resume", "--run-id", b.run_id,
                         "--data-dir", str(elsewhere), "--local-workers", "--no-progress")
    assert code == 2, (out, err)
    assert err == (f"rl-controller: error: run {b.run_id} has no run directory "
                   f"{str(elsewhere / 'runs' / b.run_id)!r} (its payload spill and checkpoints): "
                   "pass the --data-dir it was started with, or create the directory to resume "
                   "without them\n"), err
    assert _last_position(redis_url, b.run_id) == before  # no epoch claimed, nothing appended
    assert not (elsewhere / "runs" / b.run_id).exists()
