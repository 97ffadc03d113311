"""From a validated ``Config`` to running workers: the only place the controller
builds workers. The rest of the controller speaks to them through the protocols of
``workers.api`` (and reads their config types).

Two modes: Ray (the default: trainer and generators are Ray actors, the data plane is
TransferQueue) and local (every worker in this process on its own threads; the data
plane may be the in-memory twin). Local mode exists for fast tests and debugging; it
is chosen explicitly, never as a fallback.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from controller import crashpoints
from controller.config import Config
from workers.api import worker_label
from workers.dataplane import DataPlane, DataPlaneRuntime, make_dataplane
from workers.fencing import EpochToken
from workers.handles import (
    GeneratorClientImpl,
    LocalHandle,
    PayloadStoreImpl,
    Publisher,
    RayHandle,
    TrainerClientImpl,
)
from workers.service import GeneratorWorker, TrainerWorker, WorkerSpec
from workers.weight_transport import BucketTransport


#: tries to start a replacement worker (2, 4, 6, 8 s apart: longer than Ray takes to
#: declare a node with a killed raylet dead)
REPLACE_ATTEMPTS = 5


class WorkerStartError(RuntimeError):
    """A worker (or Ray / the data plane) could not be started; the message says which."""


@dataclass
class Workers:
    """The started workers, plus how to replace one that died (``WorkerRestarter``)."""

    trainer: TrainerClientImpl
    generators: list[GeneratorClientImpl]
    publisher: Publisher
    payloads: PayloadStoreImpl
    dataplane: DataPlane
    handles: list[Any]
    #: builds a fresh handle: (role, name) -> handle
    factory: Callable[[str, str], Any] | None = None
    #: this controller's epoch, stamped by every handle on every call (workers.fencing);
    #: set when the controller reconciles the workers with the log
    token: EpochToken = field(default_factory=EpochToken)

    async def restart_trainer(self) -> None:
        self.trainer.handle = await self._replace(self.trainer.handle, "trainer", "trainer")

    async def restart_generator(self, name: str) -> None:
        for gen in self.generators:
            if gen.name == name:
                gen.handle = await self._replace(gen.handle, "generator", name)
                return
        raise KeyError(f"no generator named {name!r}")

    async def _replace(self, old: Any, role: str, name: str) -> Any:
        if self.factory is None:
            raise WorkerStartError(f"cannot restart {role} {name}: no worker factory")
        try:
            old.close()
        except Exception:
            pass  # it is dead already
        # A replacement may be placed on a node that is dying but not yet declared dead
        # (Ray's health check takes seconds) and die with it: try again, later.
        for attempt in range(REPLACE_ATTEMPTS):
            try:
                new = await asyncio.to_thread(self.factory, role, name)
                break
            except WorkerStartError:
                if attempt == REPLACE_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(2.0 * (attempt + 1))
        new.token = self.token
        self.handles = [new if h is old else h for h in self.handles]
        return new

    def kill_worker(self, name: str) -> None:
        """Chaos hook: make a worker die as a crashed process would."""
        handle = self.trainer.handle if name == "trainer" else next(
            (g.handle for g in self.generators if g.name == name), None
        )
        if handle is None:
            raise ValueError(f"chaos hook: no worker named {name!r}")
        if isinstance(handle, RayHandle):
            import os
            import signal

            import ray

            try:  # kill -9 of the actor's process, as a crash would
                os.kill(ray.get(handle.actor.pid.remote(), timeout=30), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # on another node
                ray.kill(handle.actor, no_restart=True)
        else:
            handle.kill(f"killed by chaos hook ({name})")

    def close(self) -> None:
        crashpoints.set_worker_killer(None)
        for handle in self.handles:
            try:
                handle.close()
            except Exception:
                pass
        try:
            self.dataplane.close()
        except Exception:
            pass


def worker_spec(cfg: Config, run_id: str, run_dir: Path) -> WorkerSpec:
    """The workers' part of ``cfg``: the tables they own are handed over as they are
    (each component takes its own table), with the run's values beside them: its id,
    seed, and where the data plane lives (under ``run_dir``, on this run's Ray)."""
    return WorkerSpec(
        run_id=run_id,
        seed=cfg.run.seed,
        model=cfg.model,
        task=cfg.task,
        sampling=cfg.sampling,
        train=cfg.train,
        dataplane=cfg.dataplane,
        dataplane_runtime=DataPlaneRuntime(
            run_dir=str(run_dir), ray_address=cfg.ray.address, ray_num_cpus=cfg.ray.num_cpus
        ),
        generator_backend=cfg.rollout.backend,
        vllm=cfg.rollout.vllm,
        partial=cfg.rollout.partial,
        refit_bucket_mib=cfg.rollout.refit_bucket_mib,
    )


def init_ray(cfg: Config) -> None:
    import ray

    if ray.is_initialized():
        return
    try:
        if cfg.ray.address:
            ray.init(address=cfg.ray.address, log_to_driver=False)
        else:
            ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False, log_to_driver=False)
    except Exception as err:
        where = cfg.ray.address or "a local Ray"
        raise WorkerStartError(f"cannot start or join Ray ({where}): {err}") from None


def start_workers(cfg: Config, spec: WorkerSpec, *, local: bool) -> Workers:
    if local:
        return _start_local(cfg, spec)
    init_ray(cfg)
    return _start_ray(cfg, spec)


