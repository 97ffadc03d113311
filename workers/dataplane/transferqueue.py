"""TransferQueue adapter: the only module in the project that imports ``transfer_queue``.

Uses TransferQueue's key/value API (``kv_batch_put`` / ``kv_batch_get`` / ``kv_list`` /
``kv_clear``) over its SimpleStorage backend (in-memory storage units run as Ray
actors). Rows travel as TransferQueue's own type, a ``TensorDict`` with one batch entry
per key (``workers.dataplane.api.batch_of``: jagged fields as nested tensors), and
``get_batch`` hands TransferQueue's TensorDict on as it comes. Non-scalar fields come
back jagged even when they went in dense; ``api.split_rows`` reads either. The adapter
hides two sharp edges behind the data plane contract:

* **Missing data is silent.** An absent key or field is dropped from the result (or
  yields an empty batch); the adapter checks what came back and raises
  :class:`MissingPayloadError` naming the missing keys/fields.
* **Start-up.** ``transfer_queue.init`` hangs when Ray has fewer than 4 logical CPUs;
  the adapter starts Ray with enough CPUs itself, or refuses an existing cluster that
  has too few, and wraps any start-up failure in :class:`DataPlaneUnavailable` --
  never a silent fallback to memory.
* **No start-up timeout.** ``transfer_queue.init`` waits for its controller and
  storage-unit actors without a limit, and Ray never fails an actor it cannot place.
  The process that starts TransferQueue watches it: past ``start_timeout_s`` it names
  the actors that are not up, kills the ones it created (which unblocks ``init``)
  and raises :class:`DataPlaneUnavailable`. A process that only joins a running
  TransferQueue (a worker) has no such watch: it never kills shared actors.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
import ray
from tensordict import TensorDict

from workers.dataplane.api import (
    DataPlaneUnavailable,
    Fields,
    MissingPayloadError,
    Row,
    Tags,
    as_columns,
    batch_of,
    rows_of,
)
from workers.dataplane.config import DataPlaneRuntime, DataPlaneSection

#: TransferQueue's controller and storage units need this many logical CPUs in Ray.
MIN_RAY_CPUS = 4


def _ensure_ray(runtime: DataPlaneRuntime) -> None:
    if not ray.is_initialized():
        if not runtime.ray_address:
            ray.init(
                num_cpus=max(runtime.ray_num_cpus, MIN_RAY_CPUS),
                include_dashboard=False,
                log_to_driver=False,
            )
        else:
            ray.init(address=runtime.ray_address, log_to_driver=False)
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < MIN_RAY_CPUS:
        raise DataPlaneUnavailable(
            f"Ray has {cpus:g} logical CPUs; TransferQueue needs at least {MIN_RAY_CPUS} "
            f"(start Ray with ray.init(num_cpus={MIN_RAY_CPUS}) or more)"
        )


def preload() -> None:
    """Import ``transfer_queue`` (seconds: zmq, omegaconf, its storage managers) ahead of
    the first ``TransferQueueDataPlane``, e.g. on a thread while Ray starts."""
    import transfer_queue  # noqa: F401


_CONTROLLER = ("TransferQueueController", "transfer_queue")  # name, namespace
_STORAGE_UNIT = "TransferQueueStorageUnit#{}"  # named in the starting job's namespace


def _named_actor(name: str, namespace: str | None = None):
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _init_watched(tq, conf: dict, cfg: DataPlaneSection, units: int) -> bool:
    """``tq.init`` with a limit when this process is the one that starts TransferQueue;
    True when it did start it (False: it joined a running one)."""
    if _named_actor(*_CONTROLLER) is not None:
        tq.init(conf)  # joining: the shared actors are not this process's to kill
        return False
    done = threading.Event()
    verdict: list[str] = []

    def watch() -> None:
        if done.wait(cfg.start_timeout_s):
            return
        verdict.append(_pending(cfg, units))
        for actor in _our_actors(units):
            try:
                ray.kill(actor)  # fails init's pending ray.get, and frees the cluster
            except Exception:
                pass

    watcher = threading.Thread(target=watch, name="transferqueue-start-watch", daemon=True)
    watcher.start()
    try:
        tq.init(conf)
    except Exception:
        if not verdict:
            raise
    finally:
        done.set()
        watcher.join()
    if verdict:
        try:
            tq.close()  # forget the killed actors (this process may start it again)
        except Exception:
            pass
        raise DataPlaneUnavailable(verdict[0])
    return True


def _await_started(cfg: DataPlaneSection, poll_s: float = 0.1) -> None:
    """Wait until TransferQueue's controller is named and holds its configuration (it
    does once its storage units are up), for at most ``start_timeout_s``."""
    deadline = time.monotonic() + cfg.start_timeout_s
    while True:
        controller = _named_actor(*_CONTROLLER)
        if controller is not None:
            # bounded like the rest of the wait: a controller that does not answer is
            # "not up yet", never a wait without a limit
            ref = controller.get_config.remote()
            ready, _ = ray.wait([ref], timeout=max(deadline - time.monotonic(), poll_s))
            if ready and ray.get(ref) is not None:
                return
        if time.monotonic() > deadline:
            waiting = "its controller" if controller is None else "its storage units"
            raise DataPlaneUnavailable(
                f"no TransferQueue to join within dataplane.start_timeout_s = "
                f"{cfg.start_timeout_s:g} s (waiting for {waiting})"
            )
        time.sleep(poll_s)


def _storage_units(units: int) -> list:
    """The storage units 0 .. units - 1 that exist now."""
    return [a for a in (_named_actor(_STORAGE_UNIT.format(i)) for i in range(units)) if a is not None]


def _our_actors(units: int) -> list:
    controller = _named_actor(*_CONTROLLER)
    return _storage_units(units) + ([] if controller is None else [controller])


def _answers(actor) -> bool:
    ready, _ = ray.wait([actor.get_zmq_server_info.remote()], timeout=1.0)
    return bool(ready)


def _pending(cfg: DataPlaneSection, units: int) -> str:
    """Which of TransferQueue's ``units`` actors are not up yet, and what Ray has free."""
    pending: list[str] = []
    controller = _named_actor(*_CONTROLLER)
    if controller is None or not _answers(controller):
        pending.append("its controller")
    absent = []
    for i in range(units):
        unit = _named_actor(_STORAGE_UNIT.format(i))
        if unit is None:
            absent.append(i)
        elif not _answers(unit):
            pending.append(f"storage unit {i}")
    if absent:
        pending.append(f"storage unit(s) {', '.join(map(str, absent))} (not created yet)")
    free = ray.available_resources().get("CPU", 0.0)
    total = ray.cluster_resources().get("CPU", 0.0)
    return (
        f"TransferQueue did not start within dataplane.start_timeout_s = "
        f"{cfg.start_timeout_s:g} s; waiting for "
        f"{'; '.join(pending) or 'its client'} (1 CPU each; Ray has {free:g} of "
        f"{total:g} CPUs free)"
    )


