"""Chaos harness: start, crash and resume real controller processes; check the result.

A scenario is: run (a crash point armed, or a SIGKILL from outside) -> maybe more
crashing resumes -> a clean ``--resume`` to N steps -> :meth:`Chaos.check`, which
asserts, from the log and the workers' artefacts:

* ``rl-controller audit`` exits 0 (the reducer's invariants over the whole log: +1
  trainer_version per StepFinished, no group consumed by two finished steps, epochs,
  lag within the window, releases only under a checkpoint);
* the run reached trainer_version N;
* every committed group is consumed, released, evicted, lost (a rewind) or still
  buffered -- none is claimed or in limbo;
* no acknowledged event was lost: every step the controller reported finished (its
  metrics line, written only after the log acknowledged StepFinished) is in the log
  with the same trainer_version and digest;
* the final weights are the log's: ``replay --retrain --verify`` of the same log
  reproduces every step's digest, and its final digest equals the last StepFinished's
  and the final checkpoint's manifest digest when one was written at N.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXIT_CRASH = 137

#: tiny and fast: 2 groups of 4 samples per step, 1 group per microbatch (so a step has
#: two microbatches), checkpoint every 2 steps, payloads retained so replay can start
#: at step 0, memory data plane + durable spill, in-process workers.
TINY = [
    "--local-workers", "--no-progress",
    "--set", "dataplane.kind=memory", "--set", "dataplane.spill=true",
    "--set", "train.groups_per_step=2", "--set", "train.groups_per_microbatch=1",
    "--set", "rollout.samples_per_group=4", "--set", "checkpoint.every_steps=2",
    "--set", "checkpoint.retain_payloads=all", "--set", "task.num_prompts=64",
    "--set", "model.d_model=32", "--set", "sampling.max_new_tokens=6",
    "--set", "controller.stall_timeout_s=60",
]


class ForkServer:
    """Client of ``tests.chaos.forkserver`` (one server process per test module)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.chaos.forkserver"], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        ready = self._read()
        assert "ready" in ready, ready

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("fork server died")
        return json.loads(line)

    def _ask(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def spawn(self, argv: list[str], env: dict[str, str], log: Path) -> int:
        return self._ask({"op": "spawn", "argv": argv, "env": env, "log": str(log)})["pid"]

    def wait(self, pid: int, timeout_s: float = 120.0) -> int | None:
        return self._ask({"op": "wait", "pid": pid, "timeout_s": timeout_s})["rc"]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@dataclass
class Proc:
    pid: int
    log: Path


class Chaos:
    def __init__(self, server: ForkServer, redis_url: str, root: Path, extra: list[str] | None = None) -> None:
        self.server = server
        self.redis_url = redis_url
        self.root = root
        self.extra = list(extra or [])
        #: environment every process of the scenario gets (test hooks)
        self.env: dict[str, str] = {}
        self._n = 0

    # -- processes ----------------------------------------------------------------

    def _log(self, what: str) -> Path:
        self._n += 1
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root / f"{self._n:03d}-{what}.txt"

    def _store_args(self) -> list[str]:
        return ["--redis-url", self.redis_url, "--data-dir", str(self.root / "data")]

    def start(self, run_id: str, *, steps: int, resume: bool, crash: str = "",
              args: list[str] | None = None) -> Proc:
        argv = ["run", "--run-id", run_id, "--steps", str(steps), *self._store_args()]
        if resume:
            argv += ["--resume", "--local-workers", "--no-progress"] + (args or [])
        else:
            argv += TINY + self.extra + (args or [])
        log = self._log(("resume" if resume else "run") + (f"-{crash}" if crash else ""))
        env = {**self.env, "RLC_CRASH_AT": crash}
        return Proc(self.server.spawn(argv, env, log), log)

    def finish(self, proc: Proc, timeout_s: float = 120.0) -> int:
        rc = self.server.wait(proc.pid, timeout_s)
        if rc is None:
            os.kill(proc.pid, signal.SIGKILL)
            self.server.wait(proc.pid, 10)
            raise AssertionError(f"process timed out; log:\n{proc.log.read_text()[-3000:]}")
        return rc

    def run(self, run_id: str, *, steps: int, resume: bool, crash: str = "",
            args: list[str] | None = None, expect: int | tuple[int, ...] | None = None) -> int:
        proc = self.start(run_id, steps=steps, resume=resume, crash=crash, args=args)
        rc = self.finish(proc)
        wanted = (expect,) if isinstance(expect, int) else expect
        if wanted is not None and rc not in wanted:
            raise AssertionError(f"exit {rc}, expected {wanted}; log:\n{proc.log.read_text()[-4000:]}")
        return rc

    def kill_after(self, run_id: str, *, steps: int, resume: bool, delay_s: float) -> int:
        """Start, SIGKILL after ``delay_s`` (if still running); returns the exit code."""
        proc = self.start(run_id, steps=steps, resume=resume)
        rc = self.server.wait(proc.pid, delay_s)
        if rc is None:
            os.kill(proc.pid, signal.SIGKILL)
            rc = self.server.wait(proc.pid, 30)
        return rc

    def cli(self, *argv: str) -> tuple[int, str]:
        log = self._log(argv[0])
        rc = self.finish(Proc(self.server.spawn([*argv, *self._store_args()], {"RLC_CRASH_AT": ""}, log), log))
        return rc, log.read_text()

    def run_dir(self, run_id: str) -> Path:
        return self.root / "data" / "runs" / run_id

    # -- checks -------------------------------------------------------------------

    def fold(self, run_id: str):
        from events.redis_store import RedisEventStore
        from controller.projector import Projector

        store = RedisEventStore(self.redis_url)
        try:
            return Projector(store).get(run_id)
        finally:
            store.close()

    def check(self, run_id: str, steps: int, *, replay: bool = True) -> dict[str, Any]:
        from controller.core.state import GroupStatus

        rc, out = self.cli("audit", "--run", run_id, "--json")
        assert rc == 0, f"audit failed:\n{out[-3000:]}"
        result = self.fold(run_id)
        assert result.problem is None, result.problem
        state = result.state
        assert state.trainer_version == steps, (state.trainer_version, steps)
        assert state.open_step is None
        limbo = [g.group_id for g in state.groups.values() if g.status is GroupStatus.CLAIMED]
        assert not limbo, f"claimed groups outside an open step: {limbo}"
        for g in state.groups.values():
            if g.status is GroupStatus.COMMITTED:
                assert g.group_id in state.buffer, f"{g.group_id} committed but not buffered"
        consumers: dict[str, int] = {}
        for rec in state.finished_steps():
            for gid in rec.group_ids:
                assert gid not in consumers, f"{gid} consumed by steps {consumers[gid]} and {rec.step}"
                consumers[gid] = rec.step
        self._check_acknowledged(run_id, state)
        final = state.steps[state.version_steps[steps]].weights_digest
        self._check_final_checkpoint(state, steps, final)
        report = None
        if replay:
            report = self.replay(run_id, state)
            assert report["ok"], report
            assert report["final_digest"] == final, (report["final_digest"], final)
        return {"state": state, "replay": report}

    def _check_acknowledged(self, run_id: str, state) -> None:
        """Every step a controller reported (after its StepFinished was acknowledged)."""
        metrics = self.run_dir(run_id) / "metrics.jsonl"
        if not metrics.exists():
            return
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill -9
            step = row.get("step")
            rec = state.steps.get(step)
            assert rec is not None, f"step {step} was reported finished but is not in the log"
            assert rec.trainer_version == row.get("trainer_version", rec.trainer_version)

    def _check_final_checkpoint(self, state, steps: int, final: str) -> None:
        for ck in reversed(state.checkpoints):
            if ck.trainer_version == steps and not ck.lost and not ck.rejected:
                manifest = json.loads((Path(ck.uri) / "manifest.json").read_text())
                assert manifest["meta"]["weights_digest"] == final
                return

    def replay(self, run_id: str, state) -> dict[str, Any]:
        """``replay --retrain --verify`` from step 0, else from the newest checkpoint."""
        rc, out = self.cli("replay", "--run", run_id, "--retrain", "--verify", "--json")
        if rc == 2 and "not in the spill directory" in out:
            ck = state.latest_checkpoint()
            rc, out = self.cli("replay", "--run", run_id, "--retrain", "--verify", "--json",
                               "--from-checkpoint", str(ck.trainer_version))
        assert rc == 0, f"replay --retrain failed ({rc}):\n{out[-3000:]}"
        return json.loads(out[out.index("{"):])


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False
