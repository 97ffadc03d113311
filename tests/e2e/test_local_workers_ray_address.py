"""``run --local-workers --ray-address A`` checks A like a Ray run does. The data plane
still joins ``ray.address`` (TransferQueue's actors), but the check was skipped with
--local-workers: an unreachable address left a started run (RunStarted,
ControllerStarted) behind and hung in ``ray.init``'s retries for minutes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from events.embedded import stop_embedded_redis

ROOT = Path(__file__).resolve().parents[2]


def test_an_unreachable_ray_address_is_one_line_before_anything_is_written(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != "RLC_REDIS_URL"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "cli.main", "run", "--local-workers", "--no-progress",
             "--steps", "1", "--run-id", "r", "--data-dir", str(data_dir),
             "--ray-address", "127.0.0.1:1"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )
    finally:
        stop_embedded_redis(data_dir)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == "rl-controller: error: cannot reach Ray at 127.0.0.1:1: Connection refused"
    assert not (data_dir / "runs").exists()  # no run, no run directory
