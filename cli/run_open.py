"""Opening a run for ``rl-controller run``: what must hold or be up before the log is
written, and what is undone when a start fails.

* guards: a resume would fence a live controller (``check_not_held``); the hash chain's
  key must match the logged chain's algorithm (``chain_key``); a new run's directory
  goes again when Ray fails before the log has the run (``removed_unless_created``);
* the Prometheus endpoint is bound before the run is opened (``metrics_served``), so a
  port already taken leaves nothing behind;
* Ray is started (or joined) while the workers' modules are imported (``start_ray``);
* the start-up milestones (``mark``), logged at the first step.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from cli import quiet, ray_cluster
from cli.common import CliError, last_controller, load_chain_key, open_store
from controller.config import Config
from events.chain import HMAC_SHA256, SHA256, Chain

if TYPE_CHECKING:
    from controller.prometheus import ControllerMetrics

#: seconds since this process started, at each start-up milestone (logged at step 1)
PHASES: dict[str, float] = {}


def mark(phase: str) -> None:
    try:
        import psutil

        PHASES[phase] = time.time() - psutil.Process().create_time()
    except Exception:  # psutil is Ray's dependency; the milestones are only a log line
        pass


@contextlib.contextmanager
def removed_unless_created(run_dir: Path) -> Iterator[None]:
    """A new run's directory goes again when Ray fails to start or join before the log
    has the run: it would hold only ``third_party.log``, under a name that neither
    ``runs`` nor ``delete`` knows (the error line already says what failed)."""
    existed = run_dir.exists()
    try:
        yield
    except BaseException:
        if not existed:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def check_not_held(args: argparse.Namespace, store, run_id: str) -> None:
    """A resume would fence a live controller: it must be asked for (``--takeover``)."""
    holder = last_controller(store, run_id, store.last_position(run_id))
    if holder.running_here() and not args.takeover:
        raise CliError(
            f"run {run_id} is held by a running controller (pid {holder.pid} on this host); "
            "stop it first (Ctrl-C in its terminal), or pass --takeover to fence it and "
            "continue here"
        )


def check_run_dir(args: argparse.Namespace, run_id: str) -> None:
    """A resume reads the run's spill and checkpoints from ``--data-dir``; one pointed at
    a directory where the run never ran found no spill and evicted every buffered group
    as "payload lost" -- for good, on the log -- or stopped for lost payloads (seen with
    ``--redis-url``, where the log is found whatever ``--data-dir`` says)."""
    run_dir = Path(args.data_dir) / "runs" / run_id
    if not run_dir.is_dir():
        raise CliError(
            f"run {run_id} has no run directory {str(run_dir)!r} (its payload spill and "
            "checkpoints): pass the --data-dir it was started with, or create the directory "
            "to resume without them"
        )


def chain_key(args: argparse.Namespace, cfg: Config | None, run_id: str) -> bytes | None:
    """The hash chain's key: from the config of a new run, from the logged one on resume.

    A resumed run must keep its chain's algorithm: an HMAC chain continued with plain
    SHA-256 (or the other way round) would no longer verify, so that fails here, before
    anything is written.
    """
    if cfg is not None:
        return load_chain_key(cfg.store.chain_key_file)
    with open_store(args, start=True) as store:
        if not store.run_exists(run_id) or store.last_position(run_id) == 0:
            return None  # resume_run says what is wrong
        first = store.read(run_id, 1, 1)[0].event
        logged = getattr(first, "config", {}) or {}
        table = logged.get("store") or {}  # not a table (tampered): the config load says so
        key = load_chain_key(str(table.get("chain_key_file", ""))) if isinstance(table, dict) else None
        head = store.chain_head(run_id)
    if head is not None and head.algorithm not in ("", SHA256, HMAC_SHA256):
        raise CliError(
            f"run {run_id!r}: its meta names chain_alg {head.algorithm!r}, neither {SHA256!r} "
            f"nor {HMAC_SHA256!r}: it was changed outside rl-controller ('rl-controller audit' "
            "checks the chain)"
        )
    if head is not None and head.algorithm and head.algorithm != Chain(run_id, key).algorithm:
        raise CliError(
            f"run {run_id!r} has a {head.algorithm} hash chain but the key file gives "
            f"{'none' if key is None else 'a key'}; restore store.chain_key_file"
        )
    return key


@contextlib.contextmanager
def metrics_served(cfg: Config) -> Iterator[ControllerMetrics | None]:
    """With ``metrics.port`` set: Prometheus ``/metrics`` served from before the run is
    opened (a port already taken is refused before anything is written) until the
    command ends; ``run_cmd`` feeds it the writer's appends. None when off."""
    if not cfg.metrics.port:
        yield None
        return
    from controller.prometheus import ControllerMetrics  # only a run that serves loads it

    exporter = ControllerMetrics()
    try:
        exporter.serve(cfg.metrics)
    except OSError as err:
        raise CliError(f"metrics.port {cfg.metrics.port} on {cfg.metrics.host}: {err.strerror or err}") from None
    try:
        yield exporter
    finally:
        exporter.close()


def start_ray(args: argparse.Namespace, cfg: Config, run_id: str) -> None:
    """Third-party output to the run's log file, then Ray up and checked (no writes yet)."""
    third_party_log = Path(args.data_dir) / "runs" / run_id / "third_party.log"
    quiet.size_transferqueue_threads()
    quiet.route_to_file(third_party_log)
    # The workers' modules (torch, TransferQueue: seconds of imports) load while Ray
    # starts: ray.init mostly waits on its daemons, so this uses an otherwise idle core.
    preload = threading.Thread(target=_preload_worker_modules, args=(cfg,),
                               name="preload-worker-modules", daemon=True)
    preload.start()
    try:
        # --local-workers still starts Ray for a trainer of several ranks (rank actors);
        # started here, its output goes to the log file like a Ray run's.
        ranks = cfg.train.data_parallel * cfg.train.tensor_parallel
        if not args.local_workers or ranks > 1:
            ray_cluster.connect(cfg, third_party_log)
            quiet.route_to_file(third_party_log)  # loggers Ray created while connecting
    finally:
        preload.join()


def _preload_worker_modules(cfg: Config) -> None:
    """Import what starting the workers imports; an error here is left to that start."""
    try:
        import controller.wiring  # noqa: F401  (torch, the models, the workers)
        from workers.dataplane import preload

        preload(cfg.dataplane.kind)
        import torch.utils.tensorboard  # noqa: F401  (the metrics sink's, before the workers start)
    except Exception:
        pass
