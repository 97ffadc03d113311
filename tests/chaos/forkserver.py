"""A fork server for chaos tests: real controller processes without the import cost.

Every ``rl-controller`` process pays seconds to import torch. This server imports the
CLI once and then ``fork``s one child per command; each child is a real process with
its own pid that runs ``cli.main.main(argv)`` with its own environment
(``RLC_CRASH_AT`` included), can exit at a crash point with 137, or be SIGKILLed by
the test. The server itself starts no threads and opens no connections before
forking, so children start clean.

Protocol (one JSON object per line)::

    -> {"op": "spawn", "argv": [...], "env": {...}, "log": "/path/out.txt"}
    <- {"pid": 1234}
    -> {"op": "wait", "pid": 1234, "timeout_s": 60}
    <- {"rc": 137}             # or {"rc": null} on timeout
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def _preload() -> None:
    import cli.main  # noqa: F401
    import cli.run_cmd  # noqa: F401
    import controller.wiring  # noqa: F401  (torch, the workers)
    import replay.audit  # noqa: F401
    import cli.replay_cmd  # noqa: F401
    import controller.projector  # noqa: F401
    import replay.retrain  # noqa: F401
    import workers.service  # noqa: F401
    import events.redis_store  # noqa: F401  (redis: ~2 s)
    from torch.utils import tensorboard  # noqa: F401  (the metrics sink)
    import torch._inductor  # noqa: F401  (use_deterministic_algorithms imports it: ~5 s)


def _child(argv: list[str], env: dict[str, str], log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdin.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.update(env)
    code = 1
    try:
        from controller import crashpoints
        from cli.main import main

        crashpoints.rearm(env.get(crashpoints.ENV_VAR, ""))
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def serve() -> None:
    _preload()
    out = sys.stdout
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                _child(req["argv"], req.get("env", {}), req["log"])
            reply: dict = {"pid": pid}
        elif req["op"] == "wait":
            reply = {"rc": _wait(req["pid"], req.get("timeout_s", 120.0))}
        else:
            reply = {"error": f"unknown op {req['op']!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
