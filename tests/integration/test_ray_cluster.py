"""``rl-controller run --ray-address`` against an existing single-node Ray cluster.

The head is started as a user would (``ray start --head --num-cpus 4``) on loopback,
with token authentication on (what Ray's default does once a token exists) and the
token in a file the run finds through ``RAY_AUTH_TOKEN_PATH`` only -- the run must
switch token mode on by itself. Then:

* the default run needs 5 CPUs (TransferQueue 3, trainer 1, generator 1): refused up
  front with the numbers, nothing written, no hang;
* with one storage unit it needs 4 and fits: it trains a step and finishes;
* without the token: one line naming the variables to set, nothing written.

The head runs in its own temp dir and session; teardown stops exactly the processes
it started (by process group, then any left that name its temp dir), never
``ray stop``, which would stop every Ray on the host.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from events.embedded import stop_embedded_redis
from tests.integration.test_run_cli import assert_one_line_error, cli, runs

pytestmark = pytest.mark.integration

QUICK = ["--steps", "1", "--no-progress", "--set", "train.groups_per_step=2",
         "--set", "train.groups_per_microbatch=2", "--set", "rollout.samples_per_group=4",
         "--set", "rollout.groups_per_call=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray_exe() -> str:
    exe = Path(sys.executable).parent / "ray"
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


def _pids_naming(text: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and int(entry.name) != os.getpid():
                out.append(int(entry.name))
    return out


def _node_registered(port: int, env: dict[str, str]) -> bool:
    """``ray status`` sees a live node offering the head's 4 CPUs."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        out = subprocess.run(
            [_ray_exe(), "status", "--address", f"127.0.0.1:{port}"],
            env=env, capture_output=True, text=True, timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "/4.0 CPU" in out.stdout


@pytest.fixture(scope="module")
def ray_head():
    temp = tempfile.mkdtemp(prefix="rlc-ray-", dir="/tmp")  # short: Ray's socket paths
    token_file = Path(temp) / "token"
    token_file.write_text(secrets.token_hex(32))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    log = open(Path(temp) / "head.log", "wb")
    head = subprocess.Popen(
        [_ray_exe(), "start", "--head", "--block", "--num-cpus", "4", "--port", str(port),
         "--node-ip-address", "127.0.0.1", "--temp-dir", temp, "--include-dashboard=false",
         "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        # Ready when the head's node (its 4 CPUs) is registered with the GCS -- what a
        # run's capacity check reads --, not merely when the GCS port listens.
        deadline = time.monotonic() + 180
        while not _node_registered(port, env):
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail("ray start failed:\n" + (Path(temp) / "head.log").read_text()[-3000:])
            time.sleep(1)  # between polls only; the condition decides
        yield {"address": f"127.0.0.1:{port}", "token_file": str(token_file)}
    finally:
        try:
            os.killpg(head.pid, signal.SIGTERM)
            head.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        for pid in _pids_naming(temp):  # only what this head started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture()
def data_dir(tmp_path):
    try:
        yield tmp_path
    finally:
        stop_embedded_redis(tmp_path)


def _env(ray_head, *, token: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    if token:
        env["RAY_AUTH_TOKEN_PATH"] = ray_head["token_file"]
    else:
        env["HOME"] = tempfile.mkdtemp(prefix="rlc-home-")  # no ~/.ray/auth_token either
    return env


def test_a_run_that_cannot_be_placed_is_refused_up_front_with_the_numbers(ray_head, data_dir):
    proc = cli("run", "--run-id", "too-big", "--ray-address", ray_head["address"],
               "--data-dir", str(data_dir), *QUICK, env=_env(ray_head, token=True), timeout_s=180)
    assert_one_line_error(proc, "needs 5 CPUs", "has 4 CPUs", "dataplane.storage_units")
    assert not (data_dir / "runs" / "too-big").exists()  # no orphan directory either
    if (data_dir / "redis").exists():
        assert "too-big" not in runs(data_dir)


def test_a_run_that_fits_trains_on_the_existing_cluster(ray_head, data_dir):
    proc = cli("run", "--run-id", "fits", "--ray-address", ray_head["address"],
               "--data-dir", str(data_dir), *QUICK, "--set", "dataplane.storage_units=1",
               env=_env(ray_head, token=True), timeout_s=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = runs(data_dir)["fits"]
    assert row["finished"] is True and row["trainer_version"] == 1


def test_without_the_token_the_error_names_the_variables(ray_head, data_dir):
    proc = cli("run", "--run-id", "no-token", "--ray-address", ray_head["address"],
               "--data-dir", str(data_dir), *QUICK, "--set", "dataplane.storage_units=1",
               env=_env(ray_head, token=False), timeout_s=180)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rl-controller: error: ") and "RAY_AUTH_TOKEN" in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (data_dir / "runs" / "no-token").exists()  # no orphan directory either
    if (data_dir / "redis").exists():
        assert "no-token" not in runs(data_dir)
