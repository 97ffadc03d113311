"""``rl-controller run --set rollout.backend=vllm`` end to end with Ray actors on CPU.

The generator is a Ray actor running a real vLLM engine (in-process engine mode) on a
small random Llama written to a temporary directory; the trainer trains the same HF
model; every publish is a bucketed refit (buckets much smaller than the model). Then:
``audit`` exits 0; and a second run is killed with SIGKILL (its whole process group)
after two steps, resumed with ``--resume`` to a later step, finishes, audits clean, and the resumed
controller refitted the generator at the recovered version before generating again.
Every process a run started (Ray's included) is gone after it ends, counted by an
environment marker they inherit; only the embedded redis-server, kept on purpose for
later commands, is excluded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.plugin_tasks import HELD_TASK, held_env, hold_rewards_after
from tests.vllm_helpers import processes_with_env, vllm_skip_reason

_why = vllm_skip_reason()
if _why is not None:
    pytest.skip(_why, allow_module_level=True)

from events import schema as ev  # noqa: E402
from events.embedded import ensure_embedded_redis, stop_embedded_redis  # noqa: E402
from workers.models.hf_tiny import write_tiny_hf_model  # noqa: E402

pytestmark = [
    pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200),
]

ROOT = Path(__file__).resolve().parents[2]
MARK = "RLC_TEST_PROCESS_MARK"
RESUMED_TO = 8  # see test_kill_minus_9_of_the_whole_run_then_resume
#: rewards per step: train.groups_per_step x rollout.samples_per_group (``_args``)
STEP_REWARDS = 2 * 4


def _args(model: Path, data_dir: Path) -> list[str]:
    sets = {
        "rollout.backend": "vllm", "model.kind": "hf", "model.path": str(model),
        "rollout.refit_bucket_mib": 0.05,  # ~50 KB buckets for a ~350 KB model
        "rollout.vllm.kv_cache_mib": 32, "rollout.samples_per_group": 4,
        "rollout.groups_per_call": 2, "train.groups_per_step": 2,
        "train.groups_per_microbatch": 1, "checkpoint.every_steps": 2,
        "checkpoint.retain_payloads": "all", "task.num_prompts": 64,
        "sampling.max_new_tokens": 4, "ray.num_cpus": 6, "controller.stall_timeout_s": 300,
    }
    out = ["--no-progress", "--data-dir", str(data_dir)]
    for key, value in sets.items():
        out += ["--set", f"{key}={value}"]
    return out


def _start(
    args: list[str], mark: str, log: Path, extra_env: dict[str, str] | None = None
) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RLC_REDIS_URL"} | (extra_env or {})
    env[MARK] = mark
    env["PYTHONPATH"] = str(ROOT)  # a killed run's resume imports its (test) task too
    return subprocess.Popen(
        [sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env,
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )


def _left_behind(mark: str, timeout_s: float = 60) -> list[str]:
    """Processes carrying ``mark`` (but the embedded redis-server) once they had time to go."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for pid in processes_with_env(f"{MARK}={mark}"):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "redis-server" not in cmd:
                left.append(f"{pid}: {cmd[:120]}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *argv], cwd=ROOT, capture_output=True,
        text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("llama"), seed=0)


@pytest.fixture
def data_dir(tmp_path):
    path = tmp_path / "data"
    try:
        yield path
    finally:
        stop_embedded_redis(path)


def _events(data_dir: Path, run_id: str) -> tuple:
    from events.redis_store import RedisEventStore
    from controller.projector import Projector

    store = RedisEventStore(ensure_embedded_redis(data_dir).url)
    try:
        return Projector(store).get(run_id), [s.event for s in store.read(run_id)]
    finally:
        store.close()


def test_run_with_vllm_generator_then_audit(model_dir, data_dir, tmp_path):
    mark = uuid.uuid4().hex
    proc = _start(["run", "--run-id", "v", "--steps", "3", *_args(model_dir, data_dir)], mark, tmp_path / "run.txt")
    rc = proc.wait(timeout=900)
    assert rc == 0, (tmp_path / "run.txt").read_text()[-4000:]
    assert _left_behind(mark) == []
    audit = _cli("audit", "--run", "v", "--json", "--data-dir", str(data_dir))
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
    assert '"steps_finished":3' in audit.stdout.replace(" ", "")
    result, events = _events(data_dir, "v")
    published = [e.weight_version for e in events if isinstance(e, ev.WeightsPublished)]
    assert published[:1] == [0] and {1, 2} <= set(published)  # every version refit in
    starts = [e.weight_version_start for e in events if isinstance(e, ev.GroupCommitted)]
    assert max(starts) >= 1  # groups were generated with refitted weights


