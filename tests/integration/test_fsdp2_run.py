"""``rl-controller run`` with ``train.backend = "fsdp2"``: Ray rank actors at dp 2, and a
Hugging Face Llama from a local directory; ``audit`` and ``replay --retrain --verify``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.hf_fixture import save_tiny_hf_lm

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL = [
    "--no-progress", "--set", "dataplane.spill=true",
    "--set", "checkpoint.retain_payloads=all", "--set", "checkpoint.every_steps=2",
    "--set", "train.groups_per_step=2", "--set", "train.groups_per_microbatch=1",
    "--set", "rollout.samples_per_group=4", "--set", "train.backend=fsdp2",
]


def _cli(*args: str, data_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args, "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=900,
    )


def _run_audit_replay(data_dir, run_id: str, *args: str, steps: int = 3, replay: bool = True) -> None:
    from events.embedded import stop_embedded_redis

    try:
        run = _cli("run", "--steps", str(steps), "--run-id", run_id, *SMALL, *args, data_dir=data_dir)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        audit = _cli("audit", "--run", run_id, "--json", data_dir=data_dir)
        assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
        assert f'"steps_finished":{steps}' in audit.stdout
        if not replay:
            return
        out = _cli("replay", "--run", run_id, "--retrain", "--verify", "--json", data_dir=data_dir)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        report = json.loads(out.stdout[out.stdout.index("{"):])
        assert report["ok"] and len(report["steps"]) == steps
    finally:
        stop_embedded_redis(data_dir)


def test_run_fsdp2_at_data_parallel_2_with_ray_rank_actors(tmp_path):
    """Ray workers and TransferQueue; the trainer is a TrainerGroup of two rank actors.
    (``replay --retrain`` of a dp-2 run works too but starts a second Ray: ~2 more
    minutes on 2 cores; the chaos suite checks replay with this backend at dp 1.)"""
    _run_audit_replay(tmp_path, "fsdp2-dp2", "--set", "train.data_parallel=2", replay=False)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_run_fsdp2_with_a_local_hf_llama(tmp_path, tp):
    """A local HF Llama through ``run`` and its exact replay; at tp 2 the trainer is two
    rank actors on one mesh row."""
    pytest.importorskip("transformers")
    model = save_tiny_hf_lm(tmp_path / "llama", "llama", tie=True)
    _run_audit_replay(
        tmp_path / "data", f"fsdp2-hf-tp{tp}", "--local-workers", "--set", "dataplane.kind=memory",
        "--set", "model.kind=hf", "--set", f"model.path={model}",
        "--set", f"train.tensor_parallel={tp}",
    )
