"""A real redis-server for tests: random loopback port, temp dir, AOF, appendfsync always.

Runs in the foreground as a child process (not daemonized) so a test can ``kill()`` it
with SIGKILL mid-append and ``start()`` it again on the same directory and port,
which replays the AOF: the crash a durability test needs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from events.embedded import FsyncPolicy, find_redis_server, free_port, server_config
from events.redis_store.connection import answers_ping


def resp_command(port: int, *args: str, timeout_s: float = 2.0) -> bytes:
    """Send one command over a raw socket, return the first reply line (``+OK``)."""
    payload = f"*{len(args)}\r\n".encode()
    for arg in args:
        raw = arg.encode()
        payload += b"$%d\r\n%s\r\n" % (len(raw), raw)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(payload)
        reply = b""
        while not reply.endswith(b"\r\n"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    return reply.strip()


class RedisServer:
    def __init__(
        self,
        directory: Path,
        *,
        appendfsync: FsyncPolicy = "always",
        password: str | None = None,
        binary: str | None = None,
        extra_config: list[str] | None = None,
    ) -> None:
        self.directory = Path(directory)
        #: more redis.conf lines (replicaof, masterauth, ...), written on every start
        self.extra_config = list(extra_config or [])
        self.appendfsync = appendfsync
        self.password = password
        self.binary = binary or find_redis_server()
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> RedisServer:
        """Start (or restart on the same dir and port) and wait until it answers."""
        assert self.process is None, "already running"
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        conf = self.directory / "redis.conf"
        conf.write_text(
            server_config(
                port=self.port,
                redis_dir=data,
                appendfsync=self.appendfsync,
                logfile=self.directory / "redis.log",
                password=self.password,
            )
            + "".join(f"{line}\n" for line in self.extra_config)
        )
        self.process = subprocess.Popen(
            [self.binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process = None
                raise RuntimeError(f"redis-server exited at start; see {self.directory}/redis.log")
            if self._answers():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer within {timeout_s}s")

    def _answers(self) -> bool:
        return answers_ping(self.url)  # the URL carries the password, if any

    def command(self, *args: str) -> bytes:
        """One command over a raw socket (first reply line), e.g. FLUSHALL."""
        if self.password is not None:
            raise NotImplementedError("raw commands on a password-protected test server")
        return resp_command(self.port, *args)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final fsync; what is on disk is what survives."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        """Clean shutdown (SIGTERM); a no-op when not running."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
