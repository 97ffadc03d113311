"""Ray for a run: what the run needs from a cluster, and joining or starting it.

A run's Ray actors each reserve one logical CPU:

    data plane   TransferQueue's controller + its storage units (``dataplane.storage_units``;
                 by default 1 on a local Ray, 2 on a joined cluster)
    trainer      the trainer worker, plus one rank actor per rank when
                 ``train.data_parallel > 1``
    generators   ``rollout.num_generators``

Ray never fails an actor it cannot place: it waits. So the need is computed from the
config and compared with the cluster *before* anything is written to the log, and a
run that cannot be placed is refused with the numbers instead of hanging.

Token authentication (Ray >= 2.5x): ``ray start --head`` enables it when a token
exists (``~/.ray/auth_token``, ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``), but
``ray.init(address=...)`` with an explicit address only sends a token when
``RAY_AUTH_MODE=token`` is set. When a token is available and the mode is unset,
the run sets ``RAY_AUTH_MODE=token`` for itself; an authentication failure is
reported as one line naming the variables.

A joined address is checked first (``check_address``): a closed port, or one where
something other than a Ray head listens, is refused in seconds instead of
``ray.init``'s minutes of retries.

Nothing here stops a cluster: a joined cluster is only disconnected from, and a
local Ray started by the run is shut down by ``ray.shutdown`` (its own processes).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cli.common import CliError
from controller.config import Config

_AUTH_HELP = (
    "the cluster uses token authentication: export RAY_AUTH_MODE=token and the "
    "cluster's token as RAY_AUTH_TOKEN (or its file as RAY_AUTH_TOKEN_PATH; "
    "'ray get-auth-token' on the head prints it)"
)


#: A local Ray otherwise starts ``ray.num_cpus`` idle Python workers as the driver
#: connects; each imports Ray, and on a small machine they take the CPU from the
#: data plane's and the workers' own start (which start their processes anyway).
LOCAL_RAY_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


@dataclass(frozen=True)
class RayNeeds:
    """Logical CPUs a run's actors reserve, by role."""

    dataplane: int
    trainer: int
    generators: int

    @property
    def cpus(self) -> int:
        return self.dataplane + self.trainer + self.generators

    def describe(self) -> str:
        parts = [f"trainer {self.trainer}", f"generators {self.generators}"]
        if self.dataplane:
            parts.insert(0, f"data plane {self.dataplane} (TransferQueue controller + "
                            f"{self.dataplane - 1} storage units)")
        return f"{self.cpus} CPUs: " + ", ".join(parts)


def needs(cfg: Config) -> RayNeeds:
    dp = cfg.train.data_parallel
    return RayNeeds(
        dataplane=(1 + cfg.dataplane.units(cfg.ray.address)
                   if cfg.dataplane.kind == "transferqueue" else 0),
        trainer=1 + (dp if dp > 1 else 0),
        generators=cfg.rollout.num_generators,
    )


def check_local_capacity(cfg: Config) -> None:
    """A local Ray gets ``ray.num_cpus`` logical CPUs: refuse a run that cannot fit."""
    need = needs(cfg)
    if not cfg.ray.address and cfg.ray.num_cpus < need.cpus:
        raise CliError(
            f"the run needs {need.describe()}; ray.num_cpus = {cfg.ray.num_cpus} "
            f"(set ray.num_cpus >= {need.cpus})"
        )


