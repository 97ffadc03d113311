"""In-process controllers over real worker objects, for recovery and fencing tests.

``LocalRun`` wires a run like ``rl-controller run --local-workers`` does (the same
``controller.wiring`` factory, real ``TrainerWorker``/``GeneratorWorker`` objects, the
memory data plane with the durable spill) but every handle is a
:class:`CountingHandle`: a real in-process worker handle that also records each call
the controller makes, so a test can assert what a controller did *not* do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.config import Config, load_config
from controller.loop import Controller
from controller.recovery import reconcile_workers
from cli.run_cmd import checkpoint_dir
from controller.wiring import Workers, _assemble, worker_spec
from workers.calls import call_name
from workers.dataplane import make_dataplane
from workers.handles import LocalHandle, PayloadStoreImpl
from workers.service import GeneratorWorker, TrainerWorker

TINY = [
    "dataplane.kind=memory", "train.groups_per_step=2", "train.groups_per_microbatch=1",
    "rollout.samples_per_group=4", "checkpoint.every_steps=2", "checkpoint.retain_payloads=all",
    "task.num_prompts=64", "model.d_model=32", "sampling.max_new_tokens=6",
    "controller.stall_timeout_s=60",
]


@dataclass
class CallLog:
    """Every worker / data-plane call a controller made, in order, with a phase tag."""

    calls: list[tuple[str, str, str]] = field(default_factory=list)
    phase: str = "before"

    def record(self, who: str, method: str) -> None:
        self.calls.append((self.phase, who, method))

    def during(self, phase: str) -> list[tuple[str, str]]:
        return [(who, m) for p, who, m in self.calls if p == phase]


class CountingHandle(LocalHandle):
    """A real in-process worker handle that records each call (and may run a hook)."""

    def __init__(self, obj: Any, calls: CallLog, *, hooks: dict | None = None, **kw: Any) -> None:
        super().__init__(obj, **kw)
        self.calls = calls
        self.hooks = hooks if hooks is not None else {}

    def submit(self, call: Callable[..., Any], *args: Any) -> asyncio.Future:
        # every call goes through submit (``call`` awaits it): record it when issued
        method = call_name(call)
        self.calls.record(self.name, method)
        issued = super().submit(call, *args)
        hook = self.hooks.pop(method, None)
        if hook is None:
            return issued

        async def then_hook() -> Any:  # the hook runs as the result comes back
            result = await issued
            hook()
            return result

        return asyncio.ensure_future(then_hook())


class CountingPayloads(PayloadStoreImpl):
    def __init__(self, plane: Any, partition: str, calls: CallLog, trainer: Any = None) -> None:
        super().__init__(plane, partition, trainer)
        self.calls = calls

    async def delete(self, keys: list[str]) -> None:
        self.calls.record("dataplane", "delete")
        await super().delete(keys)

    async def keys(self) -> list[str]:
        self.calls.record("dataplane", "keys")
        return await super().keys()


def tiny_config(tmp: Path, *extra: str) -> Config:
    return load_config(None, [*TINY, *extra])


@dataclass
class LocalRun:
    cfg: Config
    run_dir: Path
    workers: Workers
    calls: CallLog
    hooks: dict[str, dict]


def start_local(cfg: Config, run_id: str, run_dir: Path) -> LocalRun:
    spec = worker_spec(cfg, run_id, run_dir)
    plane = make_dataplane(spec.dataplane, spec.dataplane_runtime)
    calls = CallLog()
    hooks: dict[str, dict] = {}

    def factory(role: str, name: str) -> CountingHandle:
        obj = TrainerWorker(spec, plane) if role == "trainer" else GeneratorWorker(spec, name, plane)
        return CountingHandle(obj, calls, hooks=hooks.setdefault(name, {}), name=name, role=role,
                              threads=1 if role == "trainer" else 2)

    workers = _assemble(cfg, spec, plane, factory)
    workers.payloads = CountingPayloads(plane, run_id, calls, workers.trainer)
    return LocalRun(cfg, run_dir, workers, calls, hooks)


def controller_for(run: LocalRun, writer, **kw: Any) -> Controller:
    w = run.workers
    return Controller(writer, run.cfg, w.trainer, w.generators, w.publisher, w.payloads,
                      checkpoint_dir=checkpoint_dir(run.run_dir), restarter=w, **kw)


def reconcile(run: LocalRun, writer, **kw: Any) -> None:
    asyncio.run(reconcile_workers(
        writer, run.workers, run.cfg.checkpoint, checkpoint_dir=checkpoint_dir(run.run_dir), **kw
    ))