def _start_local(cfg: Config, spec: WorkerSpec) -> Workers:
    if spec.generator_backend == "vllm" and cfg.rollout.num_generators > 1:
        # vLLM's parallel state is process-global: one engine per process
        raise WorkerStartError(
            "rollout.backend = \"vllm\" with --local-workers runs one generator "
            f"(rollout.num_generators = {cfg.rollout.num_generators}); use Ray workers for more"
        )
    plane = make_dataplane(spec.dataplane, spec.dataplane_runtime)

    def factory(role: str, name: str) -> LocalHandle:
        if role == "trainer":
            return LocalHandle(TrainerWorker(spec, plane), name=name, role=role,
                               torch_threads=spec.torch_threads)
        # two threads: a weight update may arrive while a group is generating
        return LocalHandle(GeneratorWorker(spec, name, plane), threads=2, name=name, role=role,
                           torch_threads=spec.torch_threads)

    return _assemble(cfg, spec, plane, factory)


def _start_ray(cfg: Config, spec: WorkerSpec) -> Workers:
    import ray

    # The actors join the data plane this process starts: created before it, their
    # processes start (and import torch, TransferQueue, the models) while it starts.
    joining = replace(spec, dataplane_runtime=replace(spec.dataplane_runtime, join=True))
    offered = ray.cluster_resources()
    for key, label in (("train", cfg.train.node_resource), ("rollout", cfg.rollout.node_resource)):
        if label and offered.get(label, 0) <= 0:  # the actor would pend forever
            raise WorkerStartError(
                f"{key}.node_resource = {label!r}: no node in the Ray cluster offers it "
                f"(start one with ray start --resources '{{\"{label}\": 1}}')"
            )
    started: set[str] = set()

    def create(role: str, name: str) -> tuple[Any, Any]:
        if role == "trainer":
            where = _on_node(cfg.train.node_resource)
            actor = ray.remote(TrainerWorker).options(num_cpus=1, **where).remote(joining)
            probe = actor.version_and_digest.remote()
        else:
            # A replacement after a node loss may go anywhere when so configured;
            # otherwise it waits (pending in Ray) for a node offering the resource.
            moved = name in started and cfg.rollout.on_node_loss == "anywhere"
            where = {} if moved else _on_node(cfg.rollout.node_resource)
            actor = ray.remote(GeneratorWorker).options(
                num_cpus=1, max_concurrency=2, **where
            ).remote(joining, name)
            probe = actor.weight_version.remote()
        started.add(name)
        return actor, probe

    def ready(role: str, name: str, actor: Any, probe: Any) -> RayHandle:
        label = worker_label(role, name)
        try:  # surface constructor errors now, with the worker's name
            ray.get(probe, timeout=cfg.ray.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor)
            free = ray.available_resources().get("CPU", 0.0)
            raise WorkerStartError(
                f"{label} (1 CPU) was not placed and built within "
                f"ray.placement_timeout_s = {cfg.ray.placement_timeout_s:g} s; the cluster "
                f"has {free:g} CPUs free of {ray.cluster_resources().get('CPU', 0.0):g}"
            ) from None
        except Exception as err:
            first = str(err).strip().splitlines()[-1] if str(err).strip() else ""
            raise WorkerStartError(f"{label} failed to start: {first or err!r}") from None
        return RayHandle(actor, name=name, role=role)

    def factory(role: str, name: str) -> RayHandle:
        return ready(role, name, *create(role, name))

    # Start-up: every actor is created at once, before the data plane, so that their
    # processes start and import in parallel with its own; then each is awaited (they
    # join the data plane once it is up). A restart later builds one at a time.
    wanted = [("trainer", "trainer")] + [
        ("generator", f"generator-{i}") for i in range(cfg.rollout.num_generators)
    ]
    pending = {name: (role, *create(role, name)) for role, name in wanted}
    built: dict[str, RayHandle] = {}
    plane = None
    try:
        try:
            plane = make_dataplane(spec.dataplane, spec.dataplane_runtime)
        except Exception as err:
            raise WorkerStartError(
                f"data plane ({spec.dataplane.kind}) failed to start: {err}"
            ) from None
        for name, (role, actor, probe) in pending.items():
            built[name] = ready(role, name, actor, probe)
    except WorkerStartError:
        for name, (_role, actor, _probe) in pending.items():
            ray.kill(actor)
        if plane is not None:
            plane.close()
        raise

    def first_start(role: str, name: str) -> RayHandle:
        return built.pop(name) if name in built else factory(role, name)

    workers = _assemble(cfg, spec, plane, first_start)
    workers.factory = factory
    return workers


def _on_node(resource: str) -> dict[str, Any]:
    """Ray options that pin an actor to nodes started with ``--resources {resource: n}``.

    A sliver of the resource is asked for, so any number of actors fit on such a node.
    """
    return {"resources": {resource: 0.001}} if resource else {}


def _assemble(cfg: Config, spec: WorkerSpec, plane: DataPlane, factory) -> Workers:
    trainer = TrainerClientImpl(factory("trainer", "trainer"))
    gens = [
        GeneratorClientImpl(f"generator-{i}", factory("generator", f"generator-{i}"))
        for i in range(cfg.rollout.num_generators)
    ]
    workers = Workers(
        trainer=trainer,
        generators=gens,
        publisher=Publisher(trainer, gens, BucketTransport(spec.refit_bucket_bytes)),
        payloads=PayloadStoreImpl(plane, spec.run_id, trainer),
        dataplane=plane,
        handles=[trainer.handle, *(g.handle for g in gens)],
        factory=factory,
    )
    for handle in workers.handles:
        handle.token = workers.token
    crashpoints.set_worker_killer(workers.kill_worker)
    return workers
