"""A real multi-node Ray cluster on one machine: ``ray start`` processes on loopback.

Each node is its own ``ray start --block`` process group (head or joined with
``--address``), with its own custom resource label, its own ports (picked free, never
Ray's defaults, which other clusters on the host may hold) and a temp dir of the
test's. Nodes are stopped by their process group, never with ``ray stop`` (which
would stop every Ray on the host).

Token authentication: Ray >= 2.5x turns it on by itself when ``~/.ray/auth_token``
exists and ``RAY_AUTH_MODE`` is unset, so whether a cluster needs a token would
depend on the machine. The cluster sets ``RAY_AUTH_MODE=token`` with a token of its
own for every node and hands the same environment (``env``) to its drivers.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from events.embedded import HOST, free_port


def _ray_bin() -> str:
    return str(Path(sys.executable).parent / "ray")


class RayNode:
    def __init__(self, cluster: RayCluster, name: str, resource: str, num_cpus: int) -> None:
        self.cluster, self.name, self.resource, self.num_cpus = cluster, name, resource, num_cpus
        self.process: subprocess.Popen[bytes] | None = None
        self.log = cluster.directory / f"{name}.log"
        self.head = False
        self.starts = 0

    def start(self, *, head: bool) -> RayNode:
        self.head = head
        self.starts += 1
        ports = ["--node-manager-port", "--object-manager-port", "--runtime-env-agent-port",
                 "--dashboard-agent-grpc-port", "--dashboard-agent-listen-port",
                 "--metrics-export-port"]
        argv = [_ray_bin(), "start", "--block", "--node-ip-address", HOST,
                "--num-cpus", str(self.num_cpus), "--resources", json.dumps({self.resource: 1}),
                "--disable-usage-stats"]
        for flag in ports:
            argv += [flag, str(free_port())]
        if head:
            argv += ["--head", "--port", str(self.cluster.gcs_port),
                     "--temp-dir", str(self.cluster.temp_dir), "--include-dashboard", "false",
                     "--dashboard-port", str(free_port()), "--ray-client-server-port",
                     str(free_port())]
        else:
            argv += ["--address", self.cluster.address]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                            env=self.cluster.env, start_new_session=True)
        return self

    def processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process of this node (its session: Ray puts workers
        in process groups of their own, but they stay in the session ray start began)."""
        assert self.process is not None
        out = subprocess.run(["ps", "-ww", "-eo", "pid=,sess=,args="], capture_output=True,
                             text=True, check=True).stdout
        found = []
        for line in out.splitlines():
            pid, sess, *args = line.split(None, 2)
            if int(sess) == self.process.pid:
                found.append((int(pid), args[0] if args else ""))
        return found

    def raylet_pid(self) -> int:
        for pid, args in self.processes():
            if Path(args.split()[0]).name == "raylet":
                return pid
        raise AssertionError(f"no raylet in node {self.name}: {self.processes()}")

    def stop(self) -> None:
        """SIGKILL every process of the node (its session), the node's own first."""
        if self.process is None:
            return
        for pid in [self.process.pid] + [p for p, _ in self.processes() if p != self.process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=30)
        self.process = None


class RayCluster:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        # Ray's socket paths must stay short: a short temp dir of its own.
        self.temp_dir = Path(f"/tmp/rlc-ray-{os.getpid()}-{secrets.token_hex(3)}")
        self.gcs_port = free_port()
        self.address = f"{HOST}:{self.gcs_port}"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RLC_"))}
        self.env = {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.nodes: list[RayNode] = []

    def add_node(self, name: str, resource: str, num_cpus: int, *, head: bool = False) -> RayNode:
        node = RayNode(self, name, resource, num_cpus).start(head=head)
        self.nodes.append(node)
        return node

    def restart_failed_nodes(self) -> None:
        """``ray start`` gives a node 30 s (fixed in Ray) to register with the head; on a
        loaded machine that can pass, and the node exits. Start it again (3 tries)."""
        for node in self.nodes:
            if node.process is not None and node.process.poll() is not None:
                assert node.starts < 3, f"node {node.name} failed to start 3 times; see {node.log}"
                node.stop()
                node.start(head=node.head)

    def wait_for_resources(self, resources: dict[str, float], timeout_s: float = 300.0) -> None:
        """Until the cluster (as a driver sees it) offers at least ``resources``."""
        code = ("import json,ray; ray.init(address=%r, log_to_driver=False); "
                "print(json.dumps(ray.available_resources()))" % self.address)
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            self.restart_failed_nodes()
            proc = subprocess.run([sys.executable, "-c", code], env=self.env,
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode == 0:
                have = json.loads(proc.stdout.strip().splitlines()[-1])
                if all(have.get(k, 0) >= v for k, v in resources.items()):
                    return
                last = proc.stdout[-500:]
            else:
                last = proc.stderr[-1500:]
            time.sleep(1)
        raise AssertionError(f"cluster did not offer {resources} in {timeout_s:g}s: {last}")

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
        subprocess.run(["rm", "-rf", str(self.temp_dir)], check=False)
