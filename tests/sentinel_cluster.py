"""A Redis primary, replicas and three sentinels on loopback, for failover tests.

Every node requires a password (the data nodes share one, the sentinels have their
own), as a deployment should. Sentinel's timeouts are small (``down_after_ms``,
``failover_timeout_ms``) so a failover takes about a second here; production values
are in docs/deploy.md. The data nodes are :class:`RedisServer` children, so a test can
``kill()`` the primary with SIGKILL and ``start()`` it again on its own AOF and port.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from events.embedded import HOST, FsyncPolicy, find_redis_server, free_port
from tests.link_proxy import LinkProxy
from tests.redis_server import RedisServer

MASTER = "rlc"


def find_redis_sentinel() -> str | None:
    return shutil.which("redis-sentinel")


def _node_config(password: str) -> list[str]:
    return [
        f"masterauth {password}",
        "repl-diskless-sync-delay 0",  # the replica's first full sync starts at once
        f"replica-announce-ip {HOST}",
    ]


class Sentinel:
    def __init__(self, directory: Path, binary: str, monitor_port: int, *, password: str,
                 sentinel_password: str, quorum: int, down_after_ms: int,
                 failover_timeout_ms: int) -> None:
        self.directory, self.binary = directory, binary
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)
        # Sentinel rewrites its config file as it learns; it must be writable.
        (directory / "sentinel.conf").write_text("\n".join([
            f"bind {HOST}", f"port {self.port}", f"dir {directory}", "daemonize no",
            f"logfile {directory / 'sentinel.log'}",
            f"sentinel announce-ip {HOST}",
            f"requirepass {sentinel_password}",
            f"sentinel sentinel-pass {sentinel_password}",
            f"sentinel monitor {MASTER} {HOST} {monitor_port} {quorum}",
            f"sentinel auth-pass {MASTER} {password}",
            f"sentinel down-after-milliseconds {MASTER} {down_after_ms}",
            f"sentinel failover-timeout {MASTER} {failover_timeout_ms}",
            f"sentinel parallel-syncs {MASTER} 1",
        ]) + "\n")

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, str(self.directory / "sentinel.conf")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None


class SentinelCluster:
    """primary + ``n_replicas`` replicas + ``n_sentinels`` sentinels (quorum 2), loopback.

    Each replica reaches the primary through a :class:`LinkProxy`, so a test can hold
    replication (``hold_replication``) the way a network stall would.
    """

    def __init__(self, directory: Path, *, password: str = "data-pw",
                 sentinel_password: str = "sentinel-pw", n_replicas: int = 1,
                 n_sentinels: int = 3, down_after_ms: int = 500,
                 failover_timeout_ms: int = 3000, relay: bool = True,
                 appendfsync: FsyncPolicy = "always") -> None:
        self.password, self.sentinel_password = password, sentinel_password
        binary = find_redis_server()
        self.primary = RedisServer(directory / "node-0", password=password, binary=binary,
                                   appendfsync=appendfsync, extra_config=_node_config(password))
        self.links = [LinkProxy(self.primary.port) for _ in range(n_replicas)] if relay else []
        ports = [link.port for link in self.links] or [self.primary.port] * n_replicas
        self.replicas = [
            RedisServer(directory / f"node-{i + 1}", password=password, binary=binary,
                        appendfsync=appendfsync,
                        extra_config=[*_node_config(password), f"replicaof {HOST} {port}"])
            for i, port in enumerate(ports)
        ]
        sentinel_binary = find_redis_sentinel() if n_sentinels else ""
        assert sentinel_binary or not n_sentinels, (
            "redis-sentinel not found (apt-get install redis-sentinel)"
        )
        self.sentinels = [
            Sentinel(directory / f"sentinel-{i}", sentinel_binary, self.primary.port,
                     password=password, sentinel_password=sentinel_password, quorum=2,
                     down_after_ms=down_after_ms, failover_timeout_ms=failover_timeout_ms)
            for i in range(n_sentinels)
        ]

    @property
    def replica(self) -> RedisServer:
        return self.replicas[0]

    @property
    def nodes(self) -> list[RedisServer]:
        return [self.primary, *self.replicas]

    def hold_replication(self) -> None:
        for link in self.links:
            link.hold()

    def replicating_through_links(self) -> bool:
        """True while every replica still replicates through its relay.

        Sentinel re-points a replica whose master address differs from the monitored
        one ("+fix-slave-config"), but only ``failover_timeout_ms`` after the replica's
        last configuration change: tests that hold the links keep that timeout long.
        """
        return all(int(self.role(node)["master_port"]) == link.port
                   for node, link in zip(self.replicas, self.links))

    def cut_replication(self) -> None:
        for link in self.links:
            link.close()

    @property
    def sentinel_spec(self) -> str:
        return ",".join(f"{HOST}:{s.port}" for s in self.sentinels)

    def env(self) -> dict[str, str]:
        return {"RLC_REDIS_PASSWORD": self.password,
                "RLC_SENTINEL_PASSWORD": self.sentinel_password}

    def client(self, node: RedisServer) -> redis.Redis:
        return redis.Redis(host=HOST, port=node.port, password=self.password,
                           socket_timeout=5, socket_connect_timeout=2)

    def start(self, timeout_s: float = 60.0) -> SentinelCluster:
        self.primary.start()
        for node in self.replicas:
            node.start()
        for node in self.replicas:
            self.wait_replica_in_sync(node, timeout_s)
        for s in self.sentinels:
            s.start()
        self.wait(lambda: all(self._sentinel_sees_all(s) for s in self.sentinels), timeout_s,
                  "sentinels did not discover the replica and each other")
        return self

    def _sentinel_sees_all(self, s: Sentinel) -> bool:
        try:
            c = redis.Redis(host=HOST, port=s.port, password=self.sentinel_password,
                            socket_timeout=2, decode_responses=True)
            info = c.sentinel_master(MASTER)
            return int(info["num-slaves"]) >= len(self.replicas) and int(info["num-other-sentinels"]) >= len(self.sentinels) - 1
        except (redis.RedisError, OSError):
            return False

    def sentinel_state(self, sentinel_port: int) -> dict[str, object] | None:
        """What one sentinel reports of the master (``SENTINEL MASTER``); None if it cannot say."""
        client = redis.Redis(host=HOST, port=sentinel_port, password=self.sentinel_password,
                             socket_timeout=2, decode_responses=True)
        try:
            return client.sentinel_master(MASTER)
        except (redis.RedisError, OSError):
            return None
        finally:
            client.close()

    def node_named_master(self) -> RedisServer | None:
        port = self.master_port()
        return next((n for n in self.nodes if n.port == port), None)

    def master_port(self) -> int | None:
        """The primary's port as a majority of sentinels name it."""
        votes: dict[int, int] = {}
        for s in self.sentinels:
            try:
                c = redis.Redis(host=HOST, port=s.port, password=self.sentinel_password, socket_timeout=2)
                _, port = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
                votes[int(port)] = votes.get(int(port), 0) + 1
            except (redis.RedisError, OSError, TypeError):
                continue
        best = max(votes.items(), key=lambda kv: kv[1], default=None)
        return best[0] if best and best[1] >= 2 else None

    def role(self, node: RedisServer) -> dict[str, str]:
        raw = self.client(node).info("replication")
        return {k: str(v) for k, v in raw.items()}

    def wait_replica_in_sync(self, node: RedisServer, timeout_s: float = 60.0) -> None:
        def synced() -> bool:
            try:
                info = self.role(node)
            except (redis.RedisError, OSError):
                return False
            return info.get("role") == "slave" and info.get("master_link_status") == "up"
        self.wait(synced, timeout_s, f"node on port {node.port} did not become an in-sync replica")

    @staticmethod
    def wait(predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} within {timeout_s:g}s")
            time.sleep(0.05)

    def pause(self, node: RedisServer) -> None:
        assert node.process is not None
        os.kill(node.process.pid, signal.SIGSTOP)

    def resume(self, node: RedisServer) -> None:
        assert node.process is not None
        os.kill(node.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        for s in self.sentinels:
            s.stop()
        self.cut_replication()
        for node in self.nodes:
            if node.process is not None:
                self.resume(node)
            node.stop()
