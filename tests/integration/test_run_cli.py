"""``rl-controller run`` end to end through the installed command, in its default mode.

A real embedded redis-server in a temporary ``--data-dir``, a local Ray, TransferQueue
and the tiny model: three steps, then ``audit`` over the run. Then bad input, each of
which must give one clear line on stderr, a non-zero exit and no write to the log.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "e2e-run"


def _command() -> list[str]:
    script = Path(sys.executable).parent / "rl-controller"
    if script.exists():
        return [str(script)]
    found = shutil.which("rl-controller")
    return [found] if found else [sys.executable, "-m", "cli.main"]


def cli(
    *argv: str, timeout_s: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != "RLC_REDIS_URL"}
    args = [*_command(), *argv]
    try:
        return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:  # a hang is a failure to report, with what it said
        said = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or "")
        return subprocess.CompletedProcess(args, -9, "", f"{said}\n[no answer after {timeout_s:g} s]")


@pytest.fixture(scope="module")
def trained(data_dir: Path) -> dict:
    """The one good run of this module; returns its row of ``rl-controller runs``."""
    proc = cli("run", "--steps", "3", "--run-id", RUN_ID, "--no-progress",
               "--data-dir", str(data_dir), timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the human summary goes to stderr (the console), like the progress display
    assert f"run {RUN_ID} finished: trainer_version 3" in proc.stdout + proc.stderr
    OUTPUT["run"] = proc
    return runs(data_dir)[RUN_ID]


#: what the module's one good run printed
OUTPUT: dict[str, subprocess.CompletedProcess[str]] = {}


def runs(data_dir: Path) -> dict[str, dict]:
    proc = cli("runs", "--json", "--data-dir", str(data_dir))
    assert proc.returncode == 0, proc.stderr
    return {row["run_id"]: row for row in json.loads(proc.stdout)}


def test_run_three_steps_then_audit(data_dir, trained):
    assert trained["trainer_version"] == 3
    assert trained["finished"] is True
    proc = cli("audit", "--run", RUN_ID, "--data-dir", str(data_dir))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    metrics = data_dir / "runs" / RUN_ID / "metrics.jsonl"
    assert [json.loads(line)["trainer_version"] for line in metrics.read_text().splitlines()] == [1, 2, 3]


def test_the_terminal_gets_no_third_party_noise_and_pasteable_commands(data_dir, trained):
    said = OUTPUT["run"].stdout + OUTPUT["run"].stderr
    for noise in ("target_num_threads", "Token authentication", "Warning", "INFO worker.py"):
        assert noise not in said, noise
    assert (data_dir / "runs" / RUN_ID / "third_party.log").exists()
    # --no-progress lines are never cut at 80 columns, even piped
    assert any(len(line) > 80 and "groups/s=" in line for line in said.splitlines()), said[-2000:]
    audit = next(line for line in said.splitlines() if line.strip().startswith("audit "))
    command = audit.split(None, 1)[1].split()
    assert command[0].endswith("rl-controller") and command[1:4] == ["audit", "--run", RUN_ID]
    assert command[-2:] == ["--data-dir", str(data_dir)]
    proc = cli(*command[1:])  # as printed (the executable is the one the test runs)
    assert proc.returncode == 0, proc.stderr[-2000:]


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode != 0, proc.stdout[-1000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, "expected one line on stderr, got:\n" + proc.stderr[-3000:]
    assert lines[0].startswith("rl-controller: error: "), lines[0]
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


BAD_INPUT = {
    "invalid value": (["--set", "train.lr=-1"], ["train.lr"]),
    "wrong type": (["--set", "rollout.samples_per_group=many"], ["rollout.samples_per_group"]),
    "unknown policy": (["--set", "staleness.selection=newest"], ["staleness.selection", "in_order"]),
    "unknown key": (["--set", "train.no_such_key=1"], ["train.no_such_key"]),
    "window too small a buffer": (
        ["--set", "staleness.window_versions=2", "--set", "staleness.buffer_groups=5"],
        ["staleness.buffer_groups"],
    ),
    "unknown budget basis": (
        ["--set", "staleness.budget_basis=per_sample"], ["staleness.budget_basis", "per_version"],
    ),
    "per-version buffer under one step": (
        ["--set", "staleness.budget_basis=per_version", "--set", "staleness.buffer_groups=5"],
        ["staleness.buffer_groups", "train.groups_per_step"],
    ),
    "unreachable ray": (["--ray-address", "127.0.0.1:1"], ["127.0.0.1:1"]),
    "malformed redis url": (["--redis-url", "localhost:6379"], ["--redis-url", "not a Redis URL"]),
    "unknown task": (["--set", "task.name=sort"], ["task.name", "sort", "reverse"]),
    "unimportable task plugin": (
        ["--set", 'task.name="no_such_pkg.tasks:Sort"'], ["task.name", "no_such_pkg"],
    ),
    "hf model without a directory": (
        ["--set", "model.kind=hf", "--set", 'model.path="/nonexistent/model"'],
        ["model.path", "/nonexistent/model"],
    ),
    "missing dataset": (["--set", 'task.dataset="/nonexistent/prompts.jsonl"'], ["task.dataset"]),
    "prompt too long for the model": (["--set", "model.context_len=4"], ["context"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_and_writes_nothing(data_dir, trained, case):
    args, needles = BAD_INPUT[case]
    run_id = f"bad-{case.replace(' ', '-')}"
    # A clear refusal takes seconds; 60 s is far beyond it.
    proc = cli("run", "--steps", "1", "--run-id", run_id, "--no-progress",
               "--data-dir", str(data_dir), *args, timeout_s=60)
    assert_one_line_error(proc, *needles)
    after = runs(data_dir)
    assert run_id not in after, f"{case}: the bad run was written to the log: {after[run_id]}"
    assert after[RUN_ID] == trained
    assert not (data_dir / "runs" / run_id).exists(), f"{case}: a run directory was left"


def _hf_without_tokenizer(d: Path) -> None:
    for f in d.iterdir():
        if "token" in f.name:
            f.unlink()


#: HF model directories the workers could not use: found by the pre-check, before Ray
HF_BROKEN = {
    "invalid config.json": (lambda d: (d / "config.json").write_text("{not json"),
                            "config.json cannot be loaded"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "no weights"),
    "no tokenizer files": (_hf_without_tokenizer, "to no tokens"),
}


@pytest.mark.parametrize("case", list(HF_BROKEN))
def test_an_hf_directory_the_workers_cannot_load_is_one_line_and_writes_nothing(
    data_dir, trained, tmp_path, case
):
    from tests.hf_fixture import save_tiny_hf_lm

    pytest.importorskip("transformers")
    model = save_tiny_hf_lm(tmp_path / "model", "qwen2")  # without files: an empty tokenizer
    break_it, says = HF_BROKEN[case]
    break_it(model)
    run_id = "bad-hf-" + case.split()[0]
    proc = cli("run", "--steps", "1", "--run-id", run_id, "--no-progress", "--data-dir",
               str(data_dir), "--set", "model.kind=hf", "--set", f'model.path="{model}"',
               timeout_s=180)
    assert_one_line_error(proc, "model.path", says)
    assert run_id not in runs(data_dir) and not (data_dir / "runs" / run_id).exists()


def test_unreachable_redis_is_one_line(data_dir, trained):
    proc = cli("run", "--steps", "1", "--run-id", "bad-redis", "--no-progress",
               "--redis-url", "redis://127.0.0.1:1", timeout_s=120)
    assert_one_line_error(proc, "127.0.0.1:1")
    after = runs(data_dir)
    assert "bad-redis" not in after and after[RUN_ID] == trained


def _run_beside_a_listener(data_dir, run_id: str, flags, timeout_s: float):
    """``run`` with ``flags(port)`` while a plain socket listens on ``port`` (it accepts
    and never answers); returns the finished process and the port."""
    listening = socket.create_server(("127.0.0.1", 0))
    try:
        port = listening.getsockname()[1]
        proc = cli("run", "--steps", "1", "--run-id", run_id, "--no-progress",
                   "--data-dir", str(data_dir), *flags(port), timeout_s=timeout_s)
    finally:
        listening.close()
    return proc, port


def test_a_ray_address_where_something_else_listens_is_refused_in_seconds(data_dir, trained):
    proc, port = _run_beside_a_listener(
        data_dir, "not-ray", lambda port: ["--ray-address", f"127.0.0.1:{port}"], 60)
    assert_one_line_error(proc, f"127.0.0.1:{port}", "does not answer as Ray")
    assert "not-ray" not in runs(data_dir) and not (data_dir / "runs" / "not-ray").exists()


def test_a_metrics_port_in_use_is_refused_before_anything_is_written(data_dir, trained):
    proc, port = _run_beside_a_listener(
        data_dir, "port-taken", lambda port: ["--set", f"metrics.port={port}"], 120)
    assert_one_line_error(proc, f"metrics.port {port}", "in use")
    assert "port-taken" not in runs(data_dir) and not (data_dir / "runs" / "port-taken").exists()


def test_existing_run_id_without_resume_is_refused(data_dir, trained):
    proc = cli("run", "--steps", "4", "--run-id", RUN_ID, "--no-progress",
               "--data-dir", str(data_dir), timeout_s=120)
    assert_one_line_error(proc, RUN_ID, "--resume")
    assert runs(data_dir)[RUN_ID] == trained  # same events, same epoch


def test_resume_of_a_missing_run_is_refused(data_dir, trained):
    proc = cli("run", "--resume", "--run-id", "no-such-run", "--no-progress",
               "--data-dir", str(data_dir), timeout_s=120)
    assert_one_line_error(proc, "no-such-run")
    after = runs(data_dir)
    assert "no-such-run" not in after and after[RUN_ID] == trained


def test_bad_dataset_line_is_one_line_naming_file_and_line(data_dir, trained, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "abc>", "answer": "cba"}\n{"prompt": "abd>", "answer": \n')
    before = runs(data_dir)
    proc = cli("run", "--steps", "1", "--run-id", "bad-dataset", "--no-progress",
               "--data-dir", str(data_dir), "--set", f'task.dataset="{prompts}"', timeout_s=60)
    assert_one_line_error(proc, "task.dataset", f"{prompts}:2", "not valid JSON")
    assert runs(data_dir) == before


@pytest.mark.parametrize("run_id", ["bad id{x}", "a/b", ".."])
def test_bad_run_id_is_one_line_and_writes_nothing(data_dir, trained, run_id):
    before = runs(data_dir)
    proc = cli("run", "--steps", "1", "--run-id", run_id, "--no-progress",
               "--data-dir", str(data_dir), timeout_s=60)
    assert_one_line_error(proc, "--run-id")
    assert runs(data_dir) == before


def test_resume_with_changed_config_is_refused_before_any_write(data_dir, trained):
    before = runs(data_dir)
    proc = cli("run", "--resume", "--run-id", RUN_ID, "--set", "train.lr=1e-3", "--no-progress",
               "--data-dir", str(data_dir), timeout_s=60)
    assert_one_line_error(proc, "recorded", "--set")
    assert runs(data_dir) == before  # no ControllerStarted: same events, same epoch, finished


#: runs the CLI's main in a fresh interpreter, then says whether Ray was even imported
_MAIN_THEN_REPORT_RAY = (
    "import sys\n"
    "from cli.main import main\n"
    "try:\n"
    "    rc = main(sys.argv[1:])\n"
    "finally:\n"
    "    print('ray imported:', 'ray' in sys.modules)\n"
    "sys.exit(rc)\n"
)


def test_resume_of_a_finished_run_answers_without_starting_anything(data_dir, trained):
    before = runs(data_dir)
    ray_tmp = Path(tempfile.mkdtemp(prefix="rlc-ray-"))  # short: Ray's socket paths live here
    try:
        env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
        env.pop("RLC_REDIS_URL", None)
        proc = subprocess.run(
            [sys.executable, "-c", _MAIN_THEN_REPORT_RAY, "run", "--resume", "--run-id", RUN_ID,
             "--no-progress", "--data-dir", str(data_dir)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "finished at trainer_version 3" in proc.stdout and "--steps" in proc.stdout
        assert "Traceback" not in proc.stderr
        # Ray was not started (no session under its temp dir), not even imported
        assert "ray imported: False" in proc.stdout, proc.stdout
        assert not list(ray_tmp.rglob("session_*")), sorted(ray_tmp.rglob("*"))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert runs(data_dir) == before