def _kill_after_two_steps(args: list[str], mark: str, run_dir: Path, tmp_path: Path) -> None:
    """Start the run, SIGKILL its whole process group once two steps are reported. Its
    rewards are held after three steps' worth, so it is alive at the kill by
    construction, not because three more steps take longer than a poll."""
    hold = tmp_path / "hold"
    hold_rewards_after(hold, 3 * STEP_REWARDS)
    proc = _start([*args, *HELD_TASK], mark, tmp_path / "run.txt", held_env(hold))
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 900
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, (tmp_path / "run.txt").read_text()[-4000:]
        assert time.monotonic() < deadline, "the run did not reach step 2"
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    hold.unlink()
    left = _left_behind(mark)
    assert left == [], f"after kill -9 of the run's process group: {left}"


def test_kill_minus_9_of_the_whole_run_then_resume(model_dir, data_dir, tmp_path):
    mark = uuid.uuid4().hex
    args = ["run", "--run-id", "k", "--steps", "5", *_args(model_dir, data_dir)]
    _kill_after_two_steps(args, mark, data_dir / "runs" / "k", tmp_path)

    # The kill lands at some version v <= 5 (the run may step on between the poll and
    # the kill). At most window+1 = 2 steps' groups are live then, so they cover steps up
    # to v + 2 <= 7: resuming to 8 must generate, whatever v was. Resuming to 5 did not
    # always (a kill at v=3 with steps 4 and 5 already committed left nothing to make).
    mark2 = uuid.uuid4().hex
    resume = ["run", "--run-id", "k", "--steps", str(RESUMED_TO), "--resume", "--no-progress",
              "--data-dir", str(data_dir)]  # a resumed run keeps its logged config
    resumed = _start(resume, mark2, tmp_path / "resume.txt")
    assert resumed.wait(timeout=900) == 0, (tmp_path / "resume.txt").read_text()[-4000:]
    assert _left_behind(mark2) == []
    audit = _cli("audit", "--run", "k", "--json", "--data-dir", str(data_dir))
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
    result, events = _events(data_dir, "k")
    assert result.problem is None and result.state.trainer_version == RESUMED_TO
    second = max(i for i, e in enumerate(events) if isinstance(e, ev.ControllerStarted))
    after = events[second:]
    first_publish = next(e for e in after if isinstance(e, ev.WeightsPublished))
    commits = [e for e in after if isinstance(e, ev.GroupCommitted)]
    assert commits, "the resumed run committed no group"
    first_commit = commits[0]
    # the new generator got the recovered version before it generated anything
    assert after.index(first_publish) < after.index(first_commit)
    assert first_commit.weight_version_start >= first_publish.weight_version


def test_partial_rollouts_on_vllm_survive_kill_minus_9(model_dir, data_dir, tmp_path):
    """In-flight refits on vLLM (the engine stepped by hand) through the whole CLI: a run
    with rollout.partial on records flushes, is killed with SIGKILL after two steps, and
    resumes from the log -- audit 0, and every group that recorded flushes in a failed
    attempt was committed by a later attempt that kept them (the reducer checks that a
    resumed flush starts where the recorded tokens end)."""
    mark = uuid.uuid4().hex
    partial = ["--set", "rollout.partial.enabled=true", "--set", "rollout.partial.segment_tokens=2",
               "--set", "staleness.window_basis=newest_token"]
    args = ["run", "--run-id", "p", "--steps", "5", *_args(model_dir, data_dir), *partial]
    _kill_after_two_steps(args, mark, data_dir / "runs" / "p", tmp_path)
    mark2 = uuid.uuid4().hex
    resume = ["run", "--run-id", "p", "--steps", str(RESUMED_TO), "--resume", "--no-progress",
              "--data-dir", str(data_dir)]
    resumed = _start(resume, mark2, tmp_path / "resume.txt")
    assert resumed.wait(timeout=900) == 0, (tmp_path / "resume.txt").read_text()[-4000:]
    assert _left_behind(mark2) == []
    audit = _cli("audit", "--run", "p", "--json", "--data-dir", str(data_dir))
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
    result, events = _events(data_dir, "p")
    assert result.problem is None and result.state.trainer_version == RESUMED_TO
    flushes = [e for e in events if isinstance(e, ev.SegmentsRecorded)]
    assert flushes and all(f.weight_version is not None for f in flushes)
    committed = {e.group_id: e.attempt for e in events if isinstance(e, ev.GroupCommitted)}
    for f in flushes:  # a flush of a failed attempt was kept by the attempt that committed
        if f.group_id in committed:
            assert committed[f.group_id] >= f.attempt