def check_address(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast (one line) when ``--ray-address host:port`` is not a Ray head.

    ``ray.init`` would otherwise retry for minutes: on a closed port, and for ~14
    minutes on a port where something else listens (a Redis, a web server), during
    which Ctrl-C takes half a minute. A Ray head's address is its GCS, a gRPC server,
    which answers the HTTP/2 preface with a SETTINGS frame (RFC 9113, section 3.4);
    anything else is refused here. ``auto`` and ``ray://`` addresses are left to Ray.
    """
    if not address or address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise CliError(f"--ray-address {address!r}: expected host:port (or 'auto')")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s) as sock:
            answers = _answers_http2(sock, timeout_s)
    except OSError as err:
        raise CliError(f"cannot reach Ray at {address}: {err.strerror or err}") from None
    if not answers:
        raise CliError(
            f"--ray-address {address}: something listens there but does not answer as Ray "
            f"(no gRPC reply within {timeout_s:g} s); give the Ray head's address as "
            "'ray start --head' printed it"
        )


#: the HTTP/2 client preface followed by an empty SETTINGS frame
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _answers_http2(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server's first frame after the preface is SETTINGS (type 4)."""
    sock.settimeout(timeout_s)
    try:
        sock.sendall(_HTTP2_HELLO)
        head = b""
        while len(head) < 9:  # a frame header: length (3), type (1), flags, stream id
            chunk = sock.recv(9 - len(head))
            if not chunk:
                return False
            head += chunk
    except (socket.timeout, ConnectionError):
        return False
    return head[3] == 4


def _token_available() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
    return Path(path).is_file()


def _use_token_auth() -> None:
    """What ``ray.init`` does for a local cluster found by itself, for an explicit address."""
    os.environ["RAY_AUTH_MODE"] = "token"
    try:  # Ray caches its config at import: refresh it so this process sees the mode
        from ray._raylet import Config as RayletConfig

        RayletConfig.initialize("")
    except Exception:  # another Ray version: the environment variable still reaches it
        pass


def _is_auth_text(text: str) -> bool:
    return any(s in text for s in ("AuthenticationError", "Unauthenticated", "InvalidAuthToken"))


def _is_auth_error(err: BaseException) -> bool:
    return _is_auth_text(f"{type(err).__name__}: {err}")


@contextlib.contextmanager
def _stderr_into(log_file: Path) -> Iterator[list[str]]:
    """File descriptor 2 appended to ``log_file`` while the block runs; yields a list
    that receives what was written. Ray's C++ core logs (gRPC retries, auth failures)
    go straight to fd 2, past Python's logging; processes started meanwhile (a local
    Ray's daemons) keep writing there too, which is where they belong."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    captured: list[str] = []
    with open(log_file, "ab") as f:
        start = f.tell()
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            with open(log_file, "rb") as r:
                r.seek(start)
                captured.append(r.read(1 << 20).decode(errors="replace"))


def connect(cfg: Config, log_file: Path) -> None:
    """Join ``ray.address`` or start a local Ray, then check the run can be placed.

    Ray's own output while connecting goes to ``log_file``. A local Ray's workers
    inherit this process's environment (``TQ_NUM_THREADS``).
    """
    import ray

    if ray.is_initialized():
        return
    address = cfg.ray.address
    captured: list[str] = []
    try:
        with _stderr_into(log_file) as captured:
            if address:
                if "RAY_AUTH_MODE" not in os.environ and _token_available():
                    _use_token_auth()
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            else:
                ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False,
                         log_to_driver=False, configure_logging=False,
                         _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    except Exception as err:
        where = address or "a local Ray"
        if _is_auth_error(err) or any(_is_auth_text(t) for t in captured):
            raise CliError(f"cannot join Ray at {where}: {_AUTH_HELP}") from None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CliError(f"cannot start or join Ray ({where}): {first}") from None
    global _connected
    _connected = True
    if address:
        check_cluster_capacity(cfg)


#: whether ``connect`` initialised Ray in this process (so ``disconnect`` may end it)
_connected = False


def disconnect() -> None:
    """End what ``connect`` began: a local Ray is shut down, a cluster only left.

    Called when the run is over rather than left to Ray's exit hook, which first
    sleeps half a second for log messages the run routes to its file anyway.
    """
    global _connected
    if _connected:
        import ray

        _connected = False
        ray.shutdown()


def check_cluster_capacity(cfg: Config) -> None:
    """Refuse (and disconnect) when the joined cluster cannot place the run's actors."""
    import ray

    need = needs(cfg)
    total = ray.cluster_resources().get("CPU", 0.0)
    free = ray.available_resources().get("CPU", 0.0)
    if free >= need.cpus:
        return
    ray.shutdown()  # disconnect only: the cluster and its other jobs are not touched
    busy = f", {total - free:g} of them in use" if total > free else ""
    raise CliError(
        f"the Ray cluster at {cfg.ray.address} cannot place this run: it needs "
        f"{need.describe()}; the cluster has {total:g} CPUs{busy} "
        f"(start it with more CPUs, or lower rollout.num_generators, "
        f"dataplane.storage_units or train.data_parallel)"
    )
