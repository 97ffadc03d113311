"""``rl-controller run`` with ``train.backend = "megatron"`` trains and audits clean."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _cli(*args: str, data_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args, "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=600,
    )


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_run_with_megatron_backend_then_audit(tmp_path, data_parallel):
    """At data parallel 2 the trainer is a TrainerGroup of Ray rank actors (one
    megatron rank each), the same shell the torch and fsdp2 backends use."""
    from events.embedded import stop_embedded_redis

    try:
        run = _cli(
            "run", "--local-workers", "--no-progress", "--steps", "2", "--run-id", "mcore",
            "--set", "train.backend=megatron", "--set", "dataplane.kind=memory",
            "--set", "dataplane.spill=false", "--set", "train.groups_per_step=2",
            "--set", "train.groups_per_microbatch=1", "--set", "rollout.samples_per_group=4",
            "--set", f"train.data_parallel={data_parallel}",
            data_dir=tmp_path,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        audit = _cli("audit", "--run", "mcore", "--json", data_dir=tmp_path)
        assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
        assert '"steps_finished":2' in audit.stdout
    finally:
        stop_embedded_redis(tmp_path)