class TransferQueueDataPlane:
    """Data plane over TransferQueue's SimpleStorage backend (``[dataplane]``, placed on
    the run's Ray by ``runtime``; the spill is ``make_dataplane``'s)."""

    def __init__(
        self, cfg: DataPlaneSection = DataPlaneSection(),
        runtime: DataPlaneRuntime = DataPlaneRuntime(),
    ) -> None:
        try:
            import transfer_queue as tq

            _ensure_ray(runtime)
            units = cfg.units(runtime.ray_address)
            storage: dict = {"num_data_storage_units": units}
            if cfg.storage_node_resource:
                storage["required_node_resource"] = cfg.storage_node_resource
            started = False
            if runtime.join:
                _await_started(cfg)
                tq.init()  # joins the running TransferQueue
            else:
                started = _init_watched(tq, {"backend": {"SimpleStorage": storage}}, cfg, units)
        except DataPlaneUnavailable:
            raise
        except Exception as err:  # any start-up failure is fatal, never a fallback
            raise DataPlaneUnavailable(f"TransferQueue failed to start: {err!r}") from err
        self._tq = tq
        #: storage units this process started (its ``close`` removes them)
        self._units = units if started else 0
        # TransferQueue's client is not safe for concurrent calls from threads.
        self._lock = threading.Lock()

    # -- protocol -----------------------------------------------------------------

    def put(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Fields,
        tags: Sequence[Tags] | None = None,
    ) -> None:
        keys, columns, tag_list = as_columns(keys, fields, tags)
        td = batch_of(columns, len(keys))
        with self._lock:
            self._tq.kv_batch_put(keys=keys, partition_id=partition, fields=td, tags=tag_list)

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> list[Row]:
        return rows_of(self.get_batch(partition, keys, fields)) if keys else []

    def get_batch(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> TensorDict:
        keys = list(keys)
        if not keys:
            return TensorDict({}, batch_size=[0])
        select = None if fields is None else list(fields)
        with self._lock:
            try:
                td = self._tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=select)
            except ValueError:
                td = None
            if td is None or td.batch_size[0] != len(keys) or (
                select is not None and any(f not in td.keys() for f in select)
            ):
                raise self._diagnose(partition, keys, fields)
        return td

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None:
        with self._lock:
            present = set(self._list(partition))
            doomed = sorted(present if keys is None else present.intersection(keys))
            if doomed:
                self._tq.kv_clear(keys=doomed, partition_id=partition)

    def list(self, partition: str) -> list[str]:
        with self._lock:
            return self._list(partition)

    def tags(self, partition: str) -> dict[str, Tags]:
        with self._lock:
            listing = self._tq.kv_list(partition_id=partition).get(partition, {})
        return {k: dict(v or {}) for k, v in sorted(listing.items())}

    def close(self) -> None:
        """Stop TransferQueue's controller and storage (started by this process).

        The storage units this process started are killed first: ``tq.close`` would
        ask each to shut down and wait a second for its idle threads to notice, and
        they hold nothing that outlives the data plane (no SSD offload is configured;
        the spill is the durable copy). A process that joined only closes its client.
        """
        with self._lock:
            for unit in _storage_units(self._units):
                ray.kill(unit)
            self._tq.close()

    # -- helpers ------------------------------------------------------------------

    def _list(self, partition: str) -> list[str]:
        return sorted(self._tq.kv_list(partition_id=partition).get(partition, {}))

    def _diagnose(
        self, partition: str, keys: list[str], fields: Sequence[str] | None
    ) -> MissingPayloadError:
        """Work out which keys or fields a short result was missing."""
        present = set(self._list(partition))
        missing = [k for k in keys if k not in present]
        if missing or fields is None:
            return MissingPayloadError(partition, keys=missing or keys)
        have: set[str] | None = None
        for key in keys:  # a field must be present on every requested key
            td = self._tq.kv_batch_get(keys=[key], partition_id=partition)
            names = set(td.keys())
            have = names if have is None else have & names
        return MissingPayloadError(partition, fields=[f for f in fields if f not in (have or set())])
