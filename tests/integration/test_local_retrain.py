"""A ``--local-workers`` run is re-trained exactly by ``replay --retrain``.

Its trainer ran in a pool thread of the controller's process, where TransferQueue's
client had set torch's thread count to 2; the spec said 1, as ``replay --retrain``'s
trainer computes. A float32 step on 2 threads rounds differently, so every recorded
digest mismatched from step 0 on (`tests/unit/test_local_handle_threads.py` has the
mechanism). The default TransferQueue data plane, as the CLI runs it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _cli(*args: str, data_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args, "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=600,
    )


def test_a_local_workers_run_retrains_to_its_recorded_digests(tmp_path):
    from events.embedded import stop_embedded_redis

    try:
        run = _cli("run", "--local-workers", "--no-progress", "--steps", "2", "--run-id", "lw",
                   data_dir=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        replayed = _cli("replay", "--run", "lw", "--retrain", "--verify", data_dir=tmp_path)
        assert replayed.returncode == 0, replayed.stdout[-2000:] + replayed.stderr[-2000:]
        assert "replayed 2 steps from trainer_version 0: all digests match" in replayed.stdout
    finally:
        stop_embedded_redis(tmp_path)
