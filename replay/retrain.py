"""Deterministic replay: rebuild a run's weights by following its log, step by step.

``rl-controller replay --run X --retrain [--from-checkpoint V] --verify`` is the proof
that the log determines the model. From the initial weights (seeded by the logged
config) or from checkpoint V, it re-runs every finished step after it exactly as the
log recorded it -- the same groups in the same microbatch order, advantages from the
recorded rewards, payload rows read back from the run's durable spill directory -- and
compares each resulting weights digest with the one its ``StepFinished`` recorded.

It needs the payload rows of every step it re-trains: with
``checkpoint.retain_payloads = "until_checkpoint"`` rows covered by a checkpoint are
deleted, so start from a checkpoint at or after the last release, or run with
``retain_payloads = "all"`` (and ``dataplane.spill = true``) to replay from step 0.

The trainer is built in this process from the run's logged config
(``controller.wiring.worker_spec``); nothing is appended to the log and the spill
directory is only read.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from controller.retraining import checkpoints_on_disk, missing_payloads, retrain_step
from controller.core.state import CheckpointRecord, RunState
from replay.settings import recorded_config


class RetrainError(RuntimeError):
    """The log cannot be replayed as asked (no such checkpoint, payloads missing)."""


@dataclass(frozen=True)
class StepCheck:
    step: int
    trainer_version: int
    recorded: str
    replayed: str
    #: seconds this replay took for the step / the original run took (StepBegun..Finished)
    replay_s: float
    original_s: float

    @property
    def match(self) -> bool:
        return self.recorded == self.replayed


@dataclass
class RetrainReport:
    run_id: str
    from_version: int
    from_uri: str | None
    checks: list[StepCheck] = field(default_factory=list)
    final_digest: str | None = None

    @property
    def ok(self) -> bool:
        return all(c.match for c in self.checks)

    def to_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "from_trainer_version": self.from_version,
            "from_checkpoint": self.from_uri,
            "steps": [
                {"step": c.step, "trainer_version": c.trainer_version, "recorded": c.recorded,
                 "replayed": c.replayed, "match": c.match, "replay_s": round(c.replay_s, 4),
                 "original_s": round(c.original_s, 4)}
                for c in self.checks
            ],
            "final_digest": self.final_digest,
            "ok": self.ok,
        }


def pick_checkpoint(state: RunState, version: int | None) -> CheckpointRecord | None:
    """The checkpoint to start from: None = initial weights (version None or 0 w/o one)."""
    if version is None:
        return None
    usable, gone = checkpoints_on_disk(state)
    for ck in reversed(usable):
        if ck.trainer_version == version:
            return ck
    if version == 0:
        return None
    have = sorted({c.trainer_version for c in usable})
    missing = "" if not gone else (
        f"; missing, their files gone: {sorted({c.trainer_version for c in gone})} "
        f"({', '.join(dict.fromkeys(c.uri for c in gone))})"
    )
    raise RetrainError(
        f"no usable checkpoint of trainer_version {version} in run {state.run_id!r} "
        f"(usable: {have or 'none'}{missing}; 0 = the initial weights)"
    )


def _spill_plane(run_dir: Path, run_id: str):
    from workers.dataplane import MemoryDataPlane, SpillDataPlane

    spill = run_dir / "spill"
    if not spill.is_dir():
        raise RetrainError(
            f"no spill directory at {spill}: replaying needs the payload rows "
            "(dataplane.spill = true)"
        )
    plane = SpillDataPlane(MemoryDataPlane(), spill)
    plane.reload(run_id, tidy=False)  # a replay only reads: the run may be live
    return plane


def build_trainer(state: RunState, run_dir: Path, plane):
    """A trainer client over an in-process TrainerWorker built from the logged config."""
    from controller.wiring import worker_spec
    from workers.handles import LocalHandle, TrainerClientImpl
    from workers.service import TrainerWorker

    cfg = recorded_config(state)
    spec = worker_spec(cfg, state.run_id, run_dir)
    return TrainerClientImpl(LocalHandle(TrainerWorker(spec, plane), name="replay-trainer",
                                         role="trainer", torch_threads=spec.torch_threads))


async def retrain(
    state: RunState,
    trainer,
    present: set[str],
    *,
    from_checkpoint: CheckpointRecord | None,
    stop_on_mismatch: bool,
    on_step: Callable[[StepCheck], None] | None = None,
) -> RetrainReport:
    base = 0 if from_checkpoint is None else from_checkpoint.trainer_version
    records = state.steps_after(base)
    lost = missing_payloads(state, records, present)
    if lost:
        raise RetrainError(
            f"the payload rows of {len(lost)} groups needed to re-train steps after "
            f"trainer_version {base} are not in the spill directory (e.g. {lost[:3]}); "
            "they were released after a checkpoint covered them "
            "(checkpoint.retain_payloads = \"until_checkpoint\") or lost. Start from a newer "
            "checkpoint with --from-checkpoint, or record runs with retain_payloads = \"all\""
        )
    report = RetrainReport(state.run_id, base, None if from_checkpoint is None else from_checkpoint.uri)
    if from_checkpoint is not None:
        await trainer.load_checkpoint(from_checkpoint.uri, from_checkpoint.sha256)
    for record in records:
        started = time.perf_counter()
        got = await retrain_step(trainer, state, record)
        check = StepCheck(
            step=record.step, trainer_version=record.trainer_version or 0,
            recorded=record.weights_digest or "", replayed=got,
            replay_s=time.perf_counter() - started,
            original_s=max(0.0, record.ended_ts - record.begun_ts),
        )
        report.checks.append(check)
        if on_step is not None:
            on_step(check)
        if not check.match and stop_on_mismatch:
            break
    report.final_digest = (await trainer.version_and_digest())[1]
    return report


def run_retrain(
    state: RunState,
    run_dir: Path,
    *,
    from_version: int | None,
    stop_on_mismatch: bool,
    on_step: Callable[[StepCheck], None] | None = None,
) -> RetrainReport:
    """Build the trainer and data plane for ``state``'s run and replay its steps."""
    ck = pick_checkpoint(state, from_version)
    plane = _spill_plane(run_dir, state.run_id)
    trainer = build_trainer(state, run_dir, plane)
    try:
        return asyncio.run(retrain(
            state, trainer, set(plane.list(state.run_id)),
            from_checkpoint=ck, stop_on_mismatch=stop_on_mismatch, on_step=on_step,
        ))
    finally:
        trainer.handle.close()
        plane.close()
