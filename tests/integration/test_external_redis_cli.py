"""``run --redis-url`` against an external Redis that does not fsync every append.

A real redis-server with ``appendfsync everysec`` and a password: the run warns once,
plainly, what a crash of that server can lose (password never printed) and goes on;
with ``store.require_fsync_always = true`` it refuses before writing anything.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.test_run_cli import assert_one_line_error, cli
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration

PASSWORD = "s3cret-pw"
#: one in-process step with small groups: enough to see the run go on after the warning
QUICK = ["--steps", "1", "--no-progress", "--local-workers", "--set", "dataplane.kind=memory",
         "--set", "train.groups_per_step=2", "--set", "train.groups_per_microbatch=2",
         "--set", "rollout.samples_per_group=4", "--set", "rollout.groups_per_call=2"]


@pytest.fixture()
def everysec(tmp_path):
    server = RedisServer(tmp_path / "redis", appendfsync="everysec", password=PASSWORD).start()
    try:
        yield server
    finally:
        server.stop()


def _runs(url: str) -> dict:
    proc = cli("runs", "--json", "--redis-url", url)
    assert proc.returncode == 0, proc.stderr
    return {row["run_id"]: row for row in json.loads(proc.stdout)}


@pytest.mark.parametrize("setting, words", [
    # the server's fsync policy is weaker than the run asks for
    ("store.require_fsync_always=true", ("appendfsync everysec", "store.require_fsync_always")),
    # every append would wait for a replica's confirmation that cannot come: the line
    # names the key, the number wanted and the number the server has
    ("store.replicas=1", ("store.replicas = 1", "has 0 connected replicas")),
])
def test_a_store_that_cannot_give_what_the_run_asks_is_refused_before_any_write(
        everysec, tmp_path, setting, words):
    proc = cli("run", "--run-id", "refused", "--redis-url", everysec.url, "--data-dir",
               str(tmp_path), *QUICK, "--set", setting, timeout_s=120)
    assert_one_line_error(proc, *words)
    assert PASSWORD not in proc.stderr + proc.stdout
    assert _runs(everysec.url) == {}


def test_weaker_durability_is_a_single_plain_warning(everysec, tmp_path):
    proc = cli("run", "--run-id", "warned", "--redis-url", everysec.url, "--data-dir",
               str(tmp_path), *QUICK, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("rl-controller: warning:")]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "appendfsync everysec" in warnings[0] and "last second" in warnings[0]
    assert PASSWORD not in proc.stderr + proc.stdout
    assert _runs(everysec.url)["warned"]["finished"] is True


def test_a_data_dir_that_cannot_hold_the_run_directory_is_one_line(redis_url, tmp_path):
    # with --redis-url the log is elsewhere, but the run directory is still made under
    # --data-dir: a file there was a NotADirectoryError traceback once the run opened
    afile = tmp_path / "afile"
    afile.write_text("")
    proc = cli("run", "--run-id", "dd", "--redis-url", redis_url, "--data-dir", str(afile),
               *QUICK, timeout_s=120)
    assert_one_line_error(proc, f"--data-dir '{afile}'", "is a file, not a directory")
    assert _runs(redis_url) == {}
