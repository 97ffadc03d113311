"""Start-up of ``rl-controller run``: whole-command seconds, variants interleaved.

Each repetition runs every variant once, in turn (so a change in the machine's load
falls on all of them alike), as a fresh ``run --steps 1`` in its own ``--data-dir``,
then ``run --resume`` of that finished run. Printed per variant: min and median of the
whole command, of the CPU seconds its processes used (Ray's included: on a shared machine
the steadier figure), of the finished-run resume, and of the milestones the run logs at its
first step (``startup`` in ``controller.log.jsonl``: seconds since the process started),
the phases between them, the CPU seconds by process (the driver, Ray's daemons,
TransferQueue's controller and storage units, the trainer and the generators) and how
many processes the command ran (all, and those that import torch); then
each variant's median as a ratio of the first variant's.

A variant is ``NAME=COMMAND``: the command that stands for ``rl-controller`` (an
executable, ``python -m cli.main`` with an environment, another checkout's
interpreter...), split like a shell line; ``env K=V ...`` in front sets variables, and words after
`` -- `` in it are added to that variant's ``run`` (e.g. ``-- --set dataplane.storage_units=1``).

    python -m bench.bench_startup --repeats 5
    python -m bench.bench_startup --variant "before=env PYTHONPATH=/tmp/old python -m cli.main" \\
        --variant "after=python -m cli.main" --repeats 5 -- --set rollout.num_generators=2

Arguments after ``--`` are added to every ``run`` (not to the resume).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MILESTONES = ("cli_ready_s", "ray_ready_s", "workers_ready_s", "first_step_s")
#: the phases between the milestones (the last one: from the first step to the exit)
PHASES = ("cli", "store+ray", "dataplane+workers", "first step", "rest+teardown")
CPU_ROLES = ("driver", "ray daemons", "TransferQueueController", "SimpleStorageUnit",
             "TrainerWorker", "GeneratorWorker")
#: the processes that import torch, tensordict and TransferQueue (Ray's daemons do not)
TORCH_ROLES = ("driver", "TransferQueueController", "SimpleStorageUnit", "TrainerWorker",
               "GeneratorWorker")


def _default_command() -> str:
    script = Path(sys.executable).parent / "rl-controller"
    return str(script) if script.exists() else f"{sys.executable} -m cli.main"


_TICKS = os.sysconf("SC_CLK_TCK")


#: a process of the command's session, by the name Ray gives its actors (else its role)
ROLES = ("TransferQueueController", "SimpleStorageUnit", "TrainerWorker", "GeneratorWorker")


def _role(pid: int, sid: int) -> str:
    if pid == sid:
        return "driver"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")
    except OSError:
        return "ray daemons"
    return next((r for r in ROLES if r in cmd), "ray daemons")


def _session_cpu(sid: int, seen: dict[int, tuple[str, float]]) -> None:
    """CPU seconds so far of every process in session ``sid`` (Ray's daemons and actors
    stay in the session of the command that started them), the highest seen per pid,
    with the process's role (an actor's name is set once its class is loaded)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # fields after the name: state ppid pgrp session ...
            pid = int(entry.name)
            cpu = (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime
            role, before = seen.get(pid, ("ray daemons", 0.0))
            if role == "ray daemons":
                role = _role(pid, sid)
            seen[pid] = (role, max(cpu, before))


def _timed(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[float, dict[str, float], int, str]:
    """Wall seconds, CPU seconds of the command's whole session by role (sampled every
    0.2 s, so a process that lives less than that is missed), exit status, stderr's tail."""
    started = time.perf_counter()
    seen: dict[int, tuple[str, float]] = {}
    with tempfile.TemporaryFile("w+") as err:
        # cwd: a neutral directory, so ``python -m`` imports the variant's checkout
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                text=True, cwd=tempfile.gettempdir(), start_new_session=True)
        while proc.poll() is None:
            _session_cpu(proc.pid, seen)
            if time.perf_counter() - started > timeout_s:
                proc.kill()
            time.sleep(0.2)
        wall = time.perf_counter() - started
        err.seek(0)
        by_role: dict[str, float] = {}
        for role, cpu in seen.values():
            by_role[role] = by_role.get(role, 0.0) + cpu
        by_role["processes"] = float(len(seen))
        by_role["torch processes"] = float(sum(1 for r, _ in seen.values() if r in TORCH_ROLES))
        return wall, by_role, proc.returncode, err.read()[-1500:]


def one(command: str, data_dir: Path, extra: list[str], timeout_s: float) -> dict[str, float]:
    words = shlex.split(command)
    env = dict(os.environ)
    if words and words[0] == "env":
        words.pop(0)
        while words and "=" in words[0]:
            k, _, v = words.pop(0).partition("=")
            env[k] = v
    env.pop("RLC_REDIS_URL", None)
    if "--" in words:  # a variant's own run arguments
        at = words.index("--")
        words, extra = words[:at], [*words[at + 1:], *extra]
    common = ["--run-id", "bench", "--no-progress", "--data-dir", str(data_dir)]
    exe = words[0] if words else ""
    # the commands run in a temporary directory: a relative path would not resolve there
    if (os.sep in exe and not os.path.isabs(exe)) or not shutil.which(exe, path=env.get("PATH")):
        raise SystemExit(f"variant {command!r}: {exe!r} is not an executable "
                         "(the commands run from a temporary directory: give an absolute path)")
    try:
        run_s, cpu, rc, err = _timed([*words, "run", "--steps", "1", *common, *extra], env, timeout_s)
        if rc != 0:
            raise SystemExit(f"{command!r} failed ({rc}):\n{err}")
        resume_s, _, rc, err = _timed([*words, "run", "--resume", *common], env, timeout_s)
        if rc != 0:
            raise SystemExit(f"{command!r} resume failed ({rc}):\n{err}")
    finally:
        subprocess.run([*words, "stop-server", "--data-dir", str(data_dir)], env=env,
                       capture_output=True, timeout=60, cwd=tempfile.gettempdir())
    counts = {k: cpu.pop(k) for k in ("processes", "torch processes")}
    out = {"command_s": run_s, "cpu_s": sum(cpu.values()), "resume_finished_s": resume_s,
           **counts}
    for line in (data_dir / "runs" / "bench" / "controller.log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "startup":
            out.update({k: rec[k] for k in MILESTONES if k in rec})
    if all(k in out for k in MILESTONES):  # each phase's own seconds
        marks = [0.0, *(out[k] for k in MILESTONES), run_s]
        out.update({p: b - a for p, a, b in zip(PHASES, marks, marks[1:])})
    out.update({f"cpu {role}": cpu.get(role, 0.0) for role in CPU_ROLES})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", default=[], metavar="NAME=COMMAND")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("extra", nargs="*", help="after --: added to every 'run --steps 1'")
    args = p.parse_args()
    variants = [v.partition("=")[::2] for v in args.variant] or [("current", _default_command())]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in variants}
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        for rep in range(args.repeats):
            for name, command in variants:
                r = one(command, Path(tmp) / f"{name}-{rep}", args.extra, args.timeout_s)
                results[name].append(r)
                print(f"rep {rep} {name:<10} " + " ".join(f"{k}={v:.1f}" for k, v in r.items()),
                      flush=True)
    print(f"load average at end: {os.getloadavg()}")
    def table(title: str, keys: tuple[str, ...]) -> None:
        print(f"\n{title}")
        print(f"{'variant':<10} " + " ".join(f"{k + ' min/med':>24}" for k in keys))
        for name, rows in results.items():
            cells = []
            for k in keys:
                vals = [r[k] for r in rows if k in r]
                cells.append(f"{min(vals):10.1f} /{statistics.median(vals):6.1f} s" if vals else "-")
            print(f"{name:<10} " + " ".join(f"{c:>24}" for c in cells))

    table("whole command, CPU of its processes, resume of the finished run",
          ("command_s", "cpu_s", "resume_finished_s"))
    table("processes of the command's session (sampled every 0.2 s; counts, not seconds)",
          ("processes", "torch processes"))
    table("milestones (seconds since the command started)", MILESTONES)
    table("phases (seconds each)", PHASES)
    table("CPU seconds by process", tuple(f"cpu {r}" for r in CPU_ROLES))
    base = statistics.median(r["command_s"] for r in results[variants[0][0]])
    base_cpu = statistics.median(r["cpu_s"] for r in results[variants[0][0]])
    for name, rows in results.items():
        print(f"{name:<10} median command time {statistics.median(r['command_s'] for r in rows) / base:.2f}x, "
              f"CPU {statistics.median(r['cpu_s'] for r in rows) / base_cpu:.2f}x of {variants[0][0]}")


if __name__ == "__main__":
    main()
